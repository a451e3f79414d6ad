"""Small helpers of Horovod's TensorFlow API: whether code runs eagerly, and rank and size as tensors."""

from __future__ import annotations

import commsched
import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while tracing a tf.function or building a graph)."""
    return bool(tf.executing_eagerly())


def _info_op(value: int, what: str) -> tf.Tensor:
    if not commsched.is_initialized():
        raise RuntimeError(f"commsched.tensorflow.{what}() needs commsched.init() first; call hvd.init()")
    return tf.constant(value, dtype=tf.int32, name=what)


def rank_op() -> tf.Tensor:
    """This process's rank as an int32 tensor."""
    return _info_op(commsched.rank(), "rank_op")


def size_op(process_set_id: int = 0) -> tf.Tensor:
    """The number of ranks as an int32 tensor (process sets other than 0 are not served here)."""
    if process_set_id != 0:
        raise NotImplementedError("size_op() on a process set is not available; use process_set.size()")
    return _info_op(commsched.size(), "size_op")


def local_rank_op() -> tf.Tensor:
    """This process's rank on its host as an int32 tensor."""
    from commsched import _horovod

    return _info_op(_horovod.local_rank(), "local_rank_op")


def local_size_op() -> tf.Tensor:
    """The number of ranks on this host as an int32 tensor."""
    from commsched import _horovod

    return _info_op(_horovod.local_size(), "local_size_op")
