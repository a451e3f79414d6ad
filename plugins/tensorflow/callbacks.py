"""Keras callbacks with Horovod's names: broadcast of the start state, metric averaging, LR schedules.

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size(), warmup_epochs=3),
    ]

Callbacks run eagerly between steps, so their collectives go through commsched like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import keras
except ImportError as error:
    raise ImportError(
        f"commsched.tensorflow's Keras callbacks need Keras 3, which TensorFlow 2.16+ installs ({error}): "
        "pip install tensorflow-cpu (or tensorflow for GPUs)"
    ) from error
from commsched.tensorflow import functions

import commsched


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of fit(), sets every rank's model (and built optimizer) variables to root_rank's."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None) -> None:
        """`local_variables`: variables that keep each rank's own value (Horovod's argument)."""
        super().__init__()
        self.root_rank = root_rank
        self.device = device  # accepted for Horovod's signature; TensorFlow places the ops
        self.local_variables = {functions.variable_key(v) for v in local_variables or []}
        self.done = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Broadcasts the model's variables (but the local ones) once, before the first batch."""
        if self.done:
            return
        shared = [v for v in self.model.variables if functions.variable_key(v) not in self.local_variables]
        functions.broadcast_variables(shared, self.root_rank, prefix="broadcast.model")
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            functions.broadcast_variables(optimizer.variables, self.root_rank, prefix="broadcast.optimizer")
        self.done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replaces each metric in `logs` by its average over ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping, LR on plateau).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device  # accepted for Horovod's signature
        self._epochs = 0

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Averages the epoch's metrics over ranks, in name order (the same on every rank)."""
        # After init() a stopped core raises its error (RankFailure, for elastic.run) in the
        # allreduce below rather than leave this epoch's metrics unaveraged.
        if logs is None or not commsched._state.initialized_here():
            return
        names = sorted(name for name, value in logs.items() if np.ndim(value) == 0 and _is_number(value))
        if not names:
            return
        values = np.array([float(logs[name]) for name in names], dtype=np.float64)
        commsched.allreduce(values, name=f"tf.metric_average.{self._epochs}", op="average")
        self._epochs += 1
        for name, value in zip(names, values):
            logs[name] = float(value)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to initial_lr * multiplier(epoch) from start_epoch up to (not including) end_epoch.

    `multiplier`: a number or a function of the epoch; with staircase=False it gets a fractional
    epoch every batch (steps_per_epoch from fit() unless given). momentum_correction scales an
    optimizer's momentum by new_lr / old_lr for the batch where the rate changes, when the
    momentum is a variable (Keras 3 keeps SGD's momentum a Python number, compiled into the step,
    so it is left as is there).
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required (the learning rate that multiplier() scales)")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, value=multiplier: value)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: float | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Finds steps_per_epoch from fit() when it was not given."""
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(
                "staircase=False needs steps_per_epoch (fit() did not say how many steps an epoch has)"
            )

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Remembers the epoch for the batches that follow."""
        self.current_epoch = epoch

    def _active(self) -> bool:
        return self.current_epoch >= self.start_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch
        )

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Sets the learning rate for this batch."""
        if not self._active():
            return
        if self.staircase:
            if batch == 0:
                self._adjust(float(self.current_epoch))
        else:
            assert self.steps_per_epoch
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Puts back the momentum a correction changed."""
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Reports the learning rate in the logs as "lr"."""
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = _learning_rate(optimizer)
        new = self.initial_lr * float(self.multiplier(epoch))
        try:
            optimizer.learning_rate = new
        except (TypeError, ValueError, AttributeError) as error:
            raise TypeError(
                "the learning rate callbacks set the optimizer's learning rate, which is a schedule here; "
                "give the optimizer a number as learning rate"
            ) from error
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and old > 0 and hasattr(momentum, "assign"):
            value = float(np.asarray(momentum))
            self._restore_momentum = value
            momentum.assign(value * new / old)


def _learning_rate(optimizer: Any) -> float:
    return float(np.asarray(optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate from initial_lr / size to initial_lr over warmup_epochs, batch by batch.

    As in "Accurate, Large Minibatch SGD" (Goyal et al.): start at the single-worker rate and
    reach initial_lr (usually scaled by the number of ranks) after the warmup.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

        def multiplier(epoch: float) -> float:
            # The rate reached at the end of this batch; a fraction of the way from 1/size to 1.
            epoch += 1.0 / (self.steps_per_epoch or 1)
            ranks = commsched.size()
            return 1.0 / ranks * (epoch * (ranks - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Reports the learning rate; says when the warmup ends if verbose."""
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and commsched.rank() == 0:
            print(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_learning_rate(self.model.optimizer):g}."
            )


__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
