"""The custom TensorFlow ops, one call each, and their gradients as Horovod defines them.

Every op works eagerly and inside tf.function. Arguments are checked here, before the op runs,
so a mistake raises a Python error that names the fix; the op's own checks (sizes that only the
core knows) fail the op on every rank alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from commsched.tensorflow import _build

import commsched
import tensorflow as tf

OP_CODES = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4}
_NAMES_OF_CODES = {code: name for name, code in OP_CODES.items()}
# What the reductions take (bool only with min/max/product, which the core checks).
REDUCED = (
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int32,
    tf.int64,
    tf.uint8,
    tf.int8,
    tf.int16,
    tf.bool,
)
# What allgather, broadcast and alltoall move as they are.
MOVED = (*REDUCED, tf.uint16)
# Other dtypes travel as a same-width one: the bytes arrive unchanged.
_CARRIERS = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


@functools.lru_cache(maxsize=1)
def core_library() -> str:
    """The path of the loaded core extension, which the kernels look the C ABI up in."""
    from commsched import _core

    return str(_core.__file__)


def _library() -> Any:
    return _build.load()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_reduced(tensor: tf.Tensor, what: str, name: str) -> None:
    if tensor.dtype not in REDUCED:
        listed = ", ".join(dtype.name for dtype in REDUCED)
        raise TypeError(
            f"{what} of '{name}': dtype {tensor.dtype.name} is not supported; commsched reduces {listed}"
        )


def _scale(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, not {value!r}")
    try:
        factor = float(value)
    except OverflowError:  # an int beyond float's range
        factor = math.inf
    if not math.isfinite(factor):
        # The ops reach the core without commsched's Python checks; NaN would read as a mismatch.
        raise ValueError(f"{what} is {factor}; a scale factor must be a finite number: pass a finite {what}")
    return factor


def allreduce(
    tensor: tf.Tensor,
    name: str,
    op: str,
    priority: int = 0,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set_id: int = 0,
) -> tf.Tensor:
    """Every rank's `tensor` reduced with `op` (a commsched op name), scaled before and after."""
    _check_reduced(tensor, "allreduce", name)
    return _library().commsched_allreduce(
        tensor,
        tensor_name=name,
        reduce_op=OP_CODES[op],
        prescale_factor=_scale(prescale, "prescale_factor"),
        postscale_factor=_scale(postscale, "postscale_factor"),
        priority=priority,
        process_set_id=process_set_id,
        core_library=core_library(),
    )


def grouped_allreduce(
    tensors: Sequence[tf.Tensor],
    name: str,
    op: str,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set_id: int = 0,
) -> list[tf.Tensor]:
    """Allreduces of same-dtype tensors that every rank agrees on together (members `name.0`, ...)."""
    for tensor in tensors:
        _check_reduced(tensor, "grouped_allreduce", name)
    if len({tensor.dtype for tensor in tensors}) > 1:
        raise TypeError(f"grouped_allreduce of '{name}': one group takes one dtype")
    return list(
        _library().commsched_grouped_allreduce(
            list(tensors),
            tensor_name=name,
            reduce_op=OP_CODES[op],
            prescale_factor=_scale(prescale, "prescale_factor"),
            postscale_factor=_scale(postscale, "postscale_factor"),
            process_set_id=process_set_id,
            core_library=core_library(),
        )
    )


def _carried(tensor: tf.Tensor, what: str, name: str) -> tuple[tf.Tensor, tf.DType | None]:
    """`tensor` as a dtype the ops move, and the dtype to view the result as (None: unchanged)."""
    if tensor.dtype in MOVED:
        return tensor, None
    carrier = _CARRIERS.get(tensor.dtype.size)
    if carrier is None or tensor.dtype in (tf.string, tf.resource, tf.variant):
        raise TypeError(f"{what} of '{name}': dtype {tensor.dtype.name} cannot be sent")
    return tf.bitcast(tensor, carrier), tensor.dtype


def broadcast(
    tensor: tf.Tensor, name: str, root: int, priority: int = 0, process_set_id: int = 0
) -> tf.Tensor:
    """`root`'s `tensor` on every rank of the set (`root` is a global rank, as in Horovod)."""
    sent, view = _carried(tensor, "broadcast", name)
    received = _library().commsched_broadcast(
        sent,
        tensor_name=name,
        root_rank=root,
        priority=priority,
        process_set_id=process_set_id,
        core_library=core_library(),
    )
    return received if view is None else tf.bitcast(received, view)


def allgather(
    tensor: tf.Tensor, name: str, priority: int = 0, process_set_id: int = 0
) -> tuple[tf.Tensor, tf.Tensor]:
    """(every set member's `tensor` concatenated on the first dimension, the rows each member gave)."""
    sent, view = _carried(tensor, "allgather", name)
    gathered, rows = _library().commsched_allgather(
        sent, tensor_name=name, priority=priority, process_set_id=process_set_id, core_library=core_library()
    )
    return (gathered if view is None else tf.bitcast(gathered, view)), rows


def reducescatter(
    tensor: tf.Tensor,
    name: str,
    op: str,
    prescale: float = 1.0,
    postscale: float = 1.0,
    priority: int = 0,
    process_set_id: int = 0,
) -> tf.Tensor:
    """This rank's rows of the reduction: the first (rows % size) ranks get one row more."""
    _check_reduced(tensor, "reducescatter", name)
    if op not in ("sum", "average"):
        raise ValueError(f"reducescatter of '{name}' takes op=hvd.Sum or hvd.Average, not \"{op}\"")
    return _library().commsched_reducescatter(
        tensor,
        tensor_name=name,
        reduce_op=OP_CODES[op],
        prescale_factor=_scale(prescale, "prescale_factor"),
        postscale_factor=_scale(postscale, "postscale_factor"),
        priority=priority,
        process_set_id=process_set_id,
        core_library=core_library(),
    )


def alltoall(
    tensor: tf.Tensor, splits: Any, name: str, priority: int = 0, process_set_id: int = 0
) -> tuple[tf.Tensor, tf.Tensor]:
    """(rows every set member sent here, rows received from each); `splits` None sends equal parts."""
    sent, view = _carried(tensor, "alltoall", name)
    counts = tf.constant([], tf.int32) if splits is None else tf.reshape(tf.cast(splits, tf.int32), [-1])
    received, received_splits = _library().commsched_alltoall(
        sent,
        counts,
        tensor_name=name,
        priority=priority,
        process_set_id=process_set_id,
        core_library=core_library(),
    )
    return (received if view is None else tf.bitcast(received, view)), received_splits


def barrier(name: str) -> Any:
    """An op that finishes once every rank ran its barrier of this name."""
    return _library().commsched_barrier(tensor_name=name, core_library=core_library())


# -- gradients (what Horovod registers for its ops) ------------------------------------------------


# How the gradients of broadcast and allgather combine every rank's gradient: the average, as
# Horovod 0.28.1's TensorFlow ops (and its test suite) define it; Horovod up to 0.27 summed.
_GATHERED_GRADIENT_OP = "average"


def _dense(grad: Any) -> tf.Tensor:
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def _set_of(op: Any) -> int:
    return int(op.get_attr("process_set_id"))


def _position(set_id: int) -> tuple[int, int]:
    """(this rank's position in the set, the set's size)."""
    ranks = commsched.get_process_sets()[set_id]
    return ranks.index(commsched.rank()), len(ranks)


@tf.RegisterGradient("CommschedAllreduce")
def _allreduce_gradient(op: Any, grad: Any) -> tf.Tensor:
    """The same allreduce (op and scale factors) of the incoming gradient."""
    return allreduce(
        _dense(grad),
        f"{_text(op.get_attr('tensor_name'))}.grad",
        _NAMES_OF_CODES[op.get_attr("reduce_op")],
        op.get_attr("priority"),
        op.get_attr("prescale_factor"),
        op.get_attr("postscale_factor"),
        _set_of(op),
    )


@tf.RegisterGradient("CommschedGroupedAllreduce")
def _grouped_allreduce_gradient(op: Any, *grads: Any) -> list[tf.Tensor]:
    """The same grouped allreduce of the incoming gradients (zeros for outputs nothing used)."""
    dense = [
        tf.zeros_like(output) if grad is None else _dense(grad) for grad, output in zip(grads, op.outputs)
    ]
    return grouped_allreduce(
        dense,
        f"{_text(op.get_attr('tensor_name'))}.grad",
        _NAMES_OF_CODES[op.get_attr("reduce_op")],
        op.get_attr("prescale_factor"),
        op.get_attr("postscale_factor"),
        _set_of(op),
    )


@tf.RegisterGradient("CommschedBroadcast")
def _broadcast_gradient(op: Any, grad: Any) -> tf.Tensor:
    """The average of every rank's gradient on the root, zero elsewhere (as Horovod 0.28.1)."""
    name = f"{_text(op.get_attr('tensor_name'))}.grad"
    reduced = allreduce(_dense(grad), name, _GATHERED_GRADIENT_OP, process_set_id=_set_of(op))
    return reduced if commsched.rank() == op.get_attr("root_rank") else reduced * 0


@tf.RegisterGradient("CommschedAllgather")
def _allgather_gradient(op: Any, grad: Any, _rows_grad: Any) -> tf.Tensor:
    """This rank's rows of the average of every rank's gradient of the gathered tensor (Horovod 0.28.1)."""
    name = f"{_text(op.get_attr('tensor_name'))}.grad"
    reduced = allreduce(_dense(grad), name, _GATHERED_GRADIENT_OP, process_set_id=_set_of(op))
    position, size = _position(_set_of(op))
    parts = tf.split(reduced, num_or_size_splits=op.outputs[1], axis=0, num=size)
    part = parts[position]
    return tf.reshape(part, tf.shape(op.inputs[0]))


@tf.RegisterGradient("CommschedReducescatter")
def _reducescatter_gradient(op: Any, grad: Any) -> tf.Tensor:
    """Every rank's gradient of its part, gathered (times the size for a sum, and the scale factors)."""
    grad = _dense(grad)
    if _NAMES_OF_CODES[op.get_attr("reduce_op")] == "sum":
        grad = grad * tf.cast(_position(_set_of(op))[1], grad.dtype)
    for factor in (op.get_attr("prescale_factor"), op.get_attr("postscale_factor")):
        if factor != 1.0:
            grad = grad * tf.cast(factor, grad.dtype)
    gathered, _ = allgather(grad, f"{_text(op.get_attr('tensor_name'))}.grad", process_set_id=_set_of(op))
    return tf.reshape(gathered, tf.shape(op.inputs[0]))


@tf.RegisterGradient("CommschedAlltoall")
def _alltoall_gradient(op: Any, grad: Any, _splits_grad: Any) -> tuple[tf.Tensor, None]:
    """The gradient goes back where its rows came from: an alltoall by the received splits."""
    name = f"{_text(op.get_attr('tensor_name'))}.grad"
    returned, _ = alltoall(_dense(grad), op.outputs[1], name, process_set_id=_set_of(op))
    return returned, None


tf.no_gradient("CommschedBarrier")
