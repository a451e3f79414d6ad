"""Measures the order in which a forward pass reads its variables, for gradient priorities.

The next forward pass needs the first-used variables first, and declaration order (that
of model.trainable_variables) can differ from use order in subclassed models. One eager
forward pass under a TensorFlow op callback sees every ReadVariableOp in execution order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf


def _handle_id(variable: Any) -> int | None:
    for owner in (variable, getattr(variable, "value", None)):
        handle = getattr(owner, "handle", None)
        if handle is not None:
            return id(handle)
    return None


def forward_order(
    model: Callable[..., Any], *inputs: Any, variables: Sequence[Any] | None = None
) -> list[Any]:
    """Runs `model(*inputs)` eagerly once; returns `variables` (default model.trainable_variables) in first-read order.

    Variables the pass never read follow in their given order. Falls back to the given
    order when TensorFlow's op-callback hook is unavailable.
    """
    if variables is None:
        variables = list(getattr(model, "trainable_variables", []))
    variables = list(variables)
    try:
        # Private but stable since TF 2.2; only for this one measuring pass.
        from tensorflow.python.framework import op_callbacks
    except ImportError:
        return variables
    by_handle = {key: v for v in variables if (key := _handle_id(v)) is not None}
    seen: list[Any] = []
    seen_ids: set[int] = set()

    def record(
        op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None, graph: Any = None
    ) -> None:
        if op_type == "ReadVariableOp" and inputs:
            variable = by_handle.get(id(inputs[0]))
            if variable is not None and id(variable) not in seen_ids:
                seen_ids.add(id(variable))
                seen.append(variable)

    with tf.init_scope():  # eager even when called while tracing, so the callback sees real reads
        op_callbacks.add_op_callback(record)
        try:
            model(*inputs)
        finally:
            op_callbacks.remove_op_callback(record)
    return seen + [v for v in variables if id(v) not in seen_ids]
