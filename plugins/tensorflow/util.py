"""Small helpers of Horovod's TensorFlow API: whether code runs eagerly, and rank and size as tensors."""

from __future__ import annotations

from commsched.tensorflow.functions import require_started

import commsched
import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while tracing a tf.function or building a graph)."""
    return bool(tf.executing_eagerly())


def _info_op(value: int, what: str) -> tf.Tensor:
    require_started(f"{what}()")
    return tf.constant(value, dtype=tf.int32, name=what)


def rank_op() -> tf.Tensor:
    """This process's rank as an int32 tensor."""
    return _info_op(commsched.rank(), "rank_op")


def _set_ranks(process_set_id: int, what: str) -> list[int]:
    require_started(f"{what}()")
    ranks = commsched.get_process_sets().get(int(process_set_id))
    if ranks is None:
        raise ValueError(
            f"{what}(): no process set has id {process_set_id}; register it with hvd.add_process_set() first"
        )
    return ranks


def size_op(process_set_id: int = 0) -> tf.Tensor:
    """The number of ranks (in process set `process_set_id`) as an int32 tensor."""
    return _info_op(len(_set_ranks(process_set_id, "size_op")), "size_op")


def process_set_included_op(process_set_id: int = 0) -> tf.Tensor:
    """1 as an int32 tensor when this rank is in process set `process_set_id`, else 0."""
    included = commsched.rank() in _set_ranks(process_set_id, "process_set_included_op")
    return _info_op(int(included), "process_set_included_op")


def local_rank_op() -> tf.Tensor:
    """This process's rank on its host as an int32 tensor."""
    from commsched import _horovod

    return _info_op(_horovod.local_rank(), "local_rank_op")


def local_size_op() -> tf.Tensor:
    """The number of ranks on this host as an int32 tensor."""
    from commsched import _horovod

    return _info_op(_horovod.local_size(), "local_size_op")
