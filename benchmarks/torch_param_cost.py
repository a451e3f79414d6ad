#!/usr/bin/env python3
"""Host cost per parameter of a training step: commsched against PyTorch DDP, in one run.

The model is a stack of small `Linear(32, 32)` layers (200 parameters by default) whose compute
is negligible, so what a step costs over a plain optimizer is what the wrapper spends per
gradient: hooks, submissions, waits, buckets. Each variant trains in its own processes (every
rank one process): the Gloo variants under torchrun-style variables (Gloo underneath DDP and
commsched alike), the `mpi_*` variants under `mpiexec -n RANKS python -m mpi4py` (MPICH's shared
memory underneath a plain mpi4py allreduce and commsched's MPI transport alike):

    python benchmarks/torch_param_cost.py                   # 1 and 2 ranks, table, JSON
    python benchmarks/torch_param_cost.py --ranks 2 --json out.json
    python benchmarks/torch_param_cost.py --variants ddp,floor,mpi_floor,mpi_barrier

Per round, the figure is (median step of the variant - median step of a plain optimizer) / parameters,
each median over --windows windows of --steps steps; the table gives the median over --repeats rounds
and its range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from local_ranks import ROOT, collect, run_ranks  # beside this file: the script's folder is on sys.path
from netrig import find_mpiexec

RESULT_TAG = "PARAM_COST_RESULT "
VARIANTS = {
    "plain": "torch.optim.SGD, no communication",
    "ddp": "PyTorch DDP (Gloo)",
    "floor": "SGD + one Gloo allreduce of all gradients",
    "barrier": "commsched DistributedOptimizer, barrier",
    "overlap": "commsched DistributedOptimizer, overlap_forward",
    "mpi_floor": "SGD + one MPI allreduce of all gradients",
    "mpi_barrier": "commsched over MPI, barrier",
    "mpi_overlap": "commsched over MPI, overlap_forward",
}


def _model(layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])


def worker(variant: str, layers: int, batch: int, warmup: int, windows: int, steps: int) -> None:
    """Runs inside a rank: trains and (rank 0) prints the median window's seconds per step."""
    import torch

    torch.set_num_threads(1)
    model = _model(layers)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    net: Any = model
    rank = 0
    finish = None
    if variant == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif variant == "floor":
        # What any barrier-mode wrapper pays at least: one collective of every gradient, after
        # backward, with no per-gradient work (the flat copy stands for bucket views' zero cost).
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        plain_step = optimizer.step
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        views = [chunk.view_as(p) for chunk, p in zip(flat.split([p.numel() for p in params]), params)]

        def reduced_step() -> None:
            grads = [p.grad for p in params]
            torch._foreach_copy_(views, grads)
            dist.all_reduce(flat)
            torch._foreach_copy_(grads, views)
            plain_step()

        optimizer.step = reduced_step
    elif variant == "mpi_floor":
        # The Gloo floor's work with mpi4py's allreduce (MPICH, shared memory) in place of Gloo's.
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        plain_step = optimizer.step
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        flat_array = flat.numpy()  # shares flat's memory
        views = [chunk.view_as(p) for chunk, p in zip(flat.split([p.numel() for p in params]), params)]

        def mpi_reduced_step() -> None:
            grads = [p.grad for p in params]
            torch._foreach_copy_(views, grads)
            comm.Allreduce(MPI.IN_PLACE, flat_array, op=MPI.SUM)
            torch._foreach_copy_(grads, views)
            plain_step()

        optimizer.step = mpi_reduced_step
    elif variant in ("barrier", "overlap", "mpi_barrier", "mpi_overlap"):
        import commsched.torch as ct

        import commsched

        commsched.init(transport="mpi" if variant.startswith("mpi_") else "gloo")
        rank = commsched.rank()
        overlap = variant.endswith("overlap")
        optimizer = ct.DistributedOptimizer(optimizer, model=model, overlap_forward=overlap)
        finish = optimizer.synchronize
    x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(1))

    def one_step() -> None:
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()

    for _ in range(warmup):
        one_step()
    per_window = []
    for _ in range(windows):
        if finish is not None:
            finish()
        started = time.perf_counter()
        for _ in range(steps):
            one_step()
        if finish is not None:
            finish()  # overlap mode: the last updates are part of the window's work
        per_window.append((time.perf_counter() - started) / steps)
    if rank == 0:
        params = sum(1 for _ in model.parameters())
        result = {"variant": variant, "parameters": params, "window_step_seconds": per_window}
        print(RESULT_TAG + json.dumps(result), flush=True)
    if variant in ("ddp", "floor"):
        # Tearing DDP down can deadlock inside torch (~ProcessGroupGloo joins its loop thread, which
        # waits for the GIL this thread holds); the result is out, so leave without the teardown.
        import torch.distributed as dist

        dist.barrier()
        sys.stdout.flush()
        os._exit(0)
    elif finish is not None:
        import commsched

        commsched.shutdown()


def run_variant(variant: str, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """Starts `ranks` processes of one variant and returns rank 0's result."""
    argv = [str(Path(__file__).resolve()), "--worker", variant]
    argv += ["--layers", str(args.layers), "--batch", str(args.batch), "--warmup", str(args.warmup)]
    argv += ["--windows", str(args.windows), "--steps", str(args.steps)]
    what = f"{variant} at {ranks} ranks"
    if variant.startswith("mpi_"):
        # -m mpi4py: an exception on one rank aborts them all instead of leaving the others waiting.
        launch = [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", *argv]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        result = collect([proc], args.timeout, RESULT_TAG, what)
    else:
        result = run_ranks([sys.executable, *argv], ranks, args.timeout, RESULT_TAG, what)
    result["ranks"] = ranks
    result["step_seconds"] = statistics.median(result["window_step_seconds"])
    return result


def main(argv: list[str] | None = None) -> int:
    """Runs every variant at each rank count, prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--layers", type=int, default=100, help="Linear(32, 32) layers (2 parameters each)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per window")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds of every variant; medians across rounds"
    )
    parser.add_argument("--json", default="torch_param_cost.json", help="where the results go")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.layers, args.batch, args.warmup, args.windows, args.steps)
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if "plain" not in variants:
        variants.insert(0, "plain")
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        # Rounds interleave the variants, so a loaded stretch of the host hits them all alike.
        per_round = []
        for _ in range(args.repeats):
            results = {v: run_variant(v, ranks, args) for v in variants}
            plain = results["plain"]["step_seconds"]
            for result in results.values():
                result["us_per_parameter"] = 1e6 * (result["step_seconds"] - plain) / result["parameters"]
            per_round.append(results)
        for variant in variants:
            costs = [round_[variant]["us_per_parameter"] for round_ in per_round]
            steps = [round_[variant]["step_seconds"] for round_ in per_round]
            rows.append(
                {
                    "ranks": ranks,
                    "variant": variant,
                    "parameters": per_round[0][variant]["parameters"],
                    "step_seconds": statistics.median(steps),
                    "us_per_parameter": statistics.median(costs),
                    "range_us_per_parameter": [min(costs), max(costs)],
                    "rounds": [round_[variant] for round_ in per_round],
                }
            )
    print(
        f"median of {args.repeats} round(s), each the median of {args.windows} windows of {args.steps} steps"
    )
    print(f"{'ranks':>5s}  {'variant':<48s} {'ms/step':>8s} {'us/param over plain (range)':>28s}")
    for row in rows:
        low, high = row["range_us_per_parameter"]
        print(
            f"{row['ranks']:5d}  {VARIANTS[row['variant']]:<48s} {1e3 * row['step_seconds']:8.3f} "
            f"{row['us_per_parameter']:8.1f} ({low:.1f} to {high:.1f})"
        )
    report = {
        "model": f"{args.layers} x Linear(32, 32)",
        "batch": args.batch,
        "windows": args.windows,
        "steps_per_window": args.steps,
        "repeats": args.repeats,
        "results": rows,
    }
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
