"""``import commsched.tensorflow.keras as hvd``: Horovod's Keras API (hvd.callbacks, DistributedOptimizer).

Everything of commsched.tensorflow, plus ``broadcast_global_variables``, which TensorFlow 2
cannot run (there is no global collection of variables); it says what to use instead.
"""

from __future__ import annotations

from typing import Any

from commsched.tensorflow import *
from commsched.tensorflow import __all__ as _tensorflow_all
from commsched.tensorflow.keras import callbacks


def broadcast_global_variables(root_rank: int) -> Any:
    """Not available in TensorFlow 2: use BroadcastGlobalVariablesCallback or broadcast_variables()."""
    raise NotImplementedError(
        "broadcast_global_variables() needs TensorFlow 1's global variables; use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) with fit(), or "
        "hvd.broadcast_variables(model.variables, root_rank) in a custom loop"
    )


__all__ = [*_tensorflow_all, "broadcast_global_variables", "callbacks"]  # noqa: PLE0604
