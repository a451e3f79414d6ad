"""``import commsched.tensorflow.keras as hvd``: Horovod's Keras API (hvd.callbacks, hvd.elastic, DistributedOptimizer).

Everything of commsched.tensorflow, plus ``broadcast_global_variables``, which TensorFlow 2
cannot run (there is no global collection of variables); it says what to use instead.
"""

from __future__ import annotations

import importlib as _importlib
from typing import Any

from commsched.tensorflow import *
from commsched.tensorflow import __all__ as _tensorflow_all
from commsched.tensorflow.keras import callbacks

# By its full name: the star import set `elastic` to commsched.tensorflow's, and `from ... import
# elastic` would return that attribute instead of loading the Keras module.
elastic = _importlib.import_module("commsched.tensorflow.keras.elastic")


def broadcast_global_variables(root_rank: int) -> Any:
    """Not available in TensorFlow 2: use BroadcastGlobalVariablesCallback or broadcast_variables()."""
    raise NotImplementedError(
        "broadcast_global_variables() needs TensorFlow 1's global variables; use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) with fit(), or "
        "hvd.broadcast_variables(model.variables, root_rank) in a custom loop"
    )


__all__ = [*_tensorflow_all, "broadcast_global_variables", "callbacks", "elastic"]  # noqa: PLE0604
