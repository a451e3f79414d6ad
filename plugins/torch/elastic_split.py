"""Unsharded commits on one host: each rank copies only its 1/N of the replicated tensors.

Data-parallel ranks hold the same parameters and the same optimizer state, so a commit in which
every rank copies all of them copies the same bytes N times, on cores the training needs. Where
every rank runs on one host, each rank copies its 1/N of every parameter and of every optimizer
state tensor shaped like it into its shared-memory file (elastic_shm, as a sharded commit does),
and a restore joins each tensor from every rank's part, a lost rank's too (its file stays mapped).
Each rank reserves the same number of elements per tensor (the last rank's part may be shorter),
so every rank's file has the same layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Split:
    """One tensor cut over the ranks: where each rank's part sits in its flat tensor of `dtype`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in every rank's flat tensor of this dtype
    model: str  # the parameter's name in the model's state_dict ("" for an optimizer state tensor)
    index: int  # the parameter's index in the optimizer's groups
    name: str  # the optimizer state's name ("" for the parameter itself)

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)


def part(numel: int, ranks: int, rank: int) -> tuple[int, int]:
    """Where `rank`'s part of a tensor of `numel` elements starts, and its length (maybe 0)."""
    per = reserved(numel, ranks)
    start = min(numel, rank * per)
    return start, min(numel, start + per) - start


def reserved(numel: int, ranks: int) -> int:
    """Elements every rank reserves for its part of a tensor of `numel` elements."""
    return -(-numel // ranks)


def plan(
    model_state: dict[str, Any], params: list[torch.Tensor], state: Any, ranks: int
) -> tuple[list[Split], dict[torch.dtype, int]]:
    """The tensors to cut (the optimizer's host parameters `params`, in its groups' order, that the
    model's state_dict(keep_vars=True) holds, and their tensors in the optimizer's `state` of the same
    shape) and each dtype's elements per rank. The rest is copied whole on every rank."""
    names = {id(t): name for name, t in model_state.items() if isinstance(t, torch.Tensor)}
    totals: dict[torch.dtype, int] = {}
    splits: list[Split] = []

    def add(tensor: torch.Tensor, model_name: str, index: int, name: str) -> None:
        offset = totals.get(tensor.dtype, 0)
        splits.append(Split(tensor.dtype, tuple(tensor.shape), offset, model_name, index, name))
        totals[tensor.dtype] = offset + reserved(tensor.numel(), ranks)

    for index, param in enumerate(params):
        if not _cuttable(param, ranks):
            continue
        name = names.get(id(param))
        if name is not None:
            add(param, name, index, "")
        for key, value in state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and _cuttable(value, ranks) and value.shape == param.shape:
                add(value, "", index, key)
    return splits, totals


def _cuttable(tensor: torch.Tensor, ranks: int) -> bool:
    """A plain host tensor with an element for every rank (smaller ones are copied whole)."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not (tensor.is_conj() or tensor.is_neg())
        and tensor.numel() >= ranks
    )


def join(
    splits: list[Split], flats: dict[tuple[int, torch.dtype], torch.Tensor], ranks: int
) -> list[torch.Tensor]:
    """Every cut tensor joined from every rank's part (new tensors, in the order of `splits`)."""
    joined = []
    for split in splits:
        whole = torch.empty(split.shape, dtype=split.dtype)
        view = whole.view(-1)
        for rank in range(ranks):
            start, length = part(split.numel, ranks, rank)
            if length:
                view[start : start + length].copy_(
                    flats[(rank, split.dtype)][split.offset : split.offset + length]
                )
        joined.append(whole)
    return joined


def fill_model(
    model: dict[str, Any], aliases: dict[str, str], splits: list[Split], tensors: list[torch.Tensor]
) -> None:
    """Puts the joined parameters into a model state_dict, in place, under every name in `aliases`
    (name -> the name it was cut under)."""
    by_name = {split.model: tensor for split, tensor in zip(splits, tensors, strict=True) if split.model}
    for name, cut_as in aliases.items():
        model[name] = by_name[cut_as]


def fill_optimizer(optimizer: dict[str, Any], splits: list[Split], tensors: list[torch.Tensor]) -> None:
    """Puts the joined state tensors into a plain optimizer state_dict, in place."""
    for split, tensor in zip(splits, tensors, strict=True):
        if not split.model:
            optimizer["state"].setdefault(split.index, {})[split.name] = tensor
