"""Horovod's collectives beyond allreduce and broadcast, on TensorFlow tensors, eager or in tf.function.

allgather, reducescatter, alltoall and barrier run as the async custom ops (see _ops), with the
gradients Horovod registers. On a process set outside tf.function, and for the object forms, they
take a numpy round trip through commsched's framework-free API (which schedules them in the core
like every other collective); bfloat16 then travels as float32 for reductions and as its raw 16
bits otherwise, and results come back in the input's dtype. Inside tf.function a set's collective
runs as the custom op on that set.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from commsched.tensorflow import _ops
from commsched.tensorflow.compression import Compression, compressor
from commsched.tensorflow.functions import on_set_eagerly, require_init, set_id_of

import commsched
import tensorflow as tf
from commsched import _horovod
from commsched._horovod import Average, global_process_set

_unnamed = itertools.count()


def _eager(what: str) -> None:
    require_init(what)
    if not tf.executing_eagerly():
        raise NotImplementedError(
            f"commsched.tensorflow.{what} runs in eager mode only (a numpy round trip through commsched); call "
            "it outside tf.function, e.g. from a Keras callback or between training steps"
        )


def _name(kind: str, name: str | None) -> str:
    return f"tf.{kind}.{name}" if name is not None else f"tf.{kind}.unnamed.{next(_unnamed)}"


def _to_numpy(tensor: Any, reduces: bool) -> tuple[np.ndarray, tf.DType]:
    """A writable numpy copy of `tensor` the core takes, and the dtype to give the result."""
    value = tf.convert_to_tensor(tensor)
    if value.dtype == tf.bfloat16:
        value = tf.cast(value, tf.float32) if reduces else tf.bitcast(value, tf.int16)
        return np.array(value.numpy()), tf.bfloat16
    return np.array(value.numpy()), value.dtype


def _to_tensor(array: Any, dtype: tf.DType) -> tf.Tensor:
    array = np.asarray(array)
    if dtype == tf.bfloat16:
        return (
            tf.cast(array, tf.bfloat16)
            if array.dtype == np.float32
            else tf.bitcast(tf.constant(array), tf.bfloat16)
        )
    return tf.constant(array, dtype=dtype)


def eager_allreduce(
    tensor: tf.Tensor, name: str, op: str, prescale_factor: float, postscale_factor: float, process_set: Any
) -> tf.Tensor:
    """Allreduce with any op and scale factors through commsched's allreduce (eager only)."""
    _eager("allreduce() on a process set")
    array, dtype = _to_numpy(tensor, reduces=True)
    commsched.allreduce(
        array,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        **_horovod.core_arguments(process_set),
    )
    return _to_tensor(array, dtype)


def eager_broadcast(tensor: tf.Tensor, name: str, root_rank: int, process_set: Any) -> tf.Tensor:
    """Broadcast on a process set through commsched's broadcast (eager only; the ops have no sets)."""
    _eager("broadcast() on a process set")
    array, dtype = _to_numpy(tensor, reduces=False)
    commsched.broadcast(array, root=root_rank, name=name, **_horovod.core_arguments(process_set))
    return _to_tensor(array, dtype)


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> tf.Tensor:
    """Every rank's `tensor` concatenated on the first dimension, which may differ between ranks."""
    require_init("allgather()")
    if not on_set_eagerly(process_set):
        return _ops.allgather(
            tf.convert_to_tensor(tensor), _name("allgather", name), process_set_id=set_id_of(process_set)
        )[0]
    array, dtype = _to_numpy(tensor, reduces=False)
    gathered = commsched.allgather(
        array, name=_name("allgather", name), **_horovod.core_arguments(process_set)
    )
    return _to_tensor(gathered, dtype)


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
    op = _horovod.resolve_op(op)
    chosen = compressor(compression)
    compressed, context = chosen.compress(tf.convert_to_tensor(tensor))
    if not on_set_eagerly(process_set):
        part = _ops.reducescatter(
            compressed,
            _name("reducescatter", name),
            op,
            prescale_factor,
            postscale_factor,
            process_set_id=set_id_of(process_set),
        )
        return chosen.decompress(part, context)
    array, dtype = _to_numpy(compressed, reduces=True)
    part = commsched.reducescatter(
        array,
        op=op,
        name=_name("reducescatter", name),
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        **_horovod.core_arguments(process_set),
    )
    return chosen.decompress(_to_tensor(part, dtype), context)


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
    if not on_set_eagerly(process_set):
        set_id = set_id_of(process_set)
        output, received = _ops.alltoall(
            tf.convert_to_tensor(tensor), splits, _name("alltoall", name), process_set_id=set_id
        )
        return (output, received) if splits is not None else output
    array, dtype = _to_numpy(tensor, reduces=False)
    counts = None if splits is None else [int(v) for v in np.asarray(splits).reshape(-1)]
    output, received = commsched.alltoall(
        array, splits=counts, name=_name("alltoall", name), **_horovod.core_arguments(process_set)
    )
    result = _to_tensor(output, dtype)
    return (result, tf.constant(list(received), dtype=tf.int32)) if splits is not None else result


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
    """Overwrites `variables` (one or a list) with root_rank's values and returns them."""
    from commsched.tensorflow.functions import broadcast_variables

    many = variables if isinstance(variables, (list, tuple)) else [variables]
    broadcast_variables(many, root_rank, process_set, prefix=_name("broadcast_", name))
    return variables
