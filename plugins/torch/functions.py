"""Broadcast of a model's parameters and of an optimizer's state from one rank to all."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from commsched.torch import _codec, _wire
from commsched.torch.optimizer import DistributedOptimizer, _needs_closure

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


def _device_of(tensors: Iterable[Any]) -> str | None:
    """ "cuda:N" when one of these tensors is on GPU N (commsched then starts NCCL there), else None."""
    return _wire.cuda_device_name(tensors)


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    prefix: str | None = None,
    *,
    process_group: Any = None,
) -> None:
    """Overwrites every tensor in `params` (a state_dict or named_parameters) with root_rank's values.

    `prefix` is put before each tensor's name (Horovod's argument); `process_group`: a
    torch.distributed group to start commsched over, if it is not running.
    """
    named = [(name, t) for name, t in _named(params) if isinstance(t, torch.Tensor)]  # skips _extra_state
    if prefix is not None:
        named = [(f"{prefix}{name}", t) for name, t in named]
    _wire.ensure_initialized(process_group, _device_of(t for _, t in named))
    device = _wire.wire_device(t for _, t in named)
    call = next(_calls)
    with torch.no_grad():
        pending = [
            _wire.start_broadcast(t.detach(), f"torch.bcast{call}.{name}", root_rank, device)
            for name, t in named
        ]
        for out in pending:
            out.finish()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, model: torch.nn.Module | None = None
) -> None:
    """Makes every rank's optimizer state (hyper-parameters, momentum, moments) equal to root_rank's.

    `model` is accepted for Horovod's signature; the state is complete without it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _wire.ensure_initialized(None, _device_of(params))
    _initialize_state(optimizer)
    device = _wire.wire_device(params)  # under NCCL, even the skeleton travels in GPU memory
    call = next(_calls)
    prefix = f"torch.optstate{call}."
    root = commsched.rank() == root_rank
    skeleton, tensors = _codec.encode(optimizer.state_dict()) if root else (b"", [])
    length = torch.tensor([len(skeleton)], dtype=torch.int64, device=device)
    _wire.start_broadcast(length, prefix + "length", root_rank).finish()
    text = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if root:
        text.copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    _wire.start_broadcast(text, prefix + "skeleton", root_rank).finish()
    skeleton = bytes(text.cpu().numpy().tobytes())
    if root:
        wires = [t.detach().to(device, copy=True) for t in tensors]
    else:
        wires = [
            torch.empty(shape, dtype=dtype, device=device) for dtype, shape in _codec.tensor_specs(skeleton)
        ]
    outs = [_wire.start_broadcast(w, f"{prefix}{i}", root_rank) for i, w in enumerate(wires)]
    for out in outs:
        out.finish()
    if not root:
        # Tensors the root kept on the CPU (Adam's step) stay there; load_state_dict moves every other
        # one to its parameter's device and dtype.
        kinds = _codec.tensor_devices(skeleton)
        received = [w.cpu() if kind == "cpu" else w for w, kind in zip(wires, kinds)]
        optimizer.load_state_dict(_codec.decode(skeleton, received))


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer takes one step on zero gradients, as in Horovod, so its state exists to broadcast.

    Every parameter that trains is left with a zero gradient (not None). The step is the wrapped
    optimizer's own: a DistributedOptimizer's step would reduce, and this runs on each rank alone.
    """
    inner = optimizer._inner if isinstance(optimizer, DistributedOptimizer) else optimizer
    if len(inner.state) > 0 or _needs_closure(inner):  # a closure step would need the caller's loss
        return
    for group in inner.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    inner.step()
