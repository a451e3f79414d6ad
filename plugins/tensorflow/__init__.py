"""commsched for TensorFlow 2 / Keras 3: async custom ops, DistributedOptimizer, DistributedGradientTape.

    commsched.init()
    optimizer = commsched.tensorflow.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss=...)
    model.fit(..., callbacks=[commsched.tensorflow.BroadcastGlobalVariablesCallback(0)])

or, in a custom loop, ``tape = commsched.tensorflow.DistributedGradientTape(tape)``.
Gradients are reduced by C++ AsyncOpKernels that hand each tensor to the commsched core
when TensorFlow computes it, so inside tf.function communication overlaps the backward
pass; the priority of a gradient is its variable's position in the forward pass. The ops
are compiled against the installed TensorFlow on first use into a cache directory
(COMMSCHED_TF_OPS_DIR, default ~/.cache/commsched/tf-ops), rebuilt when TensorFlow or the
sources change. IndexedSlices gradients (embeddings) are densified before reduction.
"""

from __future__ import annotations

from commsched.tensorflow._build import BuildError
from commsched.tensorflow._order import forward_order
from commsched.tensorflow.callbacks import BroadcastGlobalVariablesCallback
from commsched.tensorflow.functions import allreduce, broadcast, broadcast_variables
from commsched.tensorflow.optimizer import DistributedOptimizer
from commsched.tensorflow.tape import DistributedGradientTape

import commsched

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "BuildError",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "forward_order",
    "init",
    "local_rank",
    "rank",
    "shutdown",
    "size",
]

init = commsched.init
shutdown = commsched.shutdown
rank = commsched.rank
size = commsched.size
local_rank = commsched.local_rank
