"""``hvd.SyncBatchNormalization``: Keras batch normalization whose batch statistics, in training,
are those of the batches of every rank together (Horovod's horovod/tensorflow/sync_batch_norm.py).

Each rank sums its count, sum and sum of squares per channel and one allreduce adds them up, so
the mean and variance are those of the concatenated batch even when the ranks' batches differ in
size (Horovod averages the ranks' means, which is exact only for equal batches). The allreduce is
differentiable, so the gradient flows through the statistics of every rank, as in one process.
"""

from __future__ import annotations

from typing import Any

import keras
from commsched.tensorflow import functions

import commsched
import tensorflow as tf
from commsched._horovod import Sum


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with the mean and variance taken over every rank's batch in training."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        # `fused` is Horovod's argument (TF1's fused kernel computes the moments where they cannot
        # be reduced); Keras 3 has no fused kernel, so only False is accepted and it is not passed on.
        if fused in (True, None):
            raise ValueError(
                f"SyncBatchNormalization does not support fused={fused!r}: its statistics are reduced over "
                "the ranks, which the fused kernel cannot do; leave fused out or pass fused=False"
            )
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        """The mean and variance of every rank's batch together (overrides Keras' per-batch moments)."""
        mean, variance = super()._moments(inputs, mask)
        if not commsched.is_initialized() or commsched.size() == 1:
            return mean, variance
        count = self._count(inputs, mask, mean.dtype)
        # Var[X] = E[X^2] - E[X]^2, with E over all ranks' elements, weighted by each rank's count.
        stacked = tf.stack(
            [count * tf.ones_like(mean), count * mean, count * (variance + tf.math.square(mean))]
        )
        total = functions.allreduce(stacked, op=Sum, name=self._collective_name())
        total_count, total_sum, total_square = tf.unstack(total)
        group_mean = total_sum / total_count
        group_variance = tf.maximum(total_square / total_count - tf.math.square(group_mean), 0.0)
        return group_mean, group_variance

    def _count(self, inputs: Any, mask: Any, dtype: Any) -> Any:
        """How many elements of this rank's batch each channel's moments were taken over."""
        if mask is None:
            shape = tf.shape(inputs)
            return tf.cast(tf.reduce_prod(tf.gather(shape, self._reduction_axes)), dtype)
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), dtype), tf.shape(inputs))
        return tf.squeeze(tf.reduce_sum(weights, axis=self._reduction_axes, keepdims=True))

    def _collective_name(self) -> str | None:
        # Eagerly a name per layer keeps two layers' statistics apart; in a graph the build order
        # names them (every rank traces the same model in the same order).
        return f"sync_batch_norm.{self.name}" if tf.executing_eagerly() else None


__all__ = ["SyncBatchNormalization"]
