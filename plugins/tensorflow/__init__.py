"""commsched for TensorFlow 2 / Keras 3, with Horovod's API: ``import commsched.tensorflow as hvd``.

    hvd.init()
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1 * hvd.size()))
    model.compile(optimizer=optimizer, loss=...)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

or, in a custom loop, ``tape = hvd.DistributedGradientTape(tape)``. Gradients are reduced
by C++ AsyncOpKernels that hand each tensor to the commsched core when TensorFlow computes
it, so inside tf.function communication overlaps the backward pass; the priority of a
gradient is its variable's position in the forward pass. The ops are compiled against the
installed TensorFlow on first use into a cache directory (COMMSCHED_TF_OPS_DIR, default
~/.cache/commsched/tf-ops), rebuilt when TensorFlow or the sources change. IndexedSlices
gradients (embeddings) are densified before reduction. allreduce (every op, scale factors),
grouped_allreduce, allgather, reducescatter, alltoall, broadcast and barrier are custom ops too,
eager and inside tf.function, with Horovod's gradients; the object forms and collectives on a
process set run eagerly through commsched's framework-free API.
"""

from __future__ import annotations

import importlib.util as _importlib_util

# Checked before anything imports TensorFlow, so a missing framework is named as such, not as the
# first module of it that some import line happens to reach.
if _importlib_util.find_spec("tensorflow") is None:
    raise ImportError(
        "commsched.tensorflow needs TensorFlow 2.16+ (with Keras 3), which is not installed for this "
        "Python: pip install tensorflow-cpu (or tensorflow for GPUs); for PyTorch use commsched.torch"
    )

from commsched.tensorflow import callbacks, elastic, util
from commsched.tensorflow import collectives as mpi_ops  # noqa: F401  (Horovod's name for its collectives module)
from commsched.tensorflow._build import BuildError
from commsched.tensorflow._order import forward_order
from commsched.tensorflow.callbacks import BroadcastGlobalVariablesCallback
from commsched.tensorflow.collectives import (
    allgather,
    allgather_object,
    alltoall,
    barrier,
    broadcast_,
    broadcast_object,
    broadcast_object_fn,
    grouped_allgather,
    grouped_reducescatter,
    join,
    reducescatter,
)
from commsched.tensorflow.compression import Compression
from commsched.tensorflow.functions import (
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    grouped_allreduce,
)
from commsched.tensorflow.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from commsched.tensorflow.sync_batch_norm import SyncBatchNormalization
from commsched.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from commsched.tensorflow.util import (
    _executing_eagerly,  # noqa: F401 - Horovod's tests call hvd._executing_eagerly
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)

from commsched._horovod import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from commsched._horovod_util import check_extension, gpu_available, split_list

__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesCallback",
    "BuildError",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "callbacks",
    "ccl_built",
    "check_extension",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "forward_order",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "gpu_available",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "split_list",
    "start_timeline",
    "stop_timeline",
    "util",
]
