"""A tiny model and a reference trainer shared by the torch plug-in tests.

The reference is one process training on the whole batch: it sums every rank's shard
loss (each with that rank's own layer-skipping decision) and divides by the rank count,
which is exactly what averaging per-rank gradients must reproduce.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

FEATURES, CLASSES, PER_RANK = 8, 3, 4


class Net(torch.nn.Module):
    """Declared out of forward order, with a frozen layer, an unused one and a skippable one."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, CLASSES)
        self.embed = torch.nn.Linear(FEATURES, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.skip = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Linear(16, 4)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.frozen(h))
        if not skip:
            h = h + torch.tanh(self.skip(h))
        return self.head(h) * self.scale


FORWARD_ORDER = ["embed.weight", "embed.bias", "skip.weight", "skip.bias", "head.weight", "head.bias"]


def skips(rank: int, iteration: int) -> bool:
    """Every 4th iteration no rank runs the skippable layer; otherwise ranks alternate."""
    return iteration % 4 == 3 or (iteration + rank) % 2 == 0


def data(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of PER_RANK samples per rank, per iteration."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, size * PER_RANK, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (16, size * PER_RANK), generator=generator)
    return x, y


def shard(batch: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's slice of a global batch."""
    return batch[rank * PER_RANK : (rank + 1) * PER_RANK]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


def reference(
    model: torch.nn.Module,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    size: int,
    iterations: int,
    passes: int = 1,
    clip: float | None = None,
) -> torch.nn.Module:
    """Trains a copy of `model` in one process on every rank's shard; returns it."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    x, y = data(size)
    for it in range(iterations):
        optimizer.zero_grad()
        for p in range(passes):
            step = it * passes + p
            loss = sum(
                F.cross_entropy(model(shard(x[step], r), skips(r, step)), shard(y[step], r))
                for r in range(size)
            )
            (loss / (size * passes)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest absolute difference between the two models' parameters."""
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
