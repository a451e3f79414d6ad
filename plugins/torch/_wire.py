"""Where a gradient's bytes go: the commsched core (CPU) or a torch.distributed NCCL group (CUDA).

CUDA tensors bypass the scheduler for now: the core has no NCCL transport yet, so they are
reduced with ``dist.all_reduce(async_op=True)`` on the NCCL process group, launched in the
order they are submitted (the same on every rank for the same graph). Priority, partition
and credit do not apply to them. This file is the only place that knows about that path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import commsched
import torch

COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_CORE_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
}
_CORE_DTYPES.add(torch.int8)


class Work(Protocol):
    """A reduction in flight."""

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the reduction is done."""

    def done(self) -> bool:
        """True once the reduction finished."""


class _DistWork:
    """A torch.distributed Work seen as a commsched Handle."""

    def __init__(self, work: Any, name: str) -> None:
        self._work = work
        self._name = name

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until done; raises if the collective failed."""
        if timeout is not None:
            import datetime

            self._work.wait(datetime.timedelta(seconds=timeout))
        else:
            self._work.wait()
        return None

    def done(self) -> bool:
        """True once the collective finished."""
        return bool(self._work.is_completed())


def compression_dtype(compression: str | None) -> torch.dtype | None:
    """The wire dtype for a compression name; raises ValueError naming the accepted values."""
    if compression not in COMPRESSIONS:
        raise ValueError(f'compression must be None, "fp16" or "bf16", not {compression!r}')
    return COMPRESSIONS[compression]


@dataclass
class Outgoing:
    """One tensor on the wire: `wire` is reduced, then copied back into `target` if they differ."""

    target: torch.Tensor
    wire: torch.Tensor
    work: Work

    def finish(self, timeout: float | None = None) -> torch.Tensor:
        """Waits and returns `target` holding the reduced values."""
        self.work.wait(timeout)
        if self.wire is not self.target:
            self.target.copy_(self.wire)
        return self.target


def _wire_tensor(
    tensor: torch.Tensor, op: str, wire_dtype: torch.dtype | None, cuda: bool, size: int
) -> tuple[torch.Tensor, str]:
    """The tensor that goes on the wire and the op to run on it (no copy when none is needed)."""
    if wire_dtype is not None and tensor.is_floating_point() and tensor.dtype != wire_dtype:
        scaled = tensor / size if op == "average" else tensor
        return scaled.to(wire_dtype).contiguous(), "sum"  # prescaled in full precision: no fp16 overflow
    if not cuda and tensor.dtype not in _CORE_DTYPES:
        raise TypeError(f"commsched.torch cannot reduce {tensor.dtype} tensors; use a float or integer dtype")
    if not tensor.is_contiguous():
        return tensor.contiguous(), op
    return tensor, op


def start_allreduce(
    tensor: torch.Tensor,
    name: str,
    priority: int,
    op: str,
    wire_dtype: torch.dtype | None = None,
    process_group: Any = None,
) -> Outgoing:
    """Starts an in-place allreduce of `tensor`; the result lands in `tensor` on finish()."""
    cuda = tensor.is_cuda
    if cuda:
        import torch.distributed as dist

        wire, wire_op = _wire_tensor(tensor, op, wire_dtype, cuda, dist.get_world_size(process_group))

        reduce_op = dist.ReduceOp.AVG if wire_op == "average" else dist.ReduceOp.SUM
        work: Work = _DistWork(dist.all_reduce(wire, op=reduce_op, group=process_group, async_op=True), name)
    else:
        wire, wire_op = _wire_tensor(tensor, op, wire_dtype, cuda, commsched.size())
        work = commsched.allreduce_async(wire, name=name, priority=priority, op=wire_op)
    return Outgoing(tensor, wire, work)


def start_broadcast(tensor: torch.Tensor, name: str, root: int, process_group: Any = None) -> Outgoing:
    """Starts an in-place broadcast of `tensor` from `root` (a commsched rank)."""
    wire = tensor if tensor.is_contiguous() else tensor.contiguous()
    if tensor.dtype == torch.bool:
        wire = tensor.to(torch.uint8)
    if tensor.is_cuda:
        import torch.distributed as dist

        source = dist.get_global_rank(process_group, root) if process_group is not None else root
        work: Work = _DistWork(dist.broadcast(wire, src=source, group=process_group, async_op=True), name)
    else:
        work = commsched.broadcast_async(wire, root=root, name=name)
    return Outgoing(tensor, wire, work)


def ensure_initialized(process_group: Any = None) -> None:
    """Starts commsched (transport chosen from the launcher) unless the user already did."""
    if not commsched.is_initialized():
        commsched.init(process_group=process_group)
