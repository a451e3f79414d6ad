"""Elastic training for TensorFlow with Horovod's API: ``TensorFlowKerasState``, ``TensorFlowState``, ``run``.

@commsched.tensorflow.elastic.run
def train(state):
    for state.batch in range(state.batch, batches):
        ...  # a step with DistributedGradientTape or a DistributedOptimizer
        state.commit()

train(commsched.tensorflow.elastic.TensorFlowKerasState(model, optimizer, batch=0))

Under ``commsched-run --min-np`` a lost rank makes the collectives of the others fail; ``run``
restores the last commit, re-forms the survivors (commsched.elastic) and calls the function again
after rank 0's state is broadcast. A collective op that failed because commsched stopped raises a
TensorFlow error inside the step; ``run`` takes it for the rank failure it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from commsched.tensorflow.collectives import broadcast_object, broadcast_object_fn
from commsched.tensorflow.functions import broadcast_variables

import commsched
import tensorflow as tf
from commsched.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reform,
    run_fn,
)

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]


def _stopped_by_failure(error: tf.errors.OpError) -> bool:
    """True when a TensorFlow op failed because commsched stopped (a rank was lost), not for a bad input."""
    from commsched import _core

    # A stopped core leaves the runtime in place (so is_initialized() is False but nothing is
    # shut down): its ops end with "commsched: commsched stopped ...".
    return "commsched:" in (error.message or "") and not _core.running()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: runs `func(state, ...)` elastically, re-forming the ranks when one fails (Horovod's API)."""

    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if _stopped_by_failure(error):
                raise HorovodInternalError(error.message) from error
            raise

    wrapper.__name__ = getattr(func, "__name__", "wrapper")
    wrapper.__doc__ = getattr(func, "__doc__", None)
    return run_fn(wrapper, reform)


def _optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables: a property in Keras 3, a method in older optimizers."""
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _eager() -> bool:
    return tf.executing_eagerly()


class _VariablesState(ObjectState):
    """An ObjectState that also commits TensorFlow variables: subclasses copy them out and back."""

    def save(self) -> None:
        """Copies the variables' values and the plain objects into memory."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Loads the last committed values and objects."""
        self._load_model()
        super().restore()

    def _save_model(self) -> None:
        raise NotImplementedError

    def _load_model(self) -> None:
        raise NotImplementedError


class TensorFlowKerasState(_VariablesState):
    """A Keras model and its optimizer (plus plain objects by keyword), committed to memory together
    (Horovod's TensorFlowKerasState). The optimizer defaults to the model's compiled one."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if hasattr(model, "build") and not model.built:
            raise ValueError(
                "TensorFlowKerasState: the model must be built first; run model.build(input_shape)"
            )
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        # Keras 3 creates an optimizer's slots at its first step: created now, a commit taken before
        # that step covers them, and a restore after it resets them too.
        if self.optimizer is not None and hasattr(self.optimizer, "build") and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        self._saved_model: list[Any] = []
        self._saved_optimizer: list[Any] = []
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=commsched.rank, **kwargs)

    def sync(self) -> None:
        """Gives every rank rank 0's variables and objects, and commits them."""
        broadcast_variables(self.model.variables, root_rank=0, prefix="elastic.model")
        optimizer_variables = _optimizer_variables(self.optimizer)
        if optimizer_variables:
            broadcast_variables(optimizer_variables, root_rank=0, prefix="elastic.optimizer")
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        # Values, not tf.identity tensors of the variables: a copy the next step cannot alias.
        self._saved_model = [v.numpy() for v in self.model.variables]
        self._saved_optimizer = [v.numpy() for v in _optimizer_variables(self.optimizer)]

    def _load_model(self) -> None:
        _assign_all(self.model.variables, self._saved_model, "model")
        _assign_all(_optimizer_variables(self.optimizer), self._saved_optimizer, "optimizer")


def _assign_all(variables: Sequence[Any], values: Sequence[Any], what: str) -> None:
    variables = list(variables)
    if len(variables) != len(values):
        raise RuntimeError(
            f"elastic state: the {what} has {len(variables)} variables but {len(values)} were committed; "
            f"create every {what} variable (build the model and optimizer) before the state is made"
        )
    for variable, value in zip(variables, values):
        variable.assign(value)


class TensorFlowState(_VariablesState):
    """A list of tf.Variables (plus plain objects by keyword), committed to memory together (Horovod's
    TensorFlowState). Eagerly, or in graph mode with the `session` that holds the variables."""

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        if variables is None:
            if _eager():
                raise ValueError(
                    "TensorFlowState: TensorFlow 2 has no global variables to default to in eager mode; "
                    "pass the variables to track, e.g. TensorFlowState(model.variables)"
                )
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        self.session = session if session is not None or _eager() else tf.compat.v1.get_default_session()
        # In graph mode the broadcast is one op, built once and run at each sync.
        self._bcast_op = (
            None if _eager() else broadcast_variables(self.variables, root_rank=0, prefix="elastic")
        )
        self._values: list[Any] = []
        self._save_model()
        bcast = broadcast_object if _eager() else broadcast_object_fn(session=self.session)
        super().__init__(bcast_object=bcast, get_rank=commsched.rank, **kwargs)

    def sync(self) -> None:
        """Gives every rank rank 0's values and objects, and commits them."""
        if self._bcast_op is None:
            broadcast_variables(self.variables, root_rank=0, prefix="elastic")
        else:
            self._session().run(self._bcast_op)
        self._save_model()
        super().sync()

    def _session(self) -> Any:
        if self.session is None:
            raise RuntimeError(
                "TensorFlowState in graph mode needs a session: pass session= or create the state "
                "inside `with session.as_default():`"
            )
        return self.session

    def _save_model(self) -> None:
        if self._bcast_op is None:
            self._values = [v.numpy() for v in self.variables]
        else:
            self._values = self._session().run(self.variables)

    def _load_model(self) -> None:
        if self._bcast_op is None:
            for variable, value in zip(self.variables, self._values):
                variable.assign(value)
        else:
            for variable, value in zip(self.variables, self._values):
                variable.load(value, self._session())
