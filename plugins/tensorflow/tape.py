"""DistributedGradientTape: a tf.GradientTape whose gradient() returns rank-averaged gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from commsched.tensorflow import functions
from commsched.tensorflow.compression import Compression
from commsched.tensorflow.optimizer import check_groups

import tensorflow as tf
from commsched._horovod import Average, global_process_set


class DistributedGradientTape:
    """Wraps a tf.GradientTape; gradient() reduces every gradient over ranks before returning it.

    Inside tf.function each reduction starts as soon as TensorFlow computes its gradient, so
    communication overlaps the rest of the backward pass. Everything else is the wrapped tape's.
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = global_process_set,
        scale_local_gradients: bool = True,
        *,
        name: str = "DistributedGradientTape",
        forward_order: Sequence[Any] | None = None,
    ) -> None:
        """Horovod's arguments as for DistributedOptimizer; `forward_order` sets gradient priorities."""
        tape = gradtape
        if isinstance(tape, DistributedGradientTape):
            # ValueError like DistributedOptimizer's: the type is right, the second wrap is the mistake.
            raise ValueError(  # noqa: TRY004
                "this tape is already a commsched DistributedGradientTape; wrap a tape only once"
            )
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(
                f"DistributedGradientTape wraps a tf.GradientTape, not {type(tape).__module__}.{type(tape).__name__}"
            )
        check_groups(num_groups, groups)
        self._how = functions.reduction(op, compression, gradient_predivide_factor, process_set)
        self._tape = tape
        self._name = name
        self._op = self._how.op
        self._forward_order = list(forward_order) if forward_order is not None else None
        self._local: set[Any] = set()
        self._scale_local = scale_local_gradients

    def register_local_source(self, source: Any) -> None:
        """Keeps `source`'s gradient on this rank (not reduced; scaled by 1/size as in Horovod)."""
        self._local.add(functions.variable_key(source))

    def __enter__(self) -> DistributedGradientTape:  # noqa: PYI034 (typing.Self needs 3.11)  # noqa: PYI034 - Self needs Python 3.11
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._tape, attribute)

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The wrapped tape's gradients, each averaged (or summed) over the ranks of its process set."""
        functions.require_init("DistributedGradientTape.gradient()")
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = functions.reduce_gradients(
            flat_grads,
            flat_sources,
            self._name,
            self._op,
            self._forward_order,
            self._how,
            local=self._local,
            scale_local=self._scale_local,
        )
        return tf.nest.pack_sequence_as(grads, reduced)


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A DistributedGradientTape that keeps the gradients of `local_layers` on each rank (Horovod's)."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for variable in functions.local_variables_of(local_layers):
        tape.register_local_source(variable)
    return tape
