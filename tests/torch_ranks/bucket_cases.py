"""Gradient buckets under changes the first layout did not see, against one process on the whole batch.

Each case trains Net (a frozen layer, an unused one, one some ranks skip) for 8 iterations on every
rank's shard and compares with a plain optimizer trained on all shards in one process, which must
get the same weights:

  unfreeze   the frozen layer is unfrozen after iteration 3 (a parameter outside every bucket)
  freeze     the skippable layer is frozen after iteration 3 (bucket members that stop reporting)
  small      COMMSCHED_BUCKET_BYTES=256: many buckets, cut across parameters of several layers
  off        COMMSCHED_BUCKET_BYTES=0: every gradient alone, as in the first step
  sparse     a sparse embedding (densified in its bucket, handed back sparse), 2 passes per step

Prints PASS <case>/<mode> or FAIL <case>/<mode> with the difference, and the bucket count after training.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import commsched.torch as ct
import torch
import torch.nn.functional as F
from torch_common import Net, data, shard, skips

import commsched

ITERATIONS = 8
CHANGE_AT = 3


class SparseNet(torch.nn.Module):
    """An Embedding(sparse=True) feeding Net's layers: its gradient arrives sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 8, sparse=True)
        self.body = Net()

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        index = (x.abs() * 7).long().clamp(max=19)
        return self.body(self.embedding(index).mean(dim=1), skip)


def _change(case: str, model: torch.nn.Module, it: int) -> None:
    """The layout-changing event of each case, the same in the reference and on every rank."""
    if it != CHANGE_AT:
        return
    if case == "unfreeze":
        model.frozen.requires_grad_(True)
    elif case == "freeze":
        model.skip.requires_grad_(False)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return F.cross_entropy(model(shard(x[step], rank), skips(rank, step)), shard(y[step], rank))


def reference(case: str, model: torch.nn.Module, make: Callable, size: int, passes: int) -> torch.nn.Module:
    """One process over every rank's shard, plain optimizer: what averaging must reproduce."""
    model = copy.deepcopy(model)
    optimizer = make(model.parameters())
    x, y = data(size)
    for it in range(ITERATIONS):
        _change(case, model, it)
        optimizer.zero_grad()
        for p in range(passes):
            step = it * passes + p
            loss = sum(_loss(model, x, y, r, step) for r in range(size))
            (loss / (size * passes)).backward()
        optimizer.step()
    return model


def train(
    case: str, model: torch.nn.Module, make: Callable, overlap: bool, passes: int
) -> ct.DistributedOptimizer:
    """This rank's shard through DistributedOptimizer."""
    rank, size = commsched.rank(), commsched.size()
    optimizer = ct.DistributedOptimizer(
        make(model.parameters()), model=model, overlap_forward=overlap, backward_passes_per_step=passes
    )
    x, y = data(size)
    for it in range(ITERATIONS):
        _change(case, model, it)
        optimizer.zero_grad()
        for p in range(passes):
            step = it * passes + p
            (_loss(model, x, y, rank, step) / passes).backward()
        optimizer.step()
    optimizer.synchronize()
    return optimizer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="unfreeze,freeze,small,off,sparse")
    parser.add_argument("--modes", default="barrier,overlap")
    parser.add_argument(
        "--fake-gpu",
        metavar="LIBRARY",
        help="the CUDA path: CUDA-claiming parameters over commsched's NCCL transport on this fake library",
    )
    args = parser.parse_args()
    device = "auto"
    if args.fake_gpu:
        from fake_gpu import route_through

        route_through(args.fake_gpu)
        device = "cuda"
    failed = 0
    for case in args.cases.split(","):
        for mode in args.modes.split(","):
            overlap = mode == "overlap"
            if case == "small":
                os.environ["COMMSCHED_BUCKET_BYTES"] = "256"
            elif case == "off":
                os.environ["COMMSCHED_BUCKET_BYTES"] = "0"
            else:
                os.environ.pop("COMMSCHED_BUCKET_BYTES", None)
            commsched.init(stall_timeout=10, device=device)
            torch.manual_seed(0)
            sparse = case == "sparse"
            model: torch.nn.Module = SparseNet() if sparse else Net()
            if args.fake_gpu:
                from fake_gpu import claim_cuda

                model = claim_cuda(model)
            if sparse:
                make = lambda p: torch.optim.SGD(p, lr=0.1)  # SGD takes sparse gradients
                passes = 2
            else:
                make = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3)
                passes = 1
            expected = reference(case, model, make, commsched.size(), passes)
            optimizer = train(case, model, make, overlap, passes)
            difference = max(
                (p - q).abs().max().item() for p, q in zip(model.parameters(), expected.parameters())
            )
            buckets = len(optimizer.buckets())
            ok = difference < 2e-5 and (buckets == 0) == (case == "off")
            verdict = "PASS" if ok else "FAIL"
            print(f"{verdict} {case}/{mode} difference={difference:.3g} buckets={buckets}", flush=True)
            failed += not ok
            commsched.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
