"""Keras callbacks: start every rank from rank 0's weights."""

from __future__ import annotations

from typing import Any

import keras
from commsched.tensorflow import functions


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of fit(), sets every rank's model (and built optimizer) variables to root_rank's."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.done = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Broadcasts the model's variables once, before the first batch."""
        if self.done:
            return
        functions.broadcast_variables(self.model.variables, self.root_rank, prefix="broadcast.model")
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            functions.broadcast_variables(optimizer.variables, self.root_rank, prefix="broadcast.optimizer")
        self.done = True
