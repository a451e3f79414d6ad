#!/usr/bin/env python3
"""Auto-tuning against an exhaustive grid, on the shaped-network rig, in one run per model.

Each model's replay (commsched-bench schedule's loop, compute slept, real gradients over
a tc-shaped link) runs on 2 ranks through three phases in the same processes:

1. grid: every setting of a coarse exhaustive grid, a few iterations each;
2. autotune: commsched re-initialised with the defaults and COMMSCHED_AUTOTUNE on; the tuner
   has its 100-iteration budget, then the chosen setting runs on;
3. head to head: defaults, the grid's best and the tuner's choice, interleaved in rounds, so
   the machine's drifting load hits all three alike. The ratio reported is from this phase.

Usage (root, for the network namespaces)::

    python benchmarks/autotune_rig.py --models vgg16,bert-base --rate 1gbit --json out/autotune.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

KEYS = ("policy", "partition_bytes", "credit_bytes", "fusion_bytes")
HERE = Path(__file__).resolve().parent


class Periods:
    """Stands in the tuner's slot to time iteration boundaries, passing them on to a real tuner."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.stamps: list[float] = []

    @property
    def recording(self) -> bool:
        return bool(self.inner is not None and self.inner.recording)

    def observe(self, *args: Any) -> None:
        if self.inner is not None:
            self.inner.observe(*args)

    def step(self) -> None:
        self.stamps.append(time.perf_counter())
        if self.inner is not None:
            self.inner.step()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def periods(self, first: int = 0) -> list[float]:
        """Seconds between boundaries, from boundary `first` on."""
        return [b - a for a, b in zip(self.stamps[first:], self.stamps[first + 1 :])]


def grid(total_bytes: int) -> list[dict[str, Any]]:
    """The exhaustive grid: factor-4 steps, fifo with each fusion size."""
    partitions = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 0]
    credits = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    fusions = [16 << 10, 256 << 10, 4 << 20]
    points = [
        {"policy": "priority", "partition_bytes": p, "credit_bytes": c, "fusion_bytes": f}
        for p in partitions
        for c in credits
        for f in fusions
    ]
    points += [
        {"policy": "fifo", "partition_bytes": 0, "credit_bytes": 64 << 20, "fusion_bytes": f} for f in fusions
    ]
    return points


def worker(args: argparse.Namespace) -> int:
    """One rank: calibrate, grid, autotune, head to head; rank 0 prints a JSON line."""
    import numpy as np
    from mpi4py import MPI

    import commsched
    from commsched import autotune
    from commsched.bench import calibration, schedule

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    profile = schedule.load_model(args.model)
    layers = schedule.timed_layers(profile, 100.0, args.scale)
    total = schedule.gradient_bytes(layers)
    comm_s = calibration.raw_allreduce_s(comm, total, 3)
    layers = schedule.rescale_compute(layers, args.compute_over_comm * comm_s / schedule.compute_s(layers))
    grads = [np.random.default_rng(rank).random(n, dtype=np.float32) for l in layers for _, n in l.params]

    def agreed(values: list[float]) -> float:
        """Median of this rank's periods, averaged over ranks."""
        return comm.allreduce(statistics.median(values), op=MPI.SUM) / comm.Get_size()

    def measure(settings: dict[str, Any] | None, iterations: int, warmup: int = 2) -> float:
        if settings is not None:
            commsched.reconfigure(**settings)
        clock = Periods()
        commsched._state.tuner = clock
        comm.Barrier()
        schedule.replay(layers, grads, "overlap", iterations, warmup)
        commsched._state.tuner = None
        return agreed(clock.periods(warmup))

    started = time.time()
    commsched.init(transport="mpi")
    defaults = {k: commsched.config()[k] for k in KEYS}
    rows = []
    for point in grid(total):
        rows.append(dict(point, iteration_s=measure(point, args.grid_iterations)))
    best_row = min(rows, key=lambda r: r["iteration_s"])
    grid_s = time.time() - started
    commsched.shutdown()

    log_path = f"{args.log_prefix}{args.model}.csv" if args.log_prefix else ""
    commsched.init(transport="mpi")  # the defaults; what init(autotune=True) does, with our budget
    clock = Periods(autotune.start(autotune.Options(budget_iterations=args.budget, log_path=log_path)))
    commsched._state.tuner = clock
    comm.Barrier()
    schedule.replay(layers, grads, "overlap", args.after, args.budget)
    result = clock.inner.result if clock.inner is not None else None
    commsched._state.tuner = None
    all_periods = clock.periods(1)
    after_s = agreed(clock.periods(args.budget))
    chosen = {k: commsched.config()[k] for k in KEYS}

    best = {k: best_row[k] for k in KEYS}
    rounds: dict[str, list[float]] = {"defaults": [], "grid_best": [], "autotune": []}
    for _ in range(args.rounds):
        for label, settings in (("defaults", defaults), ("grid_best", best), ("autotune", chosen)):
            rounds[label].append(measure(settings, args.round_iterations))
    commsched.shutdown()
    if rank == 0:
        head = {label: statistics.median(values) for label, values in rounds.items()}
        print(
            "AUTOTUNE_RIG "
            + json.dumps(
                {
                    "model": args.model,
                    "scale": args.scale,
                    "compute_over_comm": args.compute_over_comm,
                    "raw_allreduce_s": comm_s,
                    "gradient_bytes": total,
                    "grid": rows,
                    "grid_points": len(rows),
                    "grid_seconds": grid_s,
                    "grid_best": best_row,
                    "autotune_result": result,
                    "autotune_chosen": chosen,
                    "autotune_after_s": after_s,
                    "autotune_periods": all_periods,
                    "head_to_head": rounds,
                    "head_to_head_median": head,
                    "ratio_autotune_vs_grid_best": head["autotune"] / head["grid_best"],
                    "ratio_defaults_vs_grid_best": head["defaults"] / head["grid_best"],
                }
            ),
            flush=True,
        )
    return 0


def _load_netrig() -> Any:
    spec = importlib.util.spec_from_file_location("netrig", HERE / "netrig.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netrig"] = module
    spec.loader.exec_module(module)
    return module


def _mib(n: int) -> str:
    return "off" if n == 0 else (f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K")


def _describe(settings: dict[str, Any]) -> str:
    return f"{settings['policy']} p={_mib(settings['partition_bytes'])} c={_mib(settings['credit_bytes'])} f={_mib(settings['fusion_bytes'])}"


def main(argv: list[str] | None = None) -> int:
    """Builds the rig, runs every model's worker in it, prints the table and writes JSON."""
    from commsched.bench import schedule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg16,bert-base")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--scale", type=float, default=32.0, help="divide sizes and compute by this")
    schedule.add_compute_over_comm(parser, "one raw MPI allreduce of all gradients (default 1)", default=1.0)
    parser.add_argument("--grid-iterations", type=int, default=4)
    parser.add_argument("--budget", type=int, default=100, help="iterations the tuner may use")
    parser.add_argument("--after", type=int, default=20, help="iterations measured after tuning")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-iterations", type=int, default=6)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--log-prefix", default="", help="write the tuner's CSV to PREFIX<model>.csv")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    import subprocess

    netrig = _load_netrig()
    ok, why = netrig.available()
    if not ok:
        print(f"autotune_rig: no rig: {why}", file=sys.stderr)
        return 2
    results = []
    with netrig.NetRig(2, args.rate) as rig:
        for model in args.models.split(","):
            argv_worker = [
                sys.executable,
                "-W",
                "ignore",
                str(Path(__file__).resolve()),
                "--worker",
                "--model",
                model,
            ]
            for flag in (
                "scale",
                "compute_over_comm",
                "grid_iterations",
                "budget",
                "after",
                "rounds",
                "round_iterations",
            ):
                argv_worker += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            if args.log_prefix:
                argv_worker += ["--log-prefix", str(Path(args.log_prefix).resolve())]
            proc = subprocess.run(rig.mpiexec_argv(argv_worker), capture_output=True, text=True, check=False)
            sys.stderr.write(proc.stderr[-3000:])
            lines = [l for l in proc.stdout.splitlines() if l.startswith("AUTOTUNE_RIG ")]
            if proc.returncode != 0 or not lines:
                print(f"autotune_rig: {model} failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            results.append(json.loads(lines[-1][len("AUTOTUNE_RIG ") :]))
    print(
        f"# 2 ranks, {args.rate} tbf links, sizes and compute / {args.scale:g}, compute = {args.compute_over_comm:g} x comm"
    )
    print(
        f"{'model':10} {'grid best':28} {'grid ms':>8} {'autotune choice':28} {'iters':>5} {'after ms':>8}"
        f" {'h2h default':>11} {'h2h grid':>8} {'h2h auto':>8} {'auto/grid':>9}"
    )
    for r in results:
        head = r["head_to_head_median"]
        tuned = r["autotune_result"] or {}
        print(
            f"{r['model']:10} {_describe(r['grid_best']):28} {r['grid_best']['iteration_s'] * 1e3:8.1f}"
            f" {_describe(r['autotune_chosen']):28} {tuned.get('iterations', -1):5d} {r['autotune_after_s'] * 1e3:8.1f}"
            f" {head['defaults'] * 1e3:11.1f} {head['grid_best'] * 1e3:8.1f} {head['autotune'] * 1e3:8.1f}"
            f" {r['ratio_autotune_vs_grid_best']:9.3f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
