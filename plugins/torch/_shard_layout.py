"""The sharded optimizer's layout: flat per-dtype buckets cut into one contiguous shard per rank.

A bucket holds consecutive trainable parameters of one parameter group, dtype and device, in the
forward order every rank agreed on. Its flat length is padded to a multiple of the number of ranks,
so a reduce-scatter leaves every rank an equal part: rank r owns elements [r*k, (r+1)*k). The
padding stays zero in gradients and parameters, so it changes no norm and no update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from commsched.torch import _buckets

import torch


@dataclass(eq=False)
class Member:
    """One parameter inside a bucket: where its elements sit in the bucket's flat vector."""

    param: torch.Tensor
    label: str
    index: int  # position among the optimizer's parameters (group order)
    offset: int
    numel: int


@dataclass(eq=False)
class ShardBucket:
    """One flat bucket: its members, this rank's shard "parameter" (what the inner optimizer steps)."""

    name: str
    group: int
    priority: int
    members: list[Member]
    padded: int  # flat length, a multiple of the number of ranks
    start: int  # this rank's shard: elements [start, start + shard.numel())
    shard: torch.Tensor  # a leaf tensor of shard length; its .grad is the reduced gradient shard
    ready: int = 0  # members whose gradient is complete this iteration
    used: list[bool] = field(default_factory=list)
    scatter: Any = None  # the reduce-scatter in flight
    gather: Any = None  # the all-gather in flight (overlap mode: until a module needs it)
    # Per-member per-parameter optimizer values (Adam's step) once they differ; see _shard_state.
    records: list[dict[str, Any] | None] | None = None

    def overlaps(self, member: Member) -> tuple[int, int, int] | None:
        """(offset in the shard, offset in the parameter, length) of `member`'s part in this shard."""
        end = self.start + self.shard.numel()
        lo, hi = max(member.offset, self.start), min(member.offset + member.numel, end)
        if lo >= hi:
            return None
        return lo - self.start, lo - member.offset, hi - lo


def plan(
    entries: list[tuple[torch.Tensor, str, int, int]], priorities: list[int], limit: int
) -> list[list[tuple[torch.Tensor, str, int, int]]]:
    """Cuts (param, label, index, group) entries, sorted by priority, into buckets of at most `limit` bytes.

    A bucket holds one group, dtype and device; `limit` 0 means no limit; a parameter bigger than
    `limit` gets a bucket of its own. Buckets are returned in the priority order of their first member.
    """
    done = _buckets.cut(
        entries, limit, lambda entry: (entry[3], entry[0].dtype, entry[0].device), lambda entry: entry[0]
    )
    return sorted(done, key=lambda members: (priorities[members[0][2]], members[0][2]))


def build(
    chosen: list[tuple[torch.Tensor, str, int, int]], name: str, priority: int, ranks: int, position: int
) -> ShardBucket:
    """One bucket over `chosen`, with this rank's shard filled from the parameters' current values."""
    members: list[Member] = []
    offset = 0
    for param, label, index, _ in chosen:
        members.append(Member(param, label, index, offset, param.numel()))
        offset += param.numel()
    part = -(-offset // ranks)
    first = chosen[0][0]
    shard = torch.zeros(part, dtype=first.dtype, device=first.device)
    bucket = ShardBucket(name, chosen[0][3], priority, members, part * ranks, part * position, shard)
    bucket.used = [False] * len(members)
    refresh(bucket)
    return bucket


@torch.no_grad()
def refresh(bucket: ShardBucket) -> None:
    """Copies the parameters' current values into this rank's shard (they may have been changed since)."""
    for member in bucket.members:
        where = bucket.overlaps(member)
        if where is not None:
            at, frm, length = where
            bucket.shard[at : at + length].copy_(member.param.detach().reshape(-1)[frm : frm + length])


@torch.no_grad()
def scatter_into(bucket: ShardBucket, full: torch.Tensor, only: set[int] | None = None) -> None:
    """Writes a gathered flat vector back into the members' parameters (`only`: these indices)."""
    full = full.reshape(-1)
    if full.device != bucket.shard.device:
        full = full.to(bucket.shard.device)
    for member in bucket.members:
        if only is None or member.index in only:
            member.param.copy_(full[member.offset : member.offset + member.numel].view_as(member.param))


def flat_gradient(bucket: ShardBucket, passes_seen: list[bool]) -> torch.Tensor:
    """The bucket's full flat gradient (zeros where a member has none), padded; frees each member's .grad.

    Only this rank's shard of the reduced gradient is kept (ZeRO-2), so the full per-parameter
    gradients are dropped as soon as they are in the bucket. One pass over the gradients (no zeroed
    buffer filled afterwards), and none for a bucket of one whole gradient: it is sent as it is.
    """
    first = bucket.members[0].param
    pieces = []
    for k, member in enumerate(bucket.members):
        grad = member.param.grad
        if grad is not None and passes_seen[k]:
            grad = grad.to_dense() if grad.is_sparse else grad
            pieces.append(grad.to(dtype=first.dtype).reshape(-1))
        else:
            pieces.append(torch.zeros(member.numel, dtype=first.dtype, device=first.device))
        member.param.grad = None
    padding = bucket.padded - sum(m.numel for m in bucket.members)
    if padding:
        pieces.append(torch.zeros(padding, dtype=first.dtype, device=first.device))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def shard_state(
    value: torch.Tensor, bucket: ShardBucket, member_state: list[torch.Tensor | None]
) -> torch.Tensor:
    """This rank's shard of a per-element state tensor, cut from each member's full-size state."""
    out = torch.zeros_like(bucket.shard, dtype=value.dtype)
    for member, full in zip(bucket.members, member_state):
        where = bucket.overlaps(member)
        if where is not None and full is not None:
            at, frm, length = where
            out[at : at + length].copy_(full.reshape(-1)[frm : frm + length].to(out.device))
    return out
