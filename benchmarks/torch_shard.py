#!/usr/bin/env python3
"""Sharded training at 2 ranks: ms per step and per-rank optimizer-state and gradient bytes, in one run.

Variants, each in its own processes (torchrun-style variables, Gloo under torch and commsched):
DDP with Adam; ZeroRedundancyOptimizer (ZeRO-1) over DDP; commsched DistributedOptimizer with
overlap_forward; commsched shard=True with overlap_forward. The model is a stack of
Linear(width, width) layers trained with Adam on random data.

    python benchmarks/torch_shard.py                         # table, JSON to torch_shard.json
    python benchmarks/torch_shard.py --layers 8 --width 256 --json out.json

Bytes are what a rank holds after a step: gradients (.grad of the model's parameters, and the
reduced shards of shard=True) and optimizer-state tensors (Adam's moments; step counters left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from local_ranks import run_ranks  # beside this file: the script's folder is on sys.path

RESULT_TAG = "SHARD_RESULT "
VARIANTS = {
    "ddp": "PyTorch DDP, Adam",
    "zero": "ZeroRedundancyOptimizer over DDP",
    "overlap": "commsched overlap_forward",
    "shard": "commsched shard=True, overlap_forward",
}


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.dim() > 0)


def worker(variant: str, args: argparse.Namespace) -> None:
    """Runs inside a rank: trains, then (rank 0) prints step times and bytes held."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    net: Any = model
    finish = None
    inner: Any = None
    if variant in ("ddp", "zero"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        net = torch.nn.parallel.DistributedDataParallel(model)
        if variant == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer: Any = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
            )
            inner = optimizer.optim
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            inner = optimizer
    else:
        import commsched.torch as ct

        import commsched

        commsched.init(transport="gloo")
        rank = commsched.rank()
        optimizer = ct.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3),
            model=model,
            overlap_forward=True,
            shard=variant == "shard",
        )
        inner = optimizer.optimizer
        finish = optimizer.synchronize
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1 + rank))

    def one_step() -> None:
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()

    for _ in range(args.warmup):
        one_step()
    per_window = []
    for _ in range(args.windows):
        if finish is not None:
            finish()
        started = time.perf_counter()
        for _ in range(args.steps):
            one_step()
        if finish is not None:
            finish()
        per_window.append((time.perf_counter() - started) / args.steps)
    # Gradients held between backward and step: measured after one more backward.
    if finish is None:
        optimizer.zero_grad()
    net(x).square().mean().backward()
    if finish is not None:
        finish()
    grads = _bytes(p.grad for p in model.parameters())
    if variant == "shard":
        grads += _bytes(p.grad for g in inner.param_groups for p in g["params"])
    state = _bytes(v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    if rank == 0:
        result = {
            "variant": variant,
            "window_step_seconds": per_window,
            "grad_bytes": grads,
            "state_bytes": state,
        }
        print(RESULT_TAG + json.dumps(result), flush=True)
    if variant in ("ddp", "zero"):
        import torch.distributed as dist

        dist.barrier()
        sys.stdout.flush()
        os._exit(0)  # DDP's teardown can deadlock in torch's Gloo group; the result is out
    import commsched

    commsched.shutdown()


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Starts the ranks of one variant and returns rank 0's result."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant]
    for option in ("layers", "width", "batch", "warmup", "windows", "steps"):
        argv += [f"--{option}", str(getattr(args, option))]
    return run_ranks(argv, args.ranks, args.timeout, RESULT_TAG, variant)


def main() -> int:
    """Runs every variant, prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per variant")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers in the model")
    parser.add_argument("--width", type=int, default=256, help="width of each layer")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (the median is reported)")
    parser.add_argument("--steps", type=int, default=10, help="steps per window")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a variant may take")
    parser.add_argument("--json", default="torch_shard.json", help="where the results go")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return 0
    results = [run_variant(variant, args) for variant in VARIANTS]
    print(f"{args.ranks} ranks, {args.layers} x Linear({args.width}, {args.width}), Adam, batch {args.batch}")
    print(f"{'variant':40} {'ms/step':>8} {'range':>13} {'grad KiB':>9} {'state KiB':>10}")
    for result in results:
        ms = [s * 1000 for s in result["window_step_seconds"]]
        result["ms_per_step"] = statistics.median(ms)
        print(
            f"{VARIANTS[result['variant']]:40} {result['ms_per_step']:8.2f} {min(ms):6.2f}-{max(ms):6.2f} "
            f"{result['grad_bytes'] / 1024:9.0f} {result['state_bytes'] / 1024:10.0f}"
        )
    Path(args.json).write_text(json.dumps({"arguments": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
