"""A transport over torch.distributed (Gloo) process groups, driven through the core's trampoline."""

from __future__ import annotations

import ctypes
import datetime
from collections.abc import Callable
from typing import Any

from commsched.launch import LaunchInfo

_TORCH_DTYPES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
}

# Types Gloo does not reduce, and the wider type it reduces them in.
_WIDENED: dict[str, Any] = {}


def _movable(tensor: Any) -> Any:
    """The tensor as a type Gloo moves (int16 as float16 bits: nothing is computed on them)."""
    import torch

    return tensor.view(torch.float16) if tensor.dtype == torch.int16 else tensor


# Agreement reports are usually a few dozen bytes: one fixed slot per rank carries them.
_SLOT_BYTES = 1024
_LENGTH_BYTES = 8


class _Pending:
    """A torch.distributed Work seen through the core's PendingOp interface."""

    def __init__(self, work: Any, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish  # copies a padded or whole result into the core's output, once done
        # The future is marked done before its callbacks run, while Work.is_completed() may
        # turn true only after them: asking the future keeps the doorbell's wake-up useful.
        self._future = work.get_future()

    def test(self) -> bool:
        """True once the collective finished; raises if it failed."""
        if not self._future.done():
            return False
        self._work.wait()  # surfaces the error of a failed collective
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    def on_done(self, callback: Any) -> None:
        """Calls callback() once the collective completes (or fails), from Gloo's thread."""
        self._future.add_done_callback(lambda _future: callback())


class GlooTransport:
    """Runs agreement and data collectives on Gloo process groups (CPU memory)."""

    name = "gloo"
    # Completions ring the core's doorbell (see _Pending.on_done): polling is only a fallback.
    poll_interval_us = 5000

    def __init__(self, launch: LaunchInfo, process_group: Any = None) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise RuntimeError("COMMSCHED_TRANSPORT=gloo needs PyTorch: pip install torch") from None
        self._torch = torch
        self._dist = dist
        _WIDENED.setdefault("int16", torch.int32)
        self._owned: list[Any] = []  # subgroups this transport created
        if not dist.is_initialized():
            if process_group is not None:
                raise ValueError("process_group= was given but torch.distributed is not initialised")
            if not launch.master_addr or not launch.master_port:
                raise ValueError(
                    "COMMSCHED_TRANSPORT=gloo needs MASTER_ADDR and MASTER_PORT (torchrun sets them) "
                    "or an initialised torch.distributed process group"
                )
            # Left in place at shutdown: a later init() finds it, and a new rendezvous on
            # torchrun's store would meet the old one's keys.
            dist.init_process_group("gloo", rank=launch.rank, world_size=launch.size)
        group = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        # Data and agreement get groups of their own, so an agreement never queues behind a large reduction.
        self._data = group if dist.get_backend(group) == "gloo" else dist.new_group(ranks, backend="gloo")
        if self._data is not group:
            self._owned.append(self._data)
        self._control = dist.new_group(ranks, backend="gloo")
        self._owned.append(self._control)
        self._global_ranks = ranks
        self.rank = dist.get_rank(self._data)
        self.size = dist.get_world_size(self._data)
        self._slot = torch.zeros(_SLOT_BYTES, dtype=torch.uint8)
        self._slots = [torch.zeros(_SLOT_BYTES, dtype=torch.uint8) for _ in range(self.size)]

    def close(self) -> None:
        """Destroys the groups this transport created, so none outlives commsched.shutdown()."""
        # Gloo groups left to the interpreter's exit get torn down while Python finalizes,
        # when their threads can no longer take the GIL.
        for group in reversed(self._owned):
            if self._dist.is_initialized():
                self._dist.destroy_process_group(group)
        self._owned.clear()

    def _tensor_at(self, address: int, count: int, dtype: str) -> Any:
        torch_dtype = getattr(self._torch, _TORCH_DTYPES[dtype])
        if count == 0:
            return self._torch.empty(0, dtype=torch_dtype)
        itemsize = self._torch.empty(0, dtype=torch_dtype).element_size()
        memory = (ctypes.c_char * (count * itemsize)).from_address(address)
        return self._torch.frombuffer(memory, dtype=torch_dtype)

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Allgathers one byte string per rank: one round trip when every report fits a slot."""
        torch, dist = self._torch, self._dist
        timeout = datetime.timedelta(seconds=timeout_s)
        # A slot holds the length and, when it fits, the report itself; only a long report
        # costs a second allgather, sized by the longest one.
        slot = self._slot
        slot[:_LENGTH_BYTES] = torch.tensor([len(report)], dtype=torch.int64).view(torch.uint8)
        if len(report) <= _SLOT_BYTES - _LENGTH_BYTES and report:
            slot[_LENGTH_BYTES : _LENGTH_BYTES + len(report)] = torch.frombuffer(
                bytearray(report), dtype=torch.uint8
            )
        dist.all_gather(self._slots, slot, group=self._control, async_op=True).wait(timeout)
        sizes = [int(s[:_LENGTH_BYTES].view(torch.int64).item()) for s in self._slots]
        width = max(sizes)
        if width <= _SLOT_BYTES - _LENGTH_BYTES:
            return [
                s[_LENGTH_BYTES : _LENGTH_BYTES + n].numpy().tobytes() for s, n in zip(self._slots, sizes)
            ]
        mine = torch.zeros(width, dtype=torch.uint8)
        if report:
            mine[: len(report)] = torch.frombuffer(bytearray(report), dtype=torch.uint8)
        gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self._control, async_op=True).wait(timeout)
        return [t[:n].numpy().tobytes() for t, n in zip(gathered, sizes)]

    def unsupported(self, kind: str, dtype: str, op: str) -> str:
        """Gloo runs every collective and op commsched has (see start_collective for how)."""
        return ""

    def _reduce_op(self, op: str) -> Any:
        ops = self._dist.ReduceOp
        return {"min": ops.MIN, "max": ops.MAX, "product": ops.PRODUCT}.get(op, ops.SUM)

    def start(self, address: int, count: int, dtype: str, kind: str, root: int, op: str = "sum") -> _Pending:
        """Starts an in-place allreduce (sum, min, max, product) or broadcast on raw memory."""
        tensor = self._tensor_at(address, count, dtype)
        if kind == "allreduce" and dtype in _WIDENED:
            # Gloo reduces no int16: in int32, whose low 16 bits wrap as int16 arithmetic would.
            wide = tensor.to(_WIDENED[dtype])
            work = self._dist.all_reduce(wide, op=self._reduce_op(op), group=self._data, async_op=True)
            return _Pending(work, lambda: tensor.copy_(wide.to(tensor.dtype)))
        if kind == "allreduce":
            work = self._dist.all_reduce(tensor, op=self._reduce_op(op), group=self._data, async_op=True)
        else:
            tensor = _movable(tensor)
            work = self._dist.broadcast(tensor, src=self._global_ranks[root], group=self._data, async_op=True)
        return _Pending(work)

    def start_collective(
        self,
        kind: str,
        dtype: str,
        op: str,
        address: int,
        count: int,
        output: int,
        recv_counts: list[int],
        send_counts: list[int],
        layout: list[int],
    ) -> _Pending:
        """Allgather (all_gather of equal, padded parts), reducescatter (an allreduce of a copy, of
        which this rank keeps its part) or alltoall (all_to_all_single) into `output`."""
        torch, dist = self._torch, self._dist
        source = self._tensor_at(address, count, dtype)
        target = self._tensor_at(
            output, sum(recv_counts) if kind != "reducescatter" else recv_counts[self.rank], dtype
        )
        if kind != "reducescatter":  # moving bytes only: any type of the same width does
            source, target = _movable(source), _movable(target)
        if kind == "allgather":
            width = max(recv_counts)
            padded = torch.zeros(width, dtype=source.dtype)
            padded[:count] = source
            parts = [torch.empty(width, dtype=source.dtype) for _ in range(self.size)]
            work = dist.all_gather(parts, padded, group=self._data, async_op=True)

            def gathered() -> None:
                offset = 0
                for part, received in zip(parts, recv_counts):
                    target[offset : offset + received] = part[:received]
                    offset += received

            return _Pending(work, gathered)
        if kind == "reducescatter":
            reduced = source.to(_WIDENED[dtype]) if dtype in _WIDENED else source.clone()
            work = dist.all_reduce(reduced, op=self._reduce_op(op), group=self._data, async_op=True)
            start = sum(recv_counts[: self.rank])

            def kept() -> None:
                target[:] = reduced[start : start + recv_counts[self.rank]].to(target.dtype)

            return _Pending(work, kept)
        work = dist.all_to_all_single(
            target,
            source,
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self._data,
            async_op=True,
        )
        return _Pending(work)
