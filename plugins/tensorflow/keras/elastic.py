"""``hvd.elastic`` of ``commsched.tensorflow.keras``: Horovod's KerasState and its Keras callbacks.

@hvd.elastic.run
def train(state):
    model.fit(data, steps_per_epoch=..., epochs=epochs - state.epoch, callbacks=[
        hvd.elastic.CommitStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
    ])

train(hvd.elastic.KerasState(model, batch=0, epoch=0))
"""

from __future__ import annotations

from typing import Any

import keras
from commsched.tensorflow.elastic import TensorFlowKerasState, run

from commsched.elastic import State

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class KerasState(TensorFlowKerasState):
    """The state of a Keras model and optimizer plus plain objects by keyword (Horovod's KerasState)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at the end of each epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(
                f"CommitStateCallback: batches_per_commit must be 1 or more, not {batches_per_commit!r}"
            )
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Starts the count afresh, so every rank commits at the same batches after a re-forming."""
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Commits when `batches_per_commit` batches ended since the last commit."""
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Commits at the end of every epoch."""
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of the last finished batch (0 again at each epoch's end); with
    `steps_per_epoch`, the first epoch after a re-forming runs only the batches the commit had left."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Forgets the epoch length, which the next epoch reads again."""
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Shortens the epoch by the batches the state says are done."""
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Records the batch just finished."""
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """A new epoch starts at batch 0."""
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs finished over the whole job, across re-formings
    (Keras numbers the epochs of each fit() call from 0)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch  # type: ignore[attr-defined]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Takes the epoch the state restarts from."""
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """The epochs done: those before this fit() plus this one's, counted from 1."""
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]
