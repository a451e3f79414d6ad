"""Horovod's op=hvd.Adasum for commsched.tensorflow's allreduce, eagerly and in tf.function, and for
the gradients of DistributedOptimizer and DistributedGradientTape.

Each rank's tensor travels in one scheduled allgather and every rank combines the rows in
Horovod's pairwise order with commsched.adasum (the same code and bits as commsched.torch). The
gradient of an Adasum allreduce is the Adasum allreduce of the incoming gradient, as Horovod's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from commsched.tensorflow import _ops

import commsched
import tensorflow as tf
from commsched import _horovod
from commsched import adasum as _adasum

_FLOATS = (tf.float16, tf.float32, tf.float64)


def allreduce(
    value: tf.Tensor, name: str, prescale_factor: float, postscale_factor: float, process_set: Any
) -> tf.Tensor:
    """Adasum of dense `value` over every rank, scaled before and after as Horovod's allreduce."""
    if not _horovod.is_global(process_set):
        raise NotImplementedError(
            "op=Adasum does not support process sets other than the global one (as Horovod)"
        )
    _adasum.check_ranks(commsched.size())
    if commsched.config().get("transport") == "nccl":
        raise NotImplementedError(
            "op=Adasum is not available on commsched's NCCL transport; run with the MPI or Gloo transport "
            "(COMMSCHED_TRANSPORT) or use op=hvd.Average"
        )
    if value.dtype not in _FLOATS:
        raise TypeError(
            f"op=Adasum reduces float16, float32 or float64 tensors, not {value.dtype.name} ('{name}')"
        )
    return _combined(value, name, float(prescale_factor), float(postscale_factor))


def check_gradient_reduction(process_set: Any, gradient_predivide_factor: Any) -> None:
    """Refuses, when the optimizer or tape is wrapped, what an Adasum reduction of gradients cannot do."""
    if not _horovod.is_global(process_set):
        raise NotImplementedError(
            "op=Adasum does not support process sets other than the global one (as Horovod)"
        )
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor is supported only with op=hvd.Average (as in Horovod)")
    _adasum.check_ranks(commsched.size())


def reduce_gradients(
    grads: Sequence[Any | None], names: Sequence[str], how: Any, densify: Callable[[Any], Any]
) -> list[tf.Tensor | None]:
    """Each gradient's Adasum over the ranks, scaled as `how` says (None stays None); sparse ones made dense."""
    reduced: list[tf.Tensor | None] = []
    for grad, name in zip(grads, names):
        if grad is None:
            reduced.append(None)
            continue
        compressed, context = how.compressor.compress(tf.convert_to_tensor(densify(grad)))
        combined = allreduce(compressed, name, how.prescale, how.postscale, None)
        reduced.append(how.compressor.decompress(combined, context))
    return reduced


def _combined(value: tf.Tensor, name: str, prescale: float, postscale: float) -> tf.Tensor:
    @tf.custom_gradient
    def forward(tensor: tf.Tensor) -> Any:
        row = tf.reshape(tensor, [1, -1])
        if prescale != 1.0:
            row = row * tf.cast(prescale, row.dtype)
        gathered, _ = _ops.allgather(row, f"{name}.adasum")
        combined = tf.numpy_function(_combine_rows, [gathered], tensor.dtype, stateful=True)
        result = tf.reshape(combined, tf.shape(tensor))
        if postscale != 1.0:
            result = result * tf.cast(postscale, result.dtype)

        def backward(upstream: tf.Tensor) -> tf.Tensor:
            return _combined(tf.convert_to_tensor(upstream), f"{name}.grad", prescale, postscale)

        return result, backward

    return forward(value)


def _combine_rows(rows: np.ndarray) -> np.ndarray:
    return _adasum.combine(list(rows))
