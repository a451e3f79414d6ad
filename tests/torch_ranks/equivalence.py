"""Rank script: N ranks on shards must end with the weights of one process on the whole batch.

Runs under mpiexec (MPI transport) or torchrun (Gloo). Each configuration re-inits commsched
with its policy. Prints "PASS <config> <difference>" per configuration; any mismatch exits 1.
"""

from __future__ import annotations

import argparse
import copy
import sys

import commsched.torch as ct
import torch
import torch.nn.functional as F
from torch_common import FORWARD_ORDER, OPTIMIZERS, Net, data, max_difference, reference, shard, skips

import commsched

TOLERANCE = {None: 2e-5, "fp16": 2e-2, "bf16": 5e-2}


def train(
    model: torch.nn.Module,
    name: str,
    overlap: bool,
    iterations: int,
    passes: int,
    clip: float | None,
    compression: str | None,
) -> ct.DistributedOptimizer:
    """Trains `model` in place on this rank's shards."""
    rank, size = commsched.rank(), commsched.size()
    optimizer = ct.DistributedOptimizer(
        OPTIMIZERS[name](model.parameters()),
        model=model,
        overlap_forward=overlap,
        backward_passes_per_step=passes,
        compression=compression,
    )
    x, y = data(size)
    for it in range(iterations):
        optimizer.zero_grad()
        for p in range(passes):
            step = it * passes + p
            loss = F.cross_entropy(model(shard(x[step], rank), skips(rank, step)), shard(y[step], rank))
            (loss / passes).backward()
        if clip is not None:
            # Parameters that got no gradient on this rank get their reduced one only here.
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    optimizer.synchronize()
    return optimizer


def check_broadcast() -> None:
    """Different initial weights and optimizer state on each rank become rank 0's."""
    rank = commsched.rank()

    def build(seed: int, lr: float, stepped: bool) -> tuple[Net, torch.optim.Adam]:
        torch.manual_seed(seed)
        model = Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        if stepped:  # only the root has state; the others must receive it whole
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
        return model, optimizer

    model, optimizer = build(100 + rank, 0.01 * (rank + 1), rank == 0)
    expected, expected_optimizer = build(100, 0.01, True)  # rank 0's, computed locally
    ct.broadcast_parameters(model.state_dict(), root_rank=0)
    ct.broadcast_optimizer_state(optimizer, root_rank=0)
    assert max_difference(model, expected) == 0.0, "broadcast_parameters did not copy rank 0's weights"
    got, want = optimizer.state_dict(), expected_optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"], "hyper-parameters differ from rank 0's"
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), f"optimizer state {index}.{key} differs"
    total = ct.allreduce(torch.full((3,), float(rank)), op="sum")
    assert torch.equal(total, torch.full((3,), float(sum(range(commsched.size()))))), "allreduce sum is wrong"
    print(f"PASS broadcast rank={rank}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--policies", default="priority,fifo")
    parser.add_argument("--modes", default="barrier,overlap")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--extras", action="store_true", help="also accumulation, clipping, compression")
    parser.add_argument(
        "--broadcast", action="store_true", help="also broadcast of weights and optimizer state"
    )
    parser.add_argument(
        "--fake-gpu",
        metavar="LIBRARY",
        help="the CUDA path: CUDA-claiming parameters over commsched's NCCL transport on this fake library",
    )
    args = parser.parse_args()
    device = "auto"
    if args.fake_gpu:
        from fake_gpu import claim_cuda, route_through

        route_through(args.fake_gpu)
        device = "cuda"
    configs = [
        (policy, name, mode == "overlap", 1, None, None)
        for policy in args.policies.split(",")
        for name in args.optimizers.split(",")
        for mode in args.modes.split(",")
    ]
    if args.extras:
        configs += [
            ("priority", "sgd", False, 2, None, None),
            ("priority", "adam", True, 2, None, None),
            ("priority", "sgd", False, 1, 0.05, None),
            ("priority", "adamw", False, 1, None, "fp16"),
            ("priority", "sgd", True, 1, None, "bf16"),
        ]
    failed = 0
    for policy, name, overlap, passes, clip, compression in configs:
        # Small partitions and credit so several chunks and scheduling decisions happen even on a tiny model.
        commsched.init(policy=policy, partition_bytes=256, credit_bytes=1024, stall_timeout=10, device=device)
        size = commsched.size()
        torch.manual_seed(0)
        model = claim_cuda(Net()) if args.fake_gpu else Net()
        expected = reference(copy.deepcopy(model), OPTIMIZERS[name], size, args.iterations, passes, clip)
        optimizer = train(model, name, overlap, args.iterations, passes, clip, compression)
        priorities = optimizer.priorities()
        order = sorted(FORWARD_ORDER, key=priorities.__getitem__)
        # The skippable layer is reached last on ranks that skipped it in the recorded first pass.
        first_pass = FORWARD_ORDER[:2] + FORWARD_ORDER[4:] + FORWARD_ORDER[2:4]
        expected_order = first_pass if skips(commsched.rank(), 0) else FORWARD_ORDER
        difference = max_difference(model, expected)
        label = (
            f"{policy}/{name}/{'overlap' if overlap else 'barrier'}/passes={passes}/clip={clip}/{compression}"
        )
        if difference > TOLERANCE[compression] or order != expected_order:
            print(f"FAIL {label} difference={difference:.3g} order={order}", flush=True)
            failed += 1
        else:
            print(f"PASS {label} difference={difference:.3g}", flush=True)
        if args.broadcast:
            check_broadcast()
            args.broadcast = False
        commsched.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
