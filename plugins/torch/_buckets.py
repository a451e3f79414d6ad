"""Priority buckets: flat per-dtype gradient storage laid out in the next forward's order.

After the first iteration every trainable parameter's gradient is a view of a bucket (PyTorch
DDP's ``gradient_as_bucket_view``), so autograd accumulates straight into it and a bucket goes on
the wire as one collective, with no copy in or out. Buckets follow the parameters' priorities (the
order the forward pass first reaches them) and are cut so none grows past the bucket size, which by
default is one partition: a bucket then costs one launch and carries its own priority, and the
core's partitioning and credit keep working on the bigger ones.

Every rank must build the same buckets, so the order comes from rank 0 (see Reducer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from commsched.torch._guard import InFlightGrad

import torch

if TYPE_CHECKING:
    from commsched.torch._reducer import Slot
    from commsched.torch._wire import Outgoing


@dataclass(eq=False)
class Bucket:
    """Consecutive gradients of one dtype and device, reduced as one collective."""

    name: str
    flat: torch.Tensor
    slots: list[Slot]
    priority: int
    # Each member's gradient home in `flat` and the guard over it, in `slots` order; fixed at build,
    # so a bucket still in flight after a new layout rebound its members settles from its own.
    views: list[torch.Tensor] = field(default_factory=list)
    guards: list[Any] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # the members' slot indices
    params: list[torch.Tensor] = field(default_factory=list)  # the members' parameters
    layout: int = 0  # which of the reducer's layouts built it
    # While in flight: the collective and its iteration.
    out: Outgoing | None = None
    iteration: int = -1
    position: int = 0  # its place in its layout's list of buckets
    # What it carries in flight, per member: whether this rank had the gradient, whether it was sparse.
    flight_used: list[bool] = field(default_factory=list)
    flight_sparse: list[bool] = field(default_factory=list)
    dense: list[bool] = field(default_factory=list)  # all False: flight_sparse when no member was sparse

    def plain(self) -> bool:
        """Whether every member had a dense gradient here when sent: each gets its view back as .grad."""
        return self.flight_sparse is self.dense and all(self.flight_used)


def group_key(param: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    """Parameters that may share a bucket: same dtype, same device."""
    return param.dtype, param.device


def cut(
    items: list[Any], limit: int, key: Callable[[Any], Any], param: Callable[[Any], torch.Tensor]
) -> list[list[Any]]:
    """Cuts `items` (in priority order) into runs of one `key`, each at most `limit` bytes of `param`.

    An item bigger than `limit` gets a run of its own; `limit` 0 means no limit. A run holds
    consecutive items of its key, so the first run holds what the forward needs first.
    """
    open_bucket: dict[Any, list[Any]] = {}
    open_bytes: dict[Any, int] = {}
    done: list[list[Any]] = []
    for item in items:
        kind = key(item)
        tensor = param(item)
        nbytes = tensor.numel() * tensor.element_size()
        current = open_bucket.get(kind)
        if current is not None and limit > 0 and open_bytes[kind] + nbytes > limit:
            done.append(current)
            current = None
        if current is None:
            current = open_bucket[kind] = []
            open_bytes[kind] = 0
        current.append(item)
        open_bytes[kind] += nbytes
    done.extend(open_bucket.values())
    return done


def plan(slots: list[Slot], limit: int, priority: list[int]) -> list[list[Slot]]:
    """Cuts `slots` (in priority order) into buckets of one dtype and device, each at most `limit` bytes.

    `priority[slot.index]` is the priority every rank agreed on for that slot.

    A parameter bigger than `limit` gets a bucket of its own; `limit` 0 means no limit. A bucket
    holds consecutive parameters of its kind, so the first bucket holds what the forward needs first.
    """
    done = cut(slots, limit, lambda slot: group_key(slot.param), lambda slot: slot.param)
    # The priority order of the buckets is that of their first member.
    return sorted(done, key=lambda members: (priority[members[0].index], members[0].index))


def build(
    members: list[Slot],
    name: str,
    priority: int,
    layout: int = 0,
    touch: Callable[[Bucket, Any], None] | None = None,
) -> Bucket:
    """Allocates one bucket and gives each member its view of it (the gradient's home from now on).

    `touch(bucket, guard)` runs when code touches the values of a member's guard (see _guard); it is
    bound once here, so sending the bucket arms nothing per member.
    """
    first = members[0].param
    total = sum(slot.param.numel() for slot in members)
    flat = torch.zeros(total, dtype=first.dtype, device=first.device)
    bucket = Bucket(name, flat, list(members), priority, layout=layout)
    settle = None if touch is None else functools.partial(touch, bucket)
    offset = 0
    for slot in members:
        numel = slot.param.numel()
        view = flat[offset : offset + numel].view(slot.param.shape)
        offset += numel
        slot.bind(bucket, view, settle)
        bucket.views.append(view)
        bucket.guards.append(slot.guard)
        bucket.indices.append(slot.index)
        bucket.params.append(slot.param)
    bucket.dense = [False] * len(members)
    return bucket


def gather(bucket: Bucket, used: list[bool], grads: list[Any]) -> list[bool]:
    """Brings each member's gradient into the bucket, whatever .grad holds; returns which were sparse."""
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    sparse = [False] * len(grads)
    members = zip(bucket.params, grads, bucket.views, bucket.guards, used)
    for k, (param, grad, view, guard, slot_used) in enumerate(members):
        if slot_used:
            if grad is guard or grad is view:
                pass
            elif grad is None:  # set to None after backward: it counts as zeros
                zeros.append(view)
            elif grad.is_sparse:
                targets.append(view)
                sources.append(grad.to_dense())
                sparse[k] = True  # the sparse .grad stays readable meanwhile
            else:
                targets.append(view)
                sources.append(grad.as_subclass(torch.Tensor) if isinstance(grad, InFlightGrad) else grad)
            if not sparse[k]:
                param.grad = guard
        else:
            # Not used here: whatever .grad holds stays untouched unless another rank used it.
            if grad is not None and (grad is view or grad is guard):
                param.grad = view.clone()
            zeros.append(view)
    if targets:
        torch._foreach_copy_(targets, sources)
    if zeros:
        torch._foreach_zero_(zeros)
    return sparse
