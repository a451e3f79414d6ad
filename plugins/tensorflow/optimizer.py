"""DistributedOptimizer for Keras 3: gradients are reduced over ranks before the update.

The wrapped optimizer becomes an instance of a subclass of its own class, so Keras'
compile() and fit() accept it and every feature of the optimizer (clipping, weight decay,
EMA, gradient accumulation, loss scaling) then sees the averaged gradients, as in one
process trained on the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
from commsched.tensorflow import functions


@dataclass
class _Settings:
    """Plain holder, so Keras' attribute tracking does not adopt the forward-order variables."""

    prefix: str
    op: str
    forward_order: tuple[Any, ...] | None


class _DistributedMixin:
    """Put before a Keras optimizer class: apply() reduces the gradients first."""

    _commsched: _Settings

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        """Averages the gradients over ranks, then applies them with the wrapped optimizer."""
        functions.require_init("DistributedOptimizer.apply()")
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        else:
            variables = list(getattr(self, "_trainable_variables", []))
        settings = self._commsched
        reduced = functions.reduce_gradients(
            grads, variables, settings.prefix, settings.op, settings.forward_order
        )
        return super().apply(reduced, trainable_variables)  # type: ignore[misc]


_classes: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    # One subclass per optimizer class, named like it, so repr() and logs stay familiar.
    if base not in _classes:
        _classes[base] = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    return _classes[base]


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer returned by DistributedOptimizer."""
    return isinstance(optimizer, _DistributedMixin)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    op: str = "average",
    forward_order: Sequence[Any] | None = None,
) -> Any:
    """Returns a copy of the Keras optimizer that averages gradients over ranks before applying them.

    Gradient priorities follow `forward_order` (variables in the order the forward pass uses
    them, e.g. from commsched.tensorflow.forward_order); by default the order of the
    variables handed to apply(), which for Keras models is model.trainable_variables.
    """
    if is_distributed(optimizer):
        raise ValueError(
            "this optimizer is already a commsched DistributedOptimizer; wrap an optimizer only once"
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        raise TypeError(
            f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer, e.g. "
            f"tf.keras.optimizers.SGD), not {kind}; for a custom training loop without a Keras optimizer "
            "use commsched.tensorflow.DistributedGradientTape"
        )
    if optimizer.built:
        raise ValueError(
            "wrap the optimizer before its first step: it already holds slot variables that the "
            "wrapped copy would not carry over"
        )
    functions._reduce_code(op)
    wrapped = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    wrapped._commsched = _Settings(
        prefix=name or f"DistributedOptimizer.{optimizer.name}",
        op=op,
        forward_order=tuple(forward_order) if forward_order is not None else None,
    )
    return wrapped
