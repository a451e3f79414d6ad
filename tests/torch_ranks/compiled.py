"""Rank script: a torch.compile'd Net trained on N ranks' shards through commsched ends with the weights
of one eager process trained on the whole batch (torch_common.reference).

Runs under torchrun (Gloo) or mpiexec. Prints "PASS compiled/<mode> difference=..." per mode; any
mismatch exits 1.
"""

from __future__ import annotations

import argparse
import copy
import sys

import commsched.torch as ct
import torch
import torch.nn.functional as F
from torch_common import OPTIMIZERS, Net, data, max_difference, reference, shard, skips

import commsched

TOLERANCE = 2e-5


def main() -> int:
    """Trains one compiled model per mode and compares it with the eager reference."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="barrier")
    parser.add_argument("--iterations", type=int, default=6)
    # aot_eager runs Dynamo and AOTAutograd, where hooks and graph capture meet commsched, with eager
    # kernels; inductor would add a C++ build per rank (half a minute each on two shared cores).
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    failed = 0
    for mode in args.modes.split(","):
        # Small partitions and credit: several buckets, chunks and scheduling decisions on a tiny model.
        commsched.init(partition_bytes=256, credit_bytes=1024, stall_timeout=10)
        rank, size = commsched.rank(), commsched.size()
        torch.manual_seed(0)
        model = Net()
        expected = reference(copy.deepcopy(model), OPTIMIZERS["sgd"], size, args.iterations)
        compiled = torch.compile(model, backend=args.backend)
        optimizer = ct.DistributedOptimizer(
            OPTIMIZERS["sgd"](model.parameters()), model=model, overlap_forward=mode == "overlap"
        )
        x, y = data(size)
        for it in range(args.iterations):
            optimizer.zero_grad()
            loss = F.cross_entropy(compiled(shard(x[it], rank), skips(rank, it)), shard(y[it], rank))
            loss.backward()
            optimizer.step()
        optimizer.synchronize()
        difference = max_difference(model, expected)
        buckets = len(optimizer.buckets())
        verdict = "PASS" if difference <= TOLERANCE and buckets else "FAIL"
        failed += verdict == "FAIL"
        print(f"{verdict} compiled/{mode} difference={difference:.3g} buckets={buckets}", flush=True)
        commsched.shutdown()
        torch._dynamo.reset()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
