#!/usr/bin/env python3
"""VGG-style training on 2 ranks over a shaped link: PyTorch DDP against commsched's modes.

The model has small convolutions first and big fully connected layers last, so backward
produces the big gradients first while the next forward needs the small ones first; the
link rate is chosen so that one iteration's allreduce takes about as long as its compute.
All variants run in one invocation on the same rig (Gloo underneath every one of them):

    python benchmarks/torch_vgg.py                    # table on stdout, JSON to torch_vgg.json
    python benchmarks/torch_vgg.py --rate 2gbit --iterations 20 --json out.json

Needs root (network namespaces and tc); see benchmarks/netrig.py.
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

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
RESULT_TAG = "TORCH_VGG_RESULT "
VARIANTS = {
    "ddp": "PyTorch DDP (gloo, 25 MiB buckets)",
    "fifo": "commsched fifo, barrier",
    "priority": "commsched priority, barrier",
    "overlap": "commsched priority, overlap_forward",
}


def vgg(image: int = 32, classes: int = 10) -> torch.nn.Sequential:
    """Three 3x3 convolutions, then 4096->1024->1024->classes fully connected layers (~20 MiB)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (image // 4) ** 2, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, classes),
    )


def _batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 32, 32, generator=generator), torch.randint(
        0, 10, (batch,), generator=generator
    )


def calibrate(batch: int, repeats: int = 6) -> tuple[float, int]:
    """(median forward+backward+step seconds on one thread, gradient bytes) for one rank's batch."""
    torch.set_num_threads(1)
    model = vgg()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = _batch(batch)
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return statistics.median(times[2:]), nbytes


# -- one rank -------------------------------------------------------------------------------
def worker(variant: str, batch: int, warmup: int, iterations: int) -> None:
    """Runs inside a rank: trains `iterations` steps and rank 0 prints the timing as JSON."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    torch.manual_seed(0)
    model = vgg()
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if variant == "ddp":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)

        def finish() -> None:
            return None

    else:
        import commsched.torch as ct

        import commsched

        commsched.init(transport="gloo", policy="fifo" if variant == "fifo" else "priority")
        rank = commsched.rank()
        net = model
        optimizer = ct.DistributedOptimizer(optimizer, model=model, overlap_forward=variant == "overlap")
        finish = optimizer.synchronize
    x, y = _batch(batch)
    times = []
    for it in range(warmup + iterations):
        if it == warmup:
            finish()
            started = time.perf_counter()
        step_started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - step_started)
    finish()  # overlap mode: the last updates are part of the work
    elapsed = time.perf_counter() - started
    if rank == 0:
        result = {
            "variant": variant,
            "seconds_per_iteration": elapsed / iterations,
            "step_times": times[warmup:],
        }
        print(RESULT_TAG + json.dumps(result), flush=True)
    if variant == "ddp":
        dist.destroy_process_group()
    else:
        commsched.shutdown()


# -- the driver -----------------------------------------------------------------------------
def _run_variant(rig: Any, variant: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant]
    argv += ["--batch", str(args.batch), "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
    env = {
        "OMP_NUM_THREADS": "1",
        "COMMSCHED_PARTITION_BYTES": args.partition,
        "COMMSCHED_CREDIT_BYTES": args.credit,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    from local_ranks import run_on_rig  # benchmarks/ is on sys.path once main() ran

    return run_on_rig(rig, argv, env, port, args.timeout, RESULT_TAG, variant)


def main(argv: list[str] | None = None) -> int:
    """Runs every variant on one rig, prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per iteration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument(
        "--rate", default="auto", help='link rate ("1gbit"), or "auto": communication = compute'
    )
    parser.add_argument(
        "--partition", default="2MiB", help="COMMSCHED_PARTITION_BYTES for the commsched runs"
    )
    parser.add_argument("--credit", default="4MiB", help="COMMSCHED_CREDIT_BYTES for the commsched runs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default="torch_vgg.json", help="where the results go")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.batch, args.warmup, args.iterations)
        return 0

    sys.path.insert(0, str(HERE))
    from netrig import NetRig, available, expected_allreduce_seconds, parse_rate

    ok, why = available()
    if not ok:
        print(f"torch_vgg needs the shaped-network rig: {why}", file=sys.stderr)
        return 2
    compute_s, nbytes = calibrate(args.batch)
    if args.rate == "auto":
        # Pick the rate at which the allreduce of every gradient takes as long as the compute.
        probe = 1e9
        rate_bps = probe * expected_allreduce_seconds(nbytes, 2, probe) / compute_s
        rate = f"{rate_bps / 1e6:.0f}mbit"
    else:
        rate = args.rate
    comm_s = expected_allreduce_seconds(nbytes, 2, parse_rate(rate))
    print(
        f"VGG-style model, {nbytes / 2**20:.1f} MiB of gradients, batch {args.batch}/rank; "
        f"compute {1e3 * compute_s:.0f} ms, link {rate}: allreduce {1e3 * comm_s:.0f} ms; "
        f"ideal ~{1e3 * max(compute_s, comm_s):.0f} ms, serial ~{1e3 * (compute_s + comm_s):.0f} ms"
    )
    results = []
    with NetRig(n_ranks=2, rate=rate) as rig:
        for k, variant in enumerate(args.variants.split(",")):
            result = _run_variant(rig, variant, args, 29500 + k)
            results.append(result)
            print(f"  {variant:9s} {1e3 * result['seconds_per_iteration']:8.1f} ms/iteration", flush=True)
    baseline = next((r["seconds_per_iteration"] for r in results if r["variant"] == "ddp"), None)
    print(f"\n{'variant':<40s} {'ms/iter':>9s} {'vs DDP':>7s}")
    for result in results:
        ms = 1e3 * result["seconds_per_iteration"]
        ratio = f"{baseline / result['seconds_per_iteration']:.2f}x" if baseline else "-"
        print(f"{VARIANTS[result['variant']]:<40s} {ms:9.1f} {ratio:>7s}")
    report = {
        "model": "vgg-style (3 conv, 3 fc)",
        "gradient_bytes": nbytes,
        "batch_per_rank": args.batch,
        "rate": rate,
        "compute_seconds": compute_s,
        "allreduce_seconds_expected": comm_s,
        "partition_bytes": args.partition,
        "credit_bytes": args.credit,
        "results": results,
    }
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
