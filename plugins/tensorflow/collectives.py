"""Horovod's collectives beyond allreduce and broadcast, on TensorFlow tensors, eager or in tf.function.

allgather, reducescatter, alltoall and barrier run as the async custom ops (see _ops), with the
gradients Horovod registers, on the global set or a process set alike. The object forms, and a
barrier on a process set, go through commsched's framework-free API (eager only).
"""

from __future__ import annotations

from typing import Any

from commsched.tensorflow import _ops
from commsched.tensorflow.compression import Compression, compressor
from commsched.tensorflow.functions import require_init, set_id_of, unnamed

import commsched
import tensorflow as tf
from commsched import _horovod
from commsched._horovod import Average, global_process_set

_basics = _horovod  # Horovod's mpi_ops holds its basics under this name (tests read it)


def _eager(what: str) -> None:
    require_init(what)
    if not tf.executing_eagerly():
        raise NotImplementedError(
            f"commsched.tensorflow.{what} runs in eager mode only (a numpy round trip through commsched); call "
            "it outside tf.function, e.g. from a Keras callback or between training steps"
        )


def _name(kind: str, name: str | None) -> str:
    return f"tf.{kind}.{name}" if name is not None else unnamed(kind)


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> tf.Tensor:
    """Every rank's `tensor` concatenated on the first dimension, which may differ between ranks."""
    require_init("allgather()")
    return _ops.allgather(
        tf.convert_to_tensor(tensor), _name("allgather", name), process_set_id=set_id_of(process_set)
    )[0]


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: str | None = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """This rank's part of the average (or sum) of every rank's `tensor`, cut on the first dimension;
    the first (rows % size) ranks get one row more, as in Horovod."""
    require_init("reducescatter()")
    if tf.convert_to_tensor(tensor).shape.rank == 0:
        raise ValueError(
            "reducescatter() cuts the first dimension: pass a tensor of rank 1 or more, not a scalar"
        )
    op = _horovod.resolve_op(op)
    chosen = compressor(compression)
    compressed, context = chosen.compress(tf.convert_to_tensor(tensor))
    op, postscale_factor = _horovod.integer_average(
        op, compressed.dtype.is_integer, postscale_factor, process_set
    )
    part = _ops.reducescatter(
        compressed,
        _name("reducescatter", name),
        op,
        prescale_factor,
        postscale_factor,
        process_set_id=set_id_of(process_set),
    )
    return chosen.decompress(part, context)


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Sends rows splits[r] of `tensor` to rank r (equal parts without splits); returns what every rank
    sent here, and with `splits` given, also the rows received from each rank (as Horovod)."""
    require_init("alltoall()")
    set_id = set_id_of(process_set)
    output, received = _ops.alltoall(
        tf.convert_to_tensor(tensor), splits, _name("alltoall", name), process_set_id=set_id
    )
    return (output, received) if splits is not None else output


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """root_rank's (picklable) object on every rank (`session` is accepted for Horovod's signature)."""
    require_init("broadcast_object()")
    return commsched.broadcast_object(
        obj, root_rank, name=_name("broadcast_object", name), **_horovod.core_arguments(process_set)
    )


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """A function that returns root_rank's (picklable) object on every rank (Horovod's broadcast_object_fn)."""

    def broadcast_fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return broadcast_fn


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> list[Any]:
    """Every rank's (picklable) object, in rank order."""
    require_init("allgather_object()")
    return list(
        commsched.allgather_object(
            obj, name=_name("allgather_object", name), **_horovod.core_arguments(process_set)
        )
    )


def barrier(process_set: Any = global_process_set, name: str | None = None) -> Any:
    """Returns once every rank has called barrier(); in tf.function, an op that runs in program order."""
    require_init("barrier()")
    if _horovod.is_global(process_set):
        return _ops.barrier(_name("barrier", name))
    _eager("barrier() on a process set")
    commsched.barrier(**_horovod.core_arguments(process_set))
    return None


def join() -> int:
    """Marks this rank done with its data; returns, once every rank joined, the rank that joined last."""
    require_init("join()")
    return int(_horovod._core("join")())


def broadcast_(
    variables: Any, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Overwrites `variables` (one or a list) with root_rank's values and returns them (in a graph: tensors
    that broadcast, then read them)."""
    from commsched.tensorflow.functions import broadcast_variables

    many = variables if isinstance(variables, (list, tuple)) else [variables]
    assigned = broadcast_variables(many, root_rank, process_set, prefix=_name("broadcast_", name))
    if tf.executing_eagerly():
        return variables
    # In a graph the assignment runs only when something depends on it: as Horovod, return tensors
    # whose evaluation broadcasts, then reads the variables.
    with tf.control_dependencies([assigned]):
        values = [tf.identity(v) for v in many]
    return values if isinstance(variables, (list, tuple)) else values[0]


def grouped_allgather(
    tensors: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> list[tf.Tensor]:
    """allgather of each tensor (one collective each, named `<name>.<i>`), with allgather's gradients."""
    require_init("grouped_allgather()")
    base = name or unnamed("grouped_allgather")
    return [allgather(t, f"{base}.{i}", process_set=process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter(
    tensors: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list[tf.Tensor]:
    """reducescatter of each tensor (one collective each, named `<name>.<i>`), with its gradients."""
    require_init("grouped_reducescatter()")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if any(t.shape.rank == 0 for t in tensors):  # refused before any member is submitted
        raise ValueError(
            "grouped_reducescatter() cuts the first dimension: every tensor needs rank 1 or more"
        )
    base = name or unnamed("grouped_reducescatter")
    scales = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
    return [
        reducescatter(
            t, compression=compression, op=op, name=f"{base}.{i}", process_set=process_set, **scales
        )
        for i, t in enumerate(tensors)
    ]
