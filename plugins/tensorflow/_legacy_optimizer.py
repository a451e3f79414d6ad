"""DistributedOptimizer for a TF1-style optimizer (tf.compat.v1.train.Optimizer), as Horovod's.

compute_gradients() returns the gradients reduced over the ranks of the process set (a rank
outside the set, or a variable registered with register_local_var(), keeps its own gradient);
apply_gradients(), get_slot() and variables() are the wrapped optimizer's. Such optimizers build
graphs: the reduction runs as the custom ops when the session runs the update.
"""

from __future__ import annotations

from typing import Any

from commsched.tensorflow import functions

import tensorflow as tf


class LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train.Optimizer: gradients are reduced over ranks before the update."""

    def __init__(
        self,
        optimizer: Any,
        how: functions.Reduction,
        name: str | None = None,
        use_locking: bool = False,
        scale_local_gradients: bool = True,
    ) -> None:
        name = name or f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._how = how
        self._prefix = name
        self._local_vars: set[Any] = set()
        self.process_set = how.process_set
        self.scale_local_gradients = scale_local_gradients

    def register_local_var(self, var: Any) -> None:
        """Keeps `var`'s gradient local (not reduced; divided by the set's size when scaling)."""
        self._local_vars.add(functions.variable_key(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, each reduced over the ranks of the process set."""
        functions.require_init("DistributedOptimizer.compute_gradients()")
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        grads = functions.reduce_gradients(
            [grad for grad, _ in pairs],
            [var for _, var in pairs],
            self._prefix,
            self._how.op,
            None,
            self._how,
            local=self._local_vars,
            scale_local=self.scale_local_gradients,
        )
        return [(grad, var) for grad, (_, var) in zip(grads, pairs)]

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's apply_gradients."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's get_slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's get_slot_names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)
