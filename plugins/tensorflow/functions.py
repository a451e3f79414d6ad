"""Collectives on TensorFlow tensors through the custom async ops, eager or in tf.function.

In tf.function every op starts as soon as its input is computed, so gradient reductions
overlap the rest of the backward pass. Eagerly each op would wait for its collective
before the next is even submitted, so groups run inside one tf.function of their own.
IndexedSlices (embedding gradients) are densified before the allreduce: the core has no
allgather, and a dense sum is what the optimizer applies anyway.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from commsched.tensorflow import _build

import commsched
import tensorflow as tf

_REDUCE_OPS = {"sum": 0, "average": 1}
_SUPPORTED = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8, tf.int8)
# Bytes of a broadcast travel unchanged, so other dtypes go as a same-width type.
_BROADCAST_AS = {1: tf.uint8, 2: tf.float16, 4: tf.int32, 8: tf.int64}
_unnamed = itertools.count()


def require_init(what: str) -> None:
    """Raises a clear error when commsched.init() has not run."""
    if not commsched.is_initialized():
        raise RuntimeError(
            f"commsched.tensorflow.{what} needs commsched.init() first (commsched is not initialised "
            "in this process); call commsched.init() before building or training the model"
        )
    # The ops reach the core through its C ABI with host memory, not through commsched's Python
    # submit path, so a transport that init() left to the first tensor is chosen now, for the host.
    commsched._start_pending(cuda=False)


def _core_library() -> str:
    from commsched import _core

    return str(_core.__file__)


def _reduce_code(op: str) -> int:
    if op not in _REDUCE_OPS:
        raise ValueError(f'op must be "sum" or "average", not {op!r}')
    return _REDUCE_OPS[op]


def densify(value: Any) -> Any:
    """An IndexedSlices gradient as the dense tensor it stands for; other values unchanged."""
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def variable_label(variable: Any) -> str:
    """A variable's name for tensor names: Keras 3 `path`, else the tf.Variable name."""
    label = getattr(variable, "path", None) or getattr(variable, "name", "") or "var"
    return str(label).removesuffix(":0")


def _allreduce_op(tensor: tf.Tensor, name: str, code: int, priority: int) -> tf.Tensor:
    if tensor.dtype not in _SUPPORTED:
        raise TypeError(
            f"allreduce of '{name}': dtype {tensor.dtype.name} is not supported; "
            "commsched reduces float16, bfloat16, float32, float64, int32, int64, uint8 and int8"
        )
    if code == _REDUCE_OPS["average"] and not tensor.dtype.is_floating:
        raise TypeError(
            f"allreduce of '{name}': op=\"average\" needs a floating dtype, not {tensor.dtype.name}"
        )
    return _build.load().commsched_allreduce(
        tensor, tensor_name=name, reduce_op=code, priority=priority, core_library=_core_library()
    )


def _broadcast_op(tensor: tf.Tensor, name: str, root: int, priority: int) -> tf.Tensor:
    if tensor.dtype in _SUPPORTED:
        return _build.load().commsched_broadcast(
            tensor, tensor_name=name, root_rank=root, priority=priority, core_library=_core_library()
        )
    if tensor.dtype == tf.bool:  # tf.bitcast has no bool; one byte per element either way
        return tf.cast(_broadcast_op(tf.cast(tensor, tf.uint8), name, root, priority), tf.bool)
    carrier = _BROADCAST_AS.get(tensor.dtype.size)
    if carrier is None or tensor.dtype in (tf.string, tf.resource, tf.variant):
        raise TypeError(f"broadcast of '{name}': dtype {tensor.dtype.name} cannot be sent")
    sent = _build.load().commsched_broadcast(
        tf.bitcast(tensor, carrier),
        tensor_name=name,
        root_rank=root,
        priority=priority,
        core_library=_core_library(),
    )
    return tf.bitcast(sent, tensor.dtype)


def allreduce(tensor: Any, name: str | None = None, op: str = "average", priority: int = 0) -> tf.Tensor:
    """Allreduces `tensor` (sum or average) over all ranks; works eagerly and in tf.function."""
    require_init("allreduce()")
    code = _reduce_code(op)
    if name is None:
        # Numbered in call (or trace) order, which must then match on every rank, as in commsched.allreduce.
        name = f"tf.allreduce.unnamed.{next(_unnamed)}"
    return _allreduce_op(tf.convert_to_tensor(densify(tensor)), name, code, priority)


def broadcast(tensor: Any, root_rank: int = 0, name: str | None = None, priority: int = 0) -> tf.Tensor:
    """Returns `root_rank`'s value of `tensor` on every rank."""
    require_init("broadcast()")
    if name is None:
        name = f"tf.broadcast.unnamed.{next(_unnamed)}"
    return _broadcast_op(tf.convert_to_tensor(tensor), name, root_rank, priority)


def _allreduce_group(
    tensors: Sequence[tf.Tensor], names: tuple[str, ...], priorities: tuple[int, ...], code: int
) -> list[tf.Tensor]:
    return [_allreduce_op(t, n, code, p) for t, n, p in zip(tensors, names, priorities)]


def _broadcast_group(
    tensors: Sequence[tf.Tensor], names: tuple[str, ...], priorities: tuple[int, ...], root: int
) -> list[tf.Tensor]:
    return [_broadcast_op(t, n, root, p) for t, n, p in zip(tensors, names, priorities)]


# Eagerly, one tf.function per group lets TensorFlow's executor start every op at once;
# names and priorities are Python values, so they key the trace cache.
_allreduce_group_eager = tf.function(_allreduce_group, autograph=False)
_broadcast_group_eager = tf.function(_broadcast_group, autograph=False)


def allreduce_many(
    tensors: Sequence[Any | None], names: Sequence[str], priorities: Sequence[int], op: str = "average"
) -> list[tf.Tensor | None]:
    """Allreduces several tensors concurrently; None entries stay None."""
    code = _reduce_code(op)
    present = [i for i, t in enumerate(tensors) if t is not None]
    values = [tf.convert_to_tensor(densify(tensors[i])) for i in present]
    group_names = tuple(names[i] for i in present)
    group_priorities = tuple(int(priorities[i]) for i in present)
    run = _allreduce_group_eager if tf.executing_eagerly() else _allreduce_group
    reduced = run(values, group_names, group_priorities, code) if values else []
    result: list[tf.Tensor | None] = [None] * len(tensors)
    for i, value in zip(present, reduced):
        result[i] = value
    return result


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, prefix: str = "broadcast") -> None:
    """Assigns every variable the value it has on `root_rank`."""
    require_init("broadcast_variables()")
    variables = list(variables)
    if not variables:
        return
    names = tuple(f"{prefix}.{i}.{variable_label(v)}" for i, v in enumerate(variables))
    values = [tf.convert_to_tensor(v) for v in variables]
    run = _broadcast_group_eager if tf.executing_eagerly() else _broadcast_group
    received = run(values, names, tuple(range(len(variables))), root_rank)
    for variable, value in zip(variables, received):
        variable.assign(value)


def priorities_for(variables: Sequence[Any], forward_order: Sequence[Any] | None) -> list[int]:
    """Each variable's position in `forward_order` (first used = 0), else its list position after those."""
    if forward_order is None:
        return list(range(len(variables)))
    position = {id(v): i for i, v in enumerate(forward_order)}
    return [position.get(id(v), len(position) + i) for i, v in enumerate(variables)]


def reduce_gradients(
    grads: Sequence[Any | None],
    variables: Sequence[Any],
    prefix: str,
    op: str = "average",
    forward_order: Sequence[Any] | None = None,
) -> list[tf.Tensor | None]:
    """Averages (or sums) each variable's gradient over ranks, first-used variables first."""
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    names = [f"{prefix}.{i}.{variable_label(v)}" for i, v in enumerate(variables)]
    return allreduce_many(grads, names, priorities_for(variables, forward_order), op)
