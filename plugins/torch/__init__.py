"""commsched for PyTorch: one-line optimizer wrap with forward-order priorities.

    optimizer = commsched.torch.DistributedOptimizer(optimizer, model=model)
    commsched.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    commsched.torch.broadcast_optimizer_state(optimizer, root_rank=0)

Each gradient goes to the scheduler the moment backward accumulates it; its priority is
the position where the first forward pass reached its parameter. ``overlap_forward=True``
applies each update as soon as its gradient is reduced and lets the next forward wait
module by module. Every tensor travels over the commsched core: CPU ones over MPI (under
mpiexec) or Gloo (under torchrun), CUDA ones over NCCL, with the same priorities, partitions
and credit. CUDA parameters start commsched with device="cuda" unless it is already running.
"""

from __future__ import annotations

from commsched.torch.checkpoint import Checkpointer, Restored
from commsched.torch.functions import allreduce, allreduce_, broadcast_optimizer_state, broadcast_parameters
from commsched.torch.optimizer import DistributedOptimizer

import commsched

__all__ = [
    "Checkpointer",
    "DistributedOptimizer",
    "Restored",
    "allreduce",
    "allreduce_",
    "broadcast_optimizer_state",
    "broadcast_parameters",
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
