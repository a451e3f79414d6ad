"""DistributedOptimizer(shard=True) across a re-forming: its shards belong to one rank count.

Each rank owns a shard of every bucket, cut for the ranks of the generation that laid the buckets
out, and a lost rank takes its shard with it. So a commit gathers every rank's shard in the
background (elastic_commit), and after a failure each survivor joins the committed shards into the
plain per-parameter form (checkpoint_read.Contents.plain_state), takes the optimizer back to before
its layout (``unbuild``) and loads that form; the next forward (or, without ``model=``, the first
gradient) lays the buckets out again at the new rank count and cuts the state into new shards, as
a freshly built sharded optimizer does with a state loaded before its first forward.

A worker that joins lays its buckets out at that same moment, never at construction: without
``model=`` a sharded optimizer lays them out as it is built (a collective), which in a joiner would
wait for the others while they wait for it in the state sync.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any

from commsched.torch._order import ForwardOrder

import commsched
import torch
from commsched import _horovod
from commsched.elastic.membership import GENERATION_VARIABLE, ID_VARIABLE

# A parameter's part of a shard: the parameter, the offset in the shard, the offset in the
# parameter (flattened) and the length.
Slice = tuple[torch.Tensor, int, int, int]


def usable(optimizer: Any) -> bool:
    """True when a sharded optimizer shards over every rank (a process set's shards cannot re-form)."""
    how = getattr(optimizer, "_how", None)
    return how is not None and _horovod.is_global(how.process_set)


def joining() -> bool:
    """True in a worker started to join a running elastic job (commsched-run --max-np grew it)."""
    return int(os.environ.get(GENERATION_VARIABLE, "0") or 0) > 0


def lays_out_late() -> bool:
    """True where shard=True without model= lays its buckets out at the first gradient, not in its
    constructor: in a joining worker (the others lay theirs out again after the state sync), and in
    any rank commsched-run started for elastic training or torchrun's ranks can re-form in (the
    core recorded the worker group as it started), so the layout's collective runs inside
    elastic.run, where a rank lost meanwhile costs a re-forming, not the job."""
    from commsched.elastic import torchrun

    return joining() or bool(os.environ.get(ID_VARIABLE)) or bool(torchrun.active() and torchrun.job().prefix)


def built(optimizer: Any) -> bool:
    """True once the buckets are laid out (the state is then this rank's shards)."""
    return bool(getattr(optimizer, "_built", False))


def unbuild(optimizer: Any) -> None:
    """Takes a sharded optimizer back to before its layout: no buckets, no reductions or gathers in
    flight (they belong to a generation that failed), no state, the wrapped optimizer over the
    parameters again. Its next forward, or first gradient, lays the buckets out afresh."""
    if optimizer._waits is not None:
        optimizer._waits.remove()
        optimizer._waits = None
    if optimizer._recorder is not None:
        optimizer._recorder.remove()
    if optimizer._model is not None:  # the order is measured again, as at the first forward
        optimizer._recorder = ForwardOrder(optimizer._model, optimizer._on_forward_order)
    inner = optimizer._inner
    for group, params in zip(inner.param_groups, optimizer._original_groups, strict=True):
        group["params"] = list(params)
    inner.state = defaultdict(dict)
    optimizer._buckets = []
    optimizer._where = {}
    optimizer._built = False
    optimizer._seen = [0] * len(optimizer._labelled)
    optimizer._open = optimizer._reduced = optimizer._synchronized = False
    optimizer._counts = None
    optimizer._unused = set()
    optimizer._deferred = None
    # A rank that joins numbers its layouts from 0: the survivors' next layout must have its name.
    optimizer._layouts = 0
    for _, param in optimizer._labelled:
        param.grad = None  # may be a guard of a reduction that will never finish


def adopt_ranks(optimizer: Any) -> None:
    """Takes the rank count and position of the generation commsched runs now (after a re-forming)."""
    how = optimizer._how
    how.settle()
    optimizer._ranks = int(how.ranks or commsched.size())
    optimizer._member = True
    optimizer._position = commsched.rank()


def parameter_slices(optimizer: Any, layout: dict[str, Any]) -> list[tuple[torch.Tensor, int, list[Slice]]]:
    """Per bucket: its first member's parameter, the length of this rank's shard and where each part of
    that shard comes from, for the parameters `covered` finds in `layout`.

    After an update's all-gather every rank holds the same parameters, so each rank's shard of them
    is enough to rebuild every parameter from all ranks' shards.
    """
    wanted = covered(layout)
    found = []
    for bucket in optimizer._buckets:
        parts = []
        for member in bucket.members:
            where = bucket.overlaps(member)
            if member.index in wanted and where is not None:
                parts.append((member.param, *where))
        found.append((bucket.members[0].param, bucket.shard.numel(), parts))
    return found


def covered(layout: dict[str, Any]) -> set[int]:
    """The indices of the parameters whose elements the buckets of `layout` hold, every one of them."""
    held: dict[int, int] = {}
    size: dict[int, int] = {}
    for bucket in layout["buckets"]:
        for member in bucket["members"]:
            held[member["index"]] = held.get(member["index"], 0) + member["numel"]
            size[member["index"]] = math.prod(member["shape"])
    return {index for index, count in held.items() if count == size[index]}


def join_parameters(
    layout: dict[str, Any], whole: dict[int, torch.Tensor], wanted: set[int]
) -> dict[int, torch.Tensor]:
    """The parameters in `wanted` (by index) from each bucket's whole flat vector (`whole`, by bucket)."""
    found: dict[int, torch.Tensor] = {}
    for k, flat in whole.items():
        for member in layout["buckets"][k]["members"]:
            index = member["index"]
            if index not in wanted:
                continue
            joined = found.get(index)
            if joined is None:
                joined = found[index] = flat.new_empty(member["shape"])
            start, offset, numel = member.get("start", 0), member["offset"], member["numel"]
            joined.view(-1)[start : start + numel].copy_(flat[offset : offset + numel])
    return found
