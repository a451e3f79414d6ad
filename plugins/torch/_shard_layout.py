"""The sharded optimizer's layout: flat per-dtype buckets cut into one contiguous shard per rank.

A bucket holds consecutive trainable parameters of one parameter group, dtype and device, in the
forward order every rank agreed on. Its flat length is padded to a multiple of the number of ranks,
so a reduce-scatter leaves every rank an equal part: rank r owns elements [r*k, (r+1)*k). The
padding stays zero in gradients and parameters, so it changes no norm and no update.

No bucket grows past the bucket limit (the partition by default): a parameter bigger than it is cut
into pieces of at most the limit, each a member of its own bucket, in consecutive buckets (as
Megatron-core's buckets and FSDP's flat parameters cut a big weight). The core partitions only
allreduces, so a whole 400 MB weight went as one reduce-scatter and one all-gather, and an urgent
gather waited behind it. A piece holds a multiple of the ranks' count of elements, so a bucket of
one piece needs no padding and goes as a view of the gradient, without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from commsched.torch import _buckets

import torch

Entry = tuple[torch.Tensor, str, int, int]  # (param, label, index, group)
Piece = tuple[torch.Tensor, str, int, int, int, int]  # an Entry and (start, numel) inside the parameter


@dataclass(eq=False)
class Split:
    """A parameter cut across `holders` buckets: its gradient is freed once each of them took its piece."""

    holders: int
    taken: int = 0


@dataclass(eq=False)
class Member:
    """A parameter, or a piece of one, inside a bucket: where its elements sit in the bucket's flat vector."""

    param: torch.Tensor
    label: str
    index: int  # position among the optimizer's parameters (group order)
    offset: int  # in the bucket's flat vector
    numel: int  # elements of this piece (the parameter's, when whole)
    start: int = 0  # where the piece begins in the parameter's flat elements
    split: Split | None = None  # set when the parameter is cut across buckets

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This member's elements of a tensor shaped like its parameter (a view when it is contiguous)."""
        return full.reshape(-1)[self.start : self.start + self.numel]


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
        return lo - self.start, lo - member.offset + member.start, hi - lo


def piece_elements(limit: int, element_size: int, ranks: int) -> int:
    """Elements in each piece of a parameter over `limit` bytes: at most `limit`, a multiple of `ranks`."""
    return max(ranks, limit // element_size // ranks * ranks)


def pieces(entries: list[Entry], limit: int, ranks: int) -> list[Piece]:
    """The entries with each parameter over `limit` bytes cut into pieces (`limit` 0: none is cut).

    A non-contiguous parameter stays whole: a piece of it would not be a view to write into.
    """
    cut: list[Piece] = []
    for param, label, index, group in entries:
        count = param.numel()
        if limit <= 0 or count * param.element_size() <= limit or not param.is_contiguous():
            cut.append((param, label, index, group, 0, count))
            continue
        step = piece_elements(limit, param.element_size(), ranks)
        cut += [(param, label, index, group, k, min(step, count - k)) for k in range(0, count, step)]
    return cut


def _span(entry: Entry | Piece) -> tuple[int, int]:
    return (entry[4], entry[5]) if len(entry) > 4 else (0, entry[0].numel())  # type: ignore[misc]


def plan(entries: list[Entry], priorities: list[int], limit: int, ranks: int = 0) -> list[list[Piece]]:
    """Cuts (param, label, index, group) entries, sorted by priority, into buckets of at most `limit` bytes.

    A bucket holds one group, dtype and device; `limit` 0 means no limit. With `ranks` > 0 a parameter
    bigger than `limit` is cut into pieces (see pieces()) in consecutive buckets; with 0 it gets a
    bucket of its own. Buckets are returned in the priority order of their first member.
    """
    done = _buckets.cut(
        pieces(entries, limit if ranks > 0 else 0, max(ranks, 1)),
        limit,
        lambda entry: (entry[3], entry[0].dtype, entry[0].device),
        lambda entry: torch.empty(entry[5], dtype=entry[0].dtype, device="meta"),
    )
    return sorted(done, key=lambda members: (priorities[members[0][2]], members[0][2], members[0][4]))


def build(
    chosen: list[Entry] | list[Piece], name: str, priority: int, ranks: int, position: int
) -> ShardBucket:
    """One bucket over `chosen` (entries or pieces), with this rank's shard filled from the parameters' values."""
    members: list[Member] = []
    offset = 0
    for entry in chosen:
        start, numel = _span(entry)
        members.append(Member(entry[0], entry[1], entry[2], offset, numel, start))
        offset += numel
    part = -(-offset // ranks)
    first = chosen[0][0]
    shard = torch.zeros(part, dtype=first.dtype, device=first.device)
    bucket = ShardBucket(name, chosen[0][3], priority, members, part * ranks, part * position, shard)
    bucket.used = [False] * len(members)
    refresh(bucket)
    return bucket


def link_pieces(buckets: list[ShardBucket]) -> dict[int, list[ShardBucket]]:
    """Each parameter's buckets by id (several for a parameter cut into pieces), marking its pieces' Split."""
    holding: dict[int, list[ShardBucket]] = {}
    members: dict[int, list[Member]] = {}
    for bucket in buckets:
        for member in bucket.members:
            holding.setdefault(id(member.param), []).append(bucket)
            members.setdefault(id(member.param), []).append(member)
    for found in members.values():
        split = Split(len(found)) if len(found) > 1 else None
        for member in found:
            member.split = split
    return holding


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
            values = full[member.offset : member.offset + member.numel]
            if member.split is None:
                member.param.copy_(values.view_as(member.param))
            else:  # a piece: the parameter is contiguous (pieces()), so its flat view writes through
                member.param.view(-1)[member.start : member.start + member.numel].copy_(values)


def flat_gradient(bucket: ShardBucket, passes_seen: list[bool]) -> torch.Tensor:
    """The bucket's full flat gradient (zeros where a member has none), padded; frees each member's .grad.

    Only this rank's shard of the reduced gradient is kept (ZeRO-2), so the full per-parameter
    gradients are dropped as soon as they are in the bucket (a cut one once every bucket holding a
    piece took it). One pass over the gradients (no zeroed buffer filled afterwards), and none for a
    bucket of one whole gradient or one piece of a contiguous one: it is sent as it is (a view).
    """
    first = bucket.members[0].param
    parts = []
    for k, member in enumerate(bucket.members):
        grad = member.param.grad
        if grad is not None and passes_seen[k]:
            grad = grad.to_dense() if grad.is_sparse else grad
            parts.append(member.piece(grad.to(dtype=first.dtype)))
        else:
            parts.append(torch.zeros(member.numel, dtype=first.dtype, device=first.device))
        split = member.split
        if split is not None:
            split.taken += 1
            if split.taken < split.holders:
                continue
            split.taken = 0
        member.param.grad = None
    padding = bucket.padded - sum(m.numel for m in bucket.members)
    if padding:
        parts.append(torch.zeros(padding, dtype=first.dtype, device=first.device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def place(into: dict[str, Any], key: str, member: Member, values: torch.Tensor) -> None:
    """Puts a member's flat `values` of state `key` into its parameter's plain (parameter-shaped) state."""
    if member.split is None:
        into[key] = values.view_as(member.param).clone()
        return
    whole = into.get(key)
    if whole is None:
        whole = into[key] = values.new_zeros(member.param.shape)
    whole.view(-1)[member.start : member.start + member.numel].copy_(values)


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
