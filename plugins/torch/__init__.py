"""commsched for PyTorch, with Horovod's API: ``import commsched.torch as hvd`` runs Horovod scripts.

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Every collective (allreduce, allgather, broadcast, reducescatter, alltoall, barrier, and
their grouped, asynchronous, in-place and object forms) is scheduled by the commsched core:
each rank launches them in the same agreed order, by priority. Each gradient goes to the
scheduler the moment backward accumulates it; its priority is the position where the first
forward pass reached its parameter (pass ``model=`` to measure it, else declaration order).
``overlap_forward=True`` applies each update as soon as its gradient is reduced and lets the
next forward wait module by module. CPU tensors travel over MPI (under mpiexec) or Gloo
(under torchrun), CUDA ones over NCCL.
"""

from __future__ import annotations

from commsched.torch import collectives as mpi_ops  # noqa: F401  (Horovod's name for its collectives module)
from commsched.torch import elastic  # Horovod's elastic examples call hvd.elastic.run, hvd.elastic.TorchState
from commsched.torch.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from commsched.torch.checkpoint import Checkpointer, Restored
from commsched.torch.collectives import (
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from commsched.torch.compression import Compression
from commsched.torch.functions import broadcast_optimizer_state, broadcast_parameters
from commsched.torch.optimizer import DistributedOptimizer
from commsched.torch.sync_batch_norm import SyncBatchNorm

import commsched
from commsched import HorovodInternalError
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
from commsched._horovod_util import check_extension

# What usually leaves this plug-in's own collectives waiting, added to stall warnings and failures.
# Here, not in each module: a rank that never imported the module (ranks wrapped alike or not) warns too.
_SAME_OPTIMIZER = "every rank must pass the same shard= (COMMSCHED_SHARD) and run backward and step() alike"
_STALL_HINTS = {
    "torch.opt": f"DistributedOptimizer: {_SAME_OPTIMIZER}",
    "torch.shard": f"DistributedOptimizer(shard=True): {_SAME_OPTIMIZER}",
    "commsched.checkpoint": "Checkpointer: every rank must call save() and load() alike",
    "commsched.commit.": "TorchState: every rank must call commit() alike",
}
for _prefix, _hint in _STALL_HINTS.items():
    commsched._add_stall_hint(_prefix, _hint)

__all__ = [
    "Adasum",
    "Average",
    "Checkpointer",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Restored",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "check_extension",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
