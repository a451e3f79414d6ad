"""Collectives on torch tensors: broadcast of parameters and optimizer state, out-of-place allreduce."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from commsched.torch import _codec, _wire

import commsched
import torch

_calls = itertools.count()  # every rank calls these in the same order, so names match


def _named(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                "pass model.state_dict(), model.named_parameters() or a list of (name, tensor) pairs"
            )
    return items


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    process_group: Any = None,
) -> None:
    """Overwrites every tensor in `params` (a state_dict or named_parameters) with root_rank's values."""
    _wire.ensure_initialized(process_group)
    call = next(_calls)
    pending = []
    with torch.no_grad():
        for name, tensor in _named(params):
            if not isinstance(tensor, torch.Tensor):
                continue  # state_dict extras (e.g. _extra_state) are not tensors
            data = tensor.detach()
            pending.append(_wire.start_broadcast(data, f"torch.bcast{call}.{name}", root_rank, process_group))
        for out in pending:
            out.work.wait()
            if out.wire is not out.target:
                out.target.copy_(out.wire)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Makes every rank's optimizer state (hyper-parameters, momentum, moments) equal to root_rank's."""
    _wire.ensure_initialized()
    call = next(_calls)
    prefix = f"torch.optstate{call}."
    if commsched.rank() == root_rank:
        skeleton, tensors = _codec.encode(optimizer.state_dict())
    else:
        skeleton, tensors = b"", []
    length = torch.tensor([len(skeleton)], dtype=torch.int64)
    commsched.broadcast(length, root=root_rank, name=prefix + "length")
    text = torch.zeros(int(length.item()), dtype=torch.uint8)
    if commsched.rank() == root_rank:
        text.copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    commsched.broadcast(text, root=root_rank, name=prefix + "skeleton")
    skeleton = bytes(text.numpy().tobytes())
    if commsched.rank() == root_rank:
        wires = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
    else:
        wires = [torch.empty(shape, dtype=dtype) for dtype, shape in _codec.tensor_specs(skeleton)]
    outs = [_wire.start_broadcast(w, f"{prefix}{i}", root_rank) for i, w in enumerate(wires)]
    for out in outs:
        out.work.wait()
        if out.wire is not out.target:
            out.target.copy_(out.wire)
    if commsched.rank() != root_rank:
        # load_state_dict moves each state tensor to its parameter's device and dtype
        optimizer.load_state_dict(_codec.decode(skeleton, wires))


def allreduce(
    tensor: torch.Tensor, name: str | None = None, op: str = "average", process_group: Any = None
) -> torch.Tensor:
    """Returns the reduction of `tensor` over all ranks (a new tensor; the input is left as is)."""
    _wire.ensure_initialized(process_group)
    if name is None:
        name = f"torch.allreduce.{next(_calls)}"
    result = tensor.detach().clone(memory_format=torch.contiguous_format)
    _wire.start_allreduce(result, name, 0, op, None, process_group).finish()
    return result


def allreduce_(
    tensor: torch.Tensor, name: str | None = None, op: str = "average", process_group: Any = None
) -> torch.Tensor:
    """Reduces `tensor` over all ranks in place and returns it."""
    _wire.ensure_initialized(process_group)
    if name is None:
        name = f"torch.allreduce.{next(_calls)}"
    with torch.no_grad():
        return _wire.start_allreduce(tensor.detach(), name, 0, op, None, process_group).finish()
