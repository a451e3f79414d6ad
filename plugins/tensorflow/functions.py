"""Collectives on TensorFlow tensors through the custom async ops, eager or in tf.function.

In tf.function every op starts as soon as its input is computed, so gradient reductions
overlap the rest of the backward pass. Eagerly each op would wait for its collective
before the next is even submitted, so groups run inside one tf.function of their own.
IndexedSlices (embedding gradients) are densified before the allreduce: a dense sum is what
the optimizer applies anyway, and it keeps one fused reduction per step.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from commsched.tensorflow import _ops
from commsched.tensorflow.compression import Compression, NoneCompressor, compressor

import commsched
import tensorflow as tf
from commsched import _horovod
from commsched._horovod import global_process_set

_REDUCE_OPS = {"sum": 0, "average": 1}  # what gradient reduction takes
_CODE_NAMES = {code: name for name, code in _ops.OP_CODES.items()}
_graph_counters: weakref.WeakKeyDictionary[Any, Iterator[int]] = weakref.WeakKeyDictionary()


def unnamed(kind: str) -> str:
    """The core name of a collective called without a name, the same on every rank that calls it.

    Eagerly one name per kind serves every call (an eager op finishes before the next starts, as
    Horovod's eager ops share their op's name), so a rank that skipped or failed a call does not
    shift later names. A graph (or tf.function trace) numbers its collectives in build order,
    afresh in each graph.
    """
    if tf.executing_eagerly():
        return f"tf.{kind}.unnamed"
    counter = _graph_counters.setdefault(tf.compat.v1.get_default_graph(), itertools.count())
    return f"tf.{kind}.unnamed.{next(counter)}"


def require_started(what: str) -> None:
    """Raises a clear error when commsched.init() has not run, or the core's own once it stopped."""
    if not commsched.is_initialized():
        # A core that stopped (a lost rank) raises its own error, RankFailure, which elastic.run
        # takes for the failure it is; only a process that never ran init() is told to call it.
        from commsched import _core

        _core.raise_if_stopped(f"commsched.tensorflow.{what}")
        raise RuntimeError(
            f"commsched.tensorflow.{what} needs commsched.init() first (commsched is not initialised "
            "in this process); call commsched.init() before building or training the model"
        )


def require_init(what: str) -> None:
    """require_started(), then starts a transport that init() left to the first tensor."""
    require_started(what)
    # The ops reach the core through its C ABI with host memory, not through commsched's Python
    # submit path, so a transport that init() left to the first tensor is chosen now, for the host.
    commsched._start_pending(cuda=False)


def _reduce_code(op: Any) -> int:
    if isinstance(op, str) and op.lower() in _REDUCE_OPS:
        return _REDUCE_OPS[op.lower()]
    raise ValueError(f'op must be hvd.Sum or hvd.Average ("sum" or "average"), not {op!r}')


@dataclass(frozen=True)
class Reduction:
    """How gradients are reduced: op on the wire, compressor, scale factors before and after."""

    op: str = "average"
    compressor: Any = NoneCompressor
    prescale: float = 1.0
    postscale: float = 1.0  # times 1/size when `divide` (a predivided average)
    divide: bool = False
    process_set: Any = global_process_set  # the ranks the gradients are reduced over


def set_id_of(process_set: Any) -> int:
    """The id the ops take for `process_set` (0: every rank); refuses a non-member and an unregistered set."""
    if _horovod.is_global(process_set):
        return 0
    from commsched import process_sets

    if process_sets.is_registered(process_set) and commsched.rank() not in (process_set.ranks or []):
        # Horovod's ops refuse a non-member with InvalidArgumentError (an unregistered set: ValueError).
        raise tf.errors.InvalidArgumentError(None, None, process_sets.not_a_member(process_set))
    return process_sets.resolve(process_set)


def reduction(op: Any, compression: Any, gradient_predivide_factor: Any, process_set: Any) -> Reduction:
    """Checks DistributedOptimizer/DistributedGradientTape arguments against Horovod's rules."""
    op = _horovod.resolve_op(op, adasum=True)
    if op == _horovod.Adasum:
        from commsched.tensorflow import adasum

        adasum.check_gradient_reduction(process_set, gradient_predivide_factor)
        return Reduction(op, compressor(compression), process_set=process_set)
    _reduce_code(op)
    if not _horovod.is_global(process_set):
        _horovod.core_arguments(process_set)  # a ProcessSet that add_process_set() registered
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)):
        raise TypeError(f"gradient_predivide_factor must be a number, not {gradient_predivide_factor!r}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be above 0, not {gradient_predivide_factor}")
    chosen = compressor(compression)
    if gradient_predivide_factor == 1.0:
        return Reduction(op, chosen, process_set=process_set)
    if op != "average":
        raise ValueError("gradient_predivide_factor is supported only with op=hvd.Average (as in Horovod)")
    factor = float(gradient_predivide_factor)
    return Reduction("sum", chosen, 1.0 / factor, factor, divide=True, process_set=process_set)


def densify(value: Any) -> Any:
    """An IndexedSlices gradient as the dense tensor it stands for; other values unchanged."""
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def variable_label(variable: Any) -> str:
    """A variable's name for tensor names: Keras 3 `path`, else the tf.Variable name."""
    label = getattr(variable, "path", None) or getattr(variable, "name", "") or "var"
    return str(label).removesuffix(":0")


def _allreduce_op(tensor: tf.Tensor, name: str, code: int, priority: int, set_id: int = 0) -> tf.Tensor:
    return _ops.allreduce(tensor, name, _CODE_NAMES[code], priority, process_set_id=set_id)


def _broadcast_op(tensor: tf.Tensor, name: str, root: int, priority: int, set_id: int = 0) -> tf.Tensor:
    return _ops.broadcast(tensor, name, root, priority, process_set_id=set_id)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
    priority: int = 0,
) -> tf.Tensor:
    """Averages (or op-reduces) `tensor` over all ranks; works eagerly and in tf.function.

    Every op (sum, average, min, max, product) and dtype runs as an async custom op, with the
    scale factors applied by the core (in double precision for integers), on the global set or
    a process set alike. device_* are accepted for Horovod's signature; TensorFlow places the ops.
    """
    require_init("allreduce()")
    if isinstance(tensor, tf.IndexedSlices):
        name = f"tf.allreduce.{name}" if name is not None else unnamed("allreduce")
        return sparse_allreduce(tensor, op, average, prescale_factor, postscale_factor, name, process_set)
    op = _horovod.resolve_op(op, average, adasum=True)
    value = tf.convert_to_tensor(densify(tensor))
    if name is None:
        # Numbered in call (or trace) order, which must then match on every rank, as in commsched.allreduce.
        name = unnamed("allreduce")
    chosen = compressor(compression)
    compressed, context = chosen.compress(value)
    if op == _horovod.Adasum:
        from commsched.tensorflow import adasum

        reduced = adasum.allreduce(compressed, name, prescale_factor, postscale_factor, process_set)
        return chosen.decompress(reduced, context)
    set_id = set_id_of(process_set)
    op, postscale_factor = _horovod.integer_average(
        op, compressed.dtype.is_integer, postscale_factor, process_set
    )
    reduced = _ops.allreduce(compressed, name, op, priority, prescale_factor, postscale_factor, set_id)
    return chosen.decompress(reduced, context)


def broadcast(
    tensor: Any,
    root_rank: int = 0,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
    priority: int = 0,
) -> tf.Tensor:
    """Returns `root_rank`'s value of `tensor` on every rank; works eagerly and in tf.function."""
    require_init("broadcast()")
    if name is None:
        name = unnamed("broadcast")
    return _broadcast_op(tf.convert_to_tensor(tensor), name, root_rank, priority, set_id_of(process_set))


def sparse_allreduce(
    slices: tf.IndexedSlices,
    op: Any,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    name: str,
    process_set: Any,
) -> tf.IndexedSlices:
    """Horovod's allreduce of tf.IndexedSlices: every rank's values and indices gathered (two allgathers),
    the values divided by the set's size for an average; only Sum and Average, without scale factors."""
    op = _horovod.resolve_op(op, average, adasum=True)
    if op == _horovod.Adasum:
        raise NotImplementedError(
            "Adasum does not take tf.IndexedSlices (as in Horovod); pass sparse_as_dense=True or a dense tensor"
        )
    if op not in (_horovod.Sum, _horovod.Average):
        raise NotImplementedError(f"op={op} on tf.IndexedSlices: only hvd.Sum and hvd.Average are supported")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor/postscale_factor are not supported with tf.IndexedSlices")
    set_id = set_id_of(process_set)
    values = _ops.allgather(tf.convert_to_tensor(slices.values), f"{name}.values", process_set_id=set_id)[0]
    indices = _ops.allgather(tf.convert_to_tensor(slices.indices), f"{name}.indices", process_set_id=set_id)[
        0
    ]
    if op == _horovod.Average:
        values = values / tf.cast(_horovod.set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _allreduce_group(
    tensors: Sequence[tf.Tensor],
    names: tuple[str, ...],
    priorities: tuple[int, ...],
    code: int,
    set_id: int = 0,
) -> list[tf.Tensor]:
    return [_allreduce_op(t, n, code, p, set_id) for t, n, p in zip(tensors, names, priorities)]


def _broadcast_group(
    tensors: Sequence[tf.Tensor],
    names: tuple[str, ...],
    priorities: tuple[int, ...],
    root: int,
    set_id: int = 0,
) -> list[tf.Tensor]:
    return [_broadcast_op(t, n, root, p, set_id) for t, n, p in zip(tensors, names, priorities)]


# Eagerly, one tf.function per group lets TensorFlow's executor start every op at once;
# names and priorities are Python values, so they key the trace cache.
_allreduce_group_eager = tf.function(_allreduce_group, autograph=False)
_broadcast_group_eager = tf.function(_broadcast_group, autograph=False)


def allreduce_many(
    tensors: Sequence[Any | None],
    names: Sequence[str],
    priorities: Sequence[int],
    op: str = "average",
    how: Reduction | None = None,
) -> list[tf.Tensor | None]:
    """Allreduces several tensors concurrently; None entries stay None. `how` overrides `op`.

    On a process set, as in Horovod, a rank outside the set (or a set of one rank) keeps its own
    gradients unchanged, and an average divides by the set's size.
    """
    how = how or Reduction(_horovod.resolve_op(op))
    if how.op == _horovod.Adasum:
        from commsched.tensorflow import adasum

        return adasum.reduce_gradients(tensors, names, how, densify)
    code = _reduce_code(how.op)
    process_set = how.process_set
    if not _horovod.is_global(process_set) and (not process_set.included() or process_set.size() == 1):
        return [None if t is None else tf.convert_to_tensor(densify(t)) for t in tensors]
    set_id = set_id_of(process_set)
    size = _horovod.set_size(process_set)
    present = [i for i, t in enumerate(tensors) if t is not None]
    values, contexts = [], []
    compresses = how.compressor is not NoneCompressor
    for i in present:
        value = tf.convert_to_tensor(densify(tensors[i]))
        if how.prescale != 1.0:
            value = value * tf.cast(how.prescale, value.dtype)
        if compresses and how.op == "average" and value.dtype.is_floating:
            value = value / tf.cast(size, value.dtype)  # in full precision: no fp16 overflow
        value, context = how.compressor.compress(value)
        values.append(value)
        contexts.append(context)
    if compresses and how.op == "average":
        code = _REDUCE_OPS["sum"]
    group_names = tuple(names[i] for i in present)
    group_priorities = tuple(int(priorities[i]) for i in present)
    run = _allreduce_group_eager if tf.executing_eagerly() else _allreduce_group
    reduced = run(values, group_names, group_priorities, code, set_id) if values else []
    postscale = how.postscale / size if how.divide else how.postscale
    result: list[tf.Tensor | None] = [None] * len(tensors)
    for i, value, context in zip(present, reduced, contexts):
        value = how.compressor.decompress(value, context)
        result[i] = value * tf.cast(postscale, value.dtype) if postscale != 1.0 else value
    return result


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[tf.Tensor]:
    """Reduces each tensor over all ranks (any op), agreed on and launched together; eager and in tf.function.

    Tensors of one dtype form one group op (mixed dtypes: one group per dtype, in order of first
    appearance), as Horovod's grouped op takes one dtype.
    """
    require_init("grouped_allreduce()")
    base = name or unnamed("grouped_allreduce")
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        # As Horovod: each IndexedSlices goes its own sparse way, the dense rest as one group.
        scales = (prescale_factor, postscale_factor)
        result = list(tensors)
        for i in sparse:
            result[i] = sparse_allreduce(tensors[i], op, average, *scales, f"{base}.{i}", process_set)
        dense = [i for i in range(len(tensors)) if i not in sparse]
        if dense:
            reduced = grouped_allreduce(
                [tensors[i] for i in dense],
                average,
                compression=compression,
                op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
                name=f"{base}.dense",
            )
            for i, value in zip(dense, reduced):
                result[i] = value
        return result
    op = _horovod.resolve_op(op, average)
    set_id = set_id_of(process_set)
    chosen = compressor(compression)
    compressed = [chosen.compress(tf.convert_to_tensor(densify(tensor))) for tensor in tensors]
    by_dtype: dict[tf.DType, list[int]] = {}
    for index, (value, _) in enumerate(compressed):
        by_dtype.setdefault(value.dtype, []).append(index)
    result: list[tf.Tensor] = [None] * len(compressed)  # type: ignore[list-item]
    for dtype, members in by_dtype.items():
        group = base if len(by_dtype) == 1 else f"{base}.{dtype.name}"
        group_op, postscale = _horovod.integer_average(op, dtype.is_integer, postscale_factor, process_set)
        reduced = _ops.grouped_allreduce(
            [compressed[i][0] for i in members], group, group_op, prescale_factor, postscale, set_id
        )
        for index, value in zip(members, reduced):
            result[index] = chosen.decompress(value, compressed[index][1])
    return result


def broadcast_variables(
    variables: Sequence[Any],
    root_rank: int = 0,
    process_set: Any = global_process_set,
    inplace: bool = False,
    prefix: str = "broadcast",
) -> Any:
    """Assigns every variable the value it has on `root_rank`; in graph mode returns the op that does it."""
    variables = list(variables)
    if not variables:
        return tf.group()
    if tf.executing_eagerly():  # a graph's op needs commsched only when a session runs it, as in Horovod
        require_init("broadcast_variables()")
    names = tuple(f"{prefix}.{i}.{variable_label(v)}" for i, v in enumerate(variables))
    values = [tf.convert_to_tensor(v) for v in variables]
    run = _broadcast_group_eager if tf.executing_eagerly() else _broadcast_group
    received = run(values, names, tuple(range(len(variables))), root_rank, set_id_of(process_set))
    # In graph mode the assignments are the op a session runs (None eagerly, as tf.group there).
    return tf.group(*[variable.assign(value) for variable, value in zip(variables, received)])


def broadcast_global_variables(root_rank: int = 0, process_set: Any = global_process_set) -> None:
    """Graph mode (TF1 style): every global variable takes root_rank's value; eagerly, a RuntimeError as in Horovod."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() has no global variables to broadcast in eager mode; use "
            "hvd.broadcast_variables(model.variables, root_rank) or BroadcastGlobalVariablesCallback"
        )
    broadcast_variables(tf.compat.v1.global_variables(), root_rank, process_set, prefix="broadcast_global")


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
    how: Reduction | None = None,
    local: set[Any] | frozenset[Any] = frozenset(),
    scale_local: bool = True,
) -> list[tf.Tensor | None]:
    """Averages (or sums) each variable's gradient over ranks, first-used variables first.

    A variable whose variable_key() is in `local` keeps its own gradient, divided by the process set's size
    when `scale_local` (Horovod's register_local_var / local_layers, scale_local_gradients).
    """
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    names = [f"{prefix}.{i}.{variable_label(v)}" for i, v in enumerate(variables)]
    priorities = priorities_for(variables, forward_order)
    if not local:
        return allreduce_many(grads, names, priorities, op, how)
    shared = [i for i, v in enumerate(variables) if variable_key(v) not in local]
    reduced = allreduce_many(
        [grads[i] for i in shared], [names[i] for i in shared], [priorities[i] for i in shared], op, how
    )
    result = list(grads)
    for i, grad in zip(shared, reduced):
        result[i] = grad
    if scale_local:
        size = float(_horovod.set_size(how.process_set if how is not None else global_process_set))
        for i, (grad, variable) in enumerate(zip(grads, variables)):
            if grad is not None and variable_key(variable) in local:
                result[i] = (
                    tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
                    if isinstance(grad, tf.IndexedSlices)
                    else grad / size
                )
    return result


def variable_key(variable: Any) -> Any:
    """A hashable identity of a variable: tf.Variable.ref(), or the object's id for a Keras 3 variable."""
    ref = getattr(variable, "ref", None)
    return ref() if callable(ref) else id(variable)


def local_variables_of(local_layers: Any) -> list[Any]:
    """The trainable variables of Horovod's `local_layers` (one Keras layer, a list of them, or None)."""
    import keras

    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError("local_layers must be Keras layers (keras.layers.Layer); pass layers of the model")
    return [variable for layer in layers for variable in layer.trainable_weights]
