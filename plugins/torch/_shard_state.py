"""Per-parameter optimizer state of the sharded optimizer: flat shard tensors plus per-member scalars.

The wrapped optimizer steps one flat shard per bucket, so its per-element state (momentum, Adam's
moments) is one flat tensor per bucket. What is one value per parameter (Adam's `step`, ASGD's
`eta`) must still count each parameter's own updates, as a plain optimizer's does: a parameter that
no rank used in an iteration is skipped there (its `step` stays), and one never updated has no state
at all. While every member of a bucket has the same such values the bucket's own state carries them
(the usual case, no extra work). Once they differ, the bucket keeps a record per member
(`ShardBucket.records`, members of equal history share one record object) and its update runs on
views of the shard, one per run of consecutive members with the same record, each with that
record's values, so every parameter sees exactly the update a plain optimizer gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from commsched.torch._shard_layout import ShardBucket

import torch

Record = dict[str, Any] | None  # a member's per-parameter values; None: no state (never updated)


def per_element(value: Any, length: int) -> bool:
    """True for a state tensor with one value per element of a flat tensor of `length` elements."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == length


def scalars(state: dict[str, Any], length: int) -> dict[str, Any]:
    """The per-parameter values of a flat tensor's state (everything but the per-element tensors)."""
    return {k: v for k, v in state.items() if not per_element(v, length)}


def same(a: Record, b: Record) -> bool:
    """True when two records hold equal values (tensors equal in dtype and value)."""
    if a is b:
        return True
    if a is None or b is None or a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and torch.equal(x.cpu(), y.cpu())
            ):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def copy_record(record: Record) -> Record:
    if record is None:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in record.items()}


def settle_records(bucket: ShardBucket, state: dict[str, Any], records: list[Record]) -> None:
    """Keeps `records` on the bucket, or folds them into the bucket's state when they are all equal."""
    shared: list[Record] = []
    for record in records:  # equal neighbours share one object, so they step as one view
        shared.append(shared[-1] if shared and same(shared[-1], record) else record)
    first = shared[0] if shared else None
    if all(record is first for record in shared) and (first is not None or not state):
        if first is not None:
            state.update(first)
        bucket.records = None
    else:
        bucket.records = shared


def record_of(bucket: ShardBucket, state: dict[str, Any], k: int) -> Record:
    """Member k's per-parameter values (None: the member has no state)."""
    if bucket.records is not None:
        return bucket.records[k]
    return scalars(state, bucket.shard.numel()) if state else None


def has_record(bucket: ShardBucket, state: dict[str, Any], k: int) -> bool:
    """True when member k has state (record_of is not None), without building its values."""
    return bucket.records[k] is not None if bucket.records is not None else bool(state)


def cut(
    bucket: ShardBucket, states: list[dict[str, Any]], shard_state: Callable[..., torch.Tensor]
) -> dict[str, Any]:
    """The shard's state cut from each member's plain (per-parameter) state; sets the bucket's records."""
    cut_state: dict[str, Any] = {}
    wholes: list[dict[str, torch.Tensor]] = []
    records: list[Record] = []
    for member, state in zip(bucket.members, states):
        size = member.param.numel()  # a piece's state is cut from its whole parameter's
        whole = {k: v for k, v in state.items() if _tensor(v) and v.dim() > 0 and v.numel() == size}
        wholes.append(whole)
        records.append({k: v for k, v in state.items() if k not in whole} if state else None)
    for key in sorted({key for whole in wholes for key in whole}):
        tensors = [whole.get(key) for whole in wholes]
        example = next(v for v in tensors if v is not None)
        cut_state[key] = shard_state(example, bucket, tensors)
    first = next((r for r in records if r is not None), None)
    cut_state.update(copy_record(first) or {})
    settle_records(bucket, cut_state, [copy_record(r) for r in records])
    return cut_state


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


@dataclass(eq=False)
class _Run:
    """Consecutive used members of one bucket with one shared record, stepped as one view."""

    bucket: ShardBucket
    members: list[int]
    record: Record
    view: torch.Tensor
    start: int
    stop: int


def _runs(bucket: ShardBucket, unused: set[int]) -> list[_Run]:
    runs: list[_Run] = []
    records = bucket.records
    assert records is not None
    last = -2
    for k, member in enumerate(bucket.members):
        if member.index in unused:
            continue
        if runs and last == k - 1 and runs[-1].record is records[k]:
            runs[-1].members.append(k)
        else:
            runs.append(_Run(bucket, [k], records[k], bucket.shard, 0, 0))
        last = k
    for run in runs:
        spans = [bucket.overlaps(bucket.members[k]) for k in run.members]
        spans = [s for s in spans if s is not None]
        if spans:
            run.start, run.stop = spans[0][0], spans[-1][0] + spans[-1][2]
        run.view = bucket.shard.detach()[run.start : run.stop]
    return runs


def irregular(bucket: ShardBucket, unused: set[int]) -> bool:
    """True when the bucket cannot step as one tensor: its members' values differ, or some is unused."""
    return bucket.records is not None or bool(unused and any(m.index in unused for m in bucket.members))


@torch.no_grad()
def update(
    inner: torch.optim.Optimizer, buckets: list[ShardBucket], unused: set[int], step: Callable[[], Any]
) -> None:
    """Runs step() (the wrapped optimizer's) so each member gets its own per-parameter update.

    Buckets whose members share their values step whole; the others step as views, one per run of
    members with one record, and members no rank used are left out, untouched, as a plain optimizer
    leaves a parameter without a gradient.
    """
    odd = [b for b in buckets if irregular(b, unused)]
    if not odd:
        step()
        return
    groups = [list(group["params"]) for group in inner.param_groups]
    runs: dict[int, list[_Run]] = {}
    for bucket in odd:
        state = inner.state.get(bucket.shard) or {}
        if bucket.records is None:
            record = scalars(state, bucket.shard.numel()) if state else None
            bucket.records = [record] * len(bucket.members)
        runs[id(bucket.shard)] = _runs(bucket, unused)
    for run in (r for rs in runs.values() for r in rs):
        shard = run.bucket.shard
        if shard.grad is not None:
            run.view.grad = shard.grad[run.start : run.stop]
        if run.record is not None:
            state = inner.state.get(shard) or {}
            length = shard.numel()
            views = {k: v[run.start : run.stop] for k, v in state.items() if per_element(v, length)}
            inner.state[run.view] = {**views, **(copy_record(run.record) or {})}
    for group, params in zip(inner.param_groups, groups):
        group["params"] = [
            v for p in params for v in ([r.view for r in runs[id(p)]] if id(p) in runs else [p])
        ]
    try:
        step()
    finally:
        for group, params in zip(inner.param_groups, groups):
            group["params"] = params
        for bucket in odd:
            _take_back(inner, bucket, runs[id(bucket.shard)])


def _take_back(inner: torch.optim.Optimizer, bucket: ShardBucket, runs: list[_Run]) -> None:
    """Moves the views' state into the bucket's: per-element parts in place, the rest into records."""
    shard = bucket.shard
    state = inner.state.get(shard)
    if state is None:
        state = {}
    records = list(bucket.records or [])
    for run in runs:
        view_state = inner.state.pop(run.view, None) or {}
        run.view.grad = None
        record: dict[str, Any] = {}
        for key, value in view_state.items():
            if per_element(value, run.view.numel()):
                target = state.get(key)
                if target is None:
                    target = state[key] = torch.zeros_like(shard, dtype=value.dtype)
                part = target[run.start : run.stop]
                if part.numel() and part.data_ptr() != value.data_ptr():
                    part.copy_(value)
            else:
                record[key] = value
        for k in run.members:
            records[k] = record if view_state else records[k]
    if state:
        inner.state[shard] = state
    settle_records(bucket, state, records)


# -- checkpoints: the layout as JSON, this rank's tensors, and loading them back ----------------
def layout_json(buckets: list[ShardBucket], inner: torch.optim.Optimizer, ranks: int) -> dict[str, Any]:
    """The buckets' members (index, offset, size, start in the parameter, shape, has state) and the rank count."""
    result = []
    for bucket in buckets:
        state = inner.state.get(bucket.shard, {})
        members = [
            {
                "index": m.index,
                "offset": m.offset,
                "numel": m.numel,
                "start": m.start,
                "shape": list(m.param.shape),
                "state": has_record(bucket, state, k),
            }
            for k, m in enumerate(bucket.members)
        ]
        result.append({"group": bucket.group, "padded": bucket.padded, "members": members})
    return {"ranks": ranks, "buckets": result}


def layout_key(layout: dict[str, Any]) -> Any:
    """What must match for a saved shard to load as it is: the rank count and each bucket's members."""
    return (
        layout["ranks"],
        [
            (
                b["group"],
                b["padded"],
                [(m["index"], m["offset"], m["numel"], m.get("start", 0)) for m in b["members"]],
            )
            for b in layout["buckets"]
        ],
    )


def shard_tensors(buckets: list[ShardBucket], inner: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Per bucket, this rank's per-element state tensors by key."""
    result = []
    for bucket in buckets:
        state = inner.state.get(bucket.shard, {})
        length = bucket.shard.numel()
        result.append({k: v for k, v in sorted(state.items()) if per_element(v, length)})
    return result


def member_values(buckets: list[ShardBucket], inner: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Each member's per-parameter values by parameter index; members without state are left out."""
    values: dict[int, dict[str, Any]] = {}
    for bucket in buckets:
        state = inner.state.get(bucket.shard, {})
        if bucket.records is None:  # the bucket's own state carries every member's values: read them once
            shared = scalars(state, bucket.shard.numel()) if state else None
            if shared is not None:
                values.update((member.index, dict(shared)) for member in bucket.members)
            continue
        for k, member in enumerate(bucket.members):
            record = bucket.records[k]
            if record is not None:
                values[member.index] = record
    return values


def install(
    buckets: list[ShardBucket],
    inner: torch.optim.Optimizer,
    layout: dict[str, Any],
    tensors: list[dict[str, torch.Tensor]],
    values: dict[int, dict[str, Any]],
) -> bool:
    """Sets each bucket's state from this rank's saved tensors and the members' values; False on a mismatch."""
    if len(tensors) != len(buckets) or any(
        t.shape != b.shard.shape for b, saved in zip(buckets, tensors) for t in saved.values()
    ):
        return False
    for bucket, saved, spec in zip(buckets, tensors, layout["buckets"]):
        # Copies: the pieces of one parameter in other buckets must not step the same `step` tensor.
        records: list[Record] = [
            copy_record(values.get(m["index"], {})) if m["state"] else None for m in spec["members"]
        ]
        first = next((r for r in records if r is not None), None)
        state: dict[str, Any] = {k: t.to(bucket.shard.device).clone() for k, t in saved.items()}
        state.update(copy_record(first) or {})
        settle_records(bucket, state, records)
        if state:
            inner.state[bucket.shard] = state
        else:
            inner.state.pop(bucket.shard, None)
    return True
