"""One commit of a model and its optimizer in host memory, and how a restore reads it back.

A commit holds copies of what it covers: whole tensors by key, or, where ranks split the copying, each
rank's part in flat tensors per dtype (gathered by broadcasts, or in every rank's shared-memory file),
joined again only when restored.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from commsched.torch import elastic_shard, elastic_shm, elastic_split
from commsched.torch.checkpoint_read import Contents

import torch


class Version:
    """One commit: host tensors by key, the optimizer's non-tensor state and its param_groups.

    A sharded optimizer's commit holds, in `optimizer`, the per-parameter values (Adam's step) and
    the param_groups in plain form, its layout in `layout`, this rank's shards in one flat host
    tensor per dtype (`flats`, where each (bucket, key) sits is in `places`) and, once gathered,
    every rank's shards in `received` (by rank and dtype), or in `region`, the shared memory that holds
    every rank's flat tensors when all ranks share a host.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.model: dict[str, Any] = {}
        self.optimizer: dict[str, Any] = {}
        self.number = 0
        self.layout: dict[str, Any] | None = None
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.places: list[tuple[torch.dtype, int, str, int, int]] = []  # dtype, bucket, key, offset, numel
        self.received: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.region: elastic_shm.Region | None = None
        self.shared = False  # every rank's flats are in `region`, not in `received`
        self.gather_name = ""
        # Shared memory only: each rank's shard of the parameters, per bucket (dtype, bucket, offset,
        # length) in the flat tensors, and the model's entries rebuilt from them (name -> parameter index).
        self.params: list[tuple[torch.dtype, int, int, int]] = []
        self.covered: dict[str, int] = {}
        # Unsharded, every rank on one host: the tensors each rank copied 1/N of (elastic_split), the
        # rank count they were cut for, and the model's names of those parameters (name -> name cut as).
        self.splits: list[elastic_split.Split] = []
        self.split_ranks = 0
        self.aliases: dict[str, str] = {}
        # Where an unsharded commit's tensors go in this version's buffers, and the copies (elastic_plan.Plan):
        # kept while the model's and the optimizer's tensors stay the same.
        self.plan: Any = None

    def tensor(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The reused host tensor for `key`, reallocated only when its dtype or shape changed."""
        held = self.tensors.get(key)
        if held is None or held.dtype != like.dtype or held.shape != like.shape:
            pin = like.is_cuda and torch.cuda.is_available()
            held = self.tensors[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        return held

    def model_state(self) -> dict[str, Any]:
        """The model's state_dict: its parameters cut into shards joined again from every rank's shard."""
        if self.splits:
            model = dict(self.model)
            cut = [split for split in self.splits if split.model]
            elastic_split.fill_model(model, self.aliases, cut, self._joined(cut))
            return model
        if not self.covered:
            return self.model
        joined = self.parameters()
        return {**self.model, **{name: joined[index] for name, index in self.covered.items()}}

    def parameters(self) -> dict[int, torch.Tensor]:
        """The committed parameters rebuilt from every rank's shard of them, by parameter index."""
        assert self.layout is not None
        flats, ranks = self._flats(), self.layout["ranks"]
        whole = {
            k: torch.cat([flats[(r, dtype)][offset : offset + numel] for r in range(ranks)])
            for dtype, k, offset, numel in self.params
        }
        return elastic_shard.join_parameters(self.layout, whole, set(self.covered.values()))

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state_dict in plain per-parameter form (a sharded one's shards joined), a copy."""
        if self.layout is None:
            # A copy: load_state_dict keeps CPU tensors as given, and the next commits reuse these buffers.
            optimizer = copy.deepcopy(self.optimizer)
            cut = [split for split in self.splits if not split.model]
            if cut:
                elastic_split.fill_optimizer(optimizer, cut, self._joined(cut))
            return optimizer
        joined = Contents(
            step=self.number,
            verified=True,
            model={},
            optimizer_state=copy.deepcopy(self.optimizer["state"]),
            param_groups=copy.deepcopy(self.optimizer["param_groups"]),
            lr_scheduler=None,
            extra={},
            sharded=self.layout,
            shards=self.shards(),
        )
        return joined.plain_state()

    def shards(self) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        """Every rank's shards by (rank, bucket) and key: views of the gathered or shared flat tensors."""
        assert self.layout is not None
        flats, ranks = self._flats(), self.layout["ranks"]
        found: dict[tuple[int, int], dict[str, torch.Tensor]] = {
            (r, k): {} for r in range(ranks) for k in range(len(self.layout["buckets"]))
        }
        for dtype, k, key, offset, numel in self.places:
            for r in range(ranks):
                found[(r, k)][key] = flats[(r, dtype)][offset : offset + numel]
        return found

    def _joined(self, splits: list[elastic_split.Split]) -> list[torch.Tensor]:
        """Tensors of an unsharded commit cut over the ranks, joined from every rank's part."""
        return elastic_split.join(splits, self._flats(), self.split_ranks)

    def _flats(self) -> dict[tuple[int, torch.dtype], torch.Tensor]:
        """Every rank's flat tensors by (rank, dtype): mapped shared memory, or the gathered copies."""
        if self.shared and self.region is not None:
            return {(r, d): t for r, by in self.region.shards(self.number).items() for d, t in by.items()}
        return self.received


# How long a rank deciding about a commit waits for the parts that live ranks are still copying.
PEER_COPY_PATIENCE_S = 10.0


def complete_everywhere(version: Version, patience_s: float = PEER_COPY_PATIENCE_S) -> bool:
    """A commit in shared memory (cut over the ranks, or a sharded optimizer's shards) whose every
    part, a lost rank's too, was copied: it can be restored even though the wait for every rank's mark
    ended with commsched stopping (a rank died after copying its part).

    Each survivor decides when its own wait ends, and a survivor whose commit thread is behind
    may not have marked its part yet then: parts that ranks still running have started are waited
    for (up to patience_s), so every survivor finds the same answer. Rank 0's decides what the
    re-formed job restores; before, it could go back one commit more than the others while their copy
    was still under way."""
    if not version.shared or version.region is None:
        return False
    deadline = time.monotonic() + patience_s
    while True:
        try:
            version.region.shards(version.number)
            return True
        except RuntimeError:
            if time.monotonic() >= deadline or not version.region.copying(version.number):
                return False
        time.sleep(0.002)
