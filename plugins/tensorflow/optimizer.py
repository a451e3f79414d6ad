"""DistributedOptimizer for Keras 3: gradients are reduced over ranks before the update.

The wrapped optimizer becomes an instance of a subclass of its own class, so Keras'
compile() and fit() accept it and every feature of the optimizer (clipping, weight decay,
EMA, gradient accumulation, loss scaling) then sees the averaged gradients, as in one
process trained on the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
from commsched.tensorflow import functions
from commsched.tensorflow.compression import Compression

import tensorflow as tf
from commsched._horovod import Average, global_process_set


@dataclass
class _Settings:
    """Plain holder, so Keras' attribute tracking does not adopt the forward-order variables."""

    prefix: str
    op: str
    forward_order: tuple[Any, ...] | None
    how: functions.Reduction | None = None
    local: set[Any] = dataclasses.field(
        default_factory=set
    )  # variable_key()s of register_local_var()'s variables
    scale_local: bool = True


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
            grads,
            variables,
            settings.prefix,
            settings.op,
            settings.forward_order,
            settings.how,
            local=settings.local,
            scale_local=settings.scale_local,
        )
        return super().apply(reduced, trainable_variables)  # type: ignore[misc]

    def register_local_var(self, var: Any) -> None:
        """Keeps `var`'s gradient on this rank (not reduced; scaled by 1/size as in Horovod)."""
        self._commsched.local.add(functions.variable_key(var))


_classes: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    # One subclass per optimizer class, named like it, so repr() and logs stay familiar.
    if base not in _classes:
        _classes[base] = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    return _classes[base]


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer returned by DistributedOptimizer."""
    return isinstance(optimizer, _DistributedMixin)


def check_groups(num_groups: Any, groups: Any) -> None:
    """Checks Horovod's num_groups / groups; grouping is the core's fusion here, so they are hints."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an integer >= 0, not {num_groups!r}")
    if groups is not None and num_groups:
        raise ValueError("pass either num_groups or groups, not both")
    if groups is not None and not isinstance(groups, (int, list, tuple)):
        raise TypeError(f"groups must be an integer or a list of lists of variables, not {groups!r}")


def _legacy(
    optimizer: Any,
    name: str | None,
    compression: Any,
    gradient_predivide_factor: float,
    op: Any,
    process_set: Any,
    backward_passes_per_step: int,
    num_groups: int,
    groups: Any,
    scale_local_gradients: bool,
) -> Any:
    from commsched.tensorflow._legacy_optimizer import LegacyDistributedOptimizer

    if backward_passes_per_step != 1:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is not available for a tf.compat.v1.train.Optimizer; "
            "accumulate with a Keras optimizer (DistributedOptimizer(keras optimizer, backward_passes_per_step=N))"
        )
    check_groups(num_groups, groups)
    how = functions.reduction(op, compression, gradient_predivide_factor, process_set)
    return LegacyDistributedOptimizer(optimizer, how, name, scale_local_gradients=scale_local_gradients)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
    *,
    forward_order: Sequence[Any] | None = None,
) -> Any:
    """Returns a copy of the Keras optimizer that averages gradients over ranks before applying them
    (a tf.compat.v1.train.Optimizer is wrapped as Horovod's legacy optimizer instead).

    Horovod's arguments: `compression` (Compression.fp16/bf16 cast gradients for the wire),
    `gradient_predivide_factor` (divide by it before the sum, by size/it after),
    `backward_passes_per_step` (Keras' own gradient accumulation; each pass is reduced, so the
    result equals Horovod's; `average_aggregated_gradients` averages instead of summing the
    passes), `op` (hvd.Average or hvd.Sum). Sparse gradients are always densified; device_*,
    num_groups/groups (the core's fusion groups) and scale_local_gradients are accepted and
    checked only. Gradient priorities follow `forward_order` (variables in the order the forward
    pass uses them, e.g. from commsched.tensorflow.forward_order); by default the order of the
    variables handed to apply(), which for Keras models is model.trainable_variables.
    """
    if is_distributed(optimizer):
        raise ValueError(
            "this optimizer is already a commsched DistributedOptimizer; wrap an optimizer only once"
        )
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _legacy(
            optimizer,
            name,
            compression,
            gradient_predivide_factor,
            op,
            process_set,
            backward_passes_per_step=backward_passes_per_step,
            num_groups=num_groups,
            groups=groups,
            scale_local_gradients=scale_local_gradients,
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
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be an integer >= 1, not {backward_passes_per_step!r}"
        )
    check_groups(num_groups, groups)
    how = functions.reduction(op, compression, gradient_predivide_factor, process_set)
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError(
                "pass backward_passes_per_step or the optimizer's gradient_accumulation_steps, not both"
            )
        config["gradient_accumulation_steps"] = backward_passes_per_step
        if not average_aggregated_gradients:  # Horovod sums the passes; Keras averages them
            how = dataclasses.replace(how, postscale=how.postscale * backward_passes_per_step)
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    wrapped._commsched = _Settings(
        prefix=name or f"DistributedOptimizer.{optimizer.name}",
        op=how.op,
        forward_order=tuple(forward_order) if forward_order is not None else None,
        how=how,
        scale_local=scale_local_gradients,
    )
    return wrapped


def PartialDistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A DistributedOptimizer that keeps the gradients of `local_layers` on each rank (Horovod's)."""
    wrapped = DistributedOptimizer(
        optimizer,
        name,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for variable in functions.local_variables_of(local_layers):
        wrapped.register_local_var(variable)
    return wrapped
