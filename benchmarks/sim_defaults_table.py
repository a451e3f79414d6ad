"""The simulator's table of the link-fitted defaults against the best schedule possible.

For each rank count, bandwidth, per-message latency and model profile: commsched with the
defaults link_defaults.default_sizes picks for that link (priority, overlap), the defaults before the
rule (4 MiB partitions, one per rank as credit, 2 to 16; 1 MiB fusion) and a Horovod-like FIFO
(whole tensors in ready order, 64 MiB fusion, no credit cap, the next iteration after every
reduction), each as its iteration time over the best schedule possible (simulate_ideal: a
preemptive, overhead-free link; each reduction pays one latency of the same allreduce algorithm,
--algorithm: ring by default, mpich or nccl for those libraries' choices by size). The best setting of
choose_defaults.py's grid shows how close any partition, credit and fusion can come on that
link (the link serves collectives in start order, so hiding latency behind credit delays an
urgent chunk). Agreement rounds travel on the TCP control channel (--rounds channel, the default:
what Gloo and gRPC always use and MPI uses across hosts, and NCCL's rounds never share its data
path), so they do not queue behind the collectives' bytes; each row also gives the defaults for
rounds queued behind the data on the link (COMMSCHED_CONTROL_CHANNEL=transport, the model checked on
the 2-4-rank rig) under that model (--rounds data for the rest of the table). Prints a markdown table
and writes JSON.

    python benchmarks/sim_defaults_table.py --json docs/data/sim_defaults.json
    python benchmarks/sim_defaults_table.py --algorithm mpich --json docs/data/sim_defaults_mpich.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from commsched._core import simulate, simulate_ideal

from commsched.bench import schedule
from commsched.collective_model import ALGORITHMS
from commsched.config import parse_duration, parse_rate
from commsched.link_defaults import default_sizes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from choose_defaults import settings_grid

MIB = 1024**2
MODELS = "vgg16,resnet50,bert-base,gpt2-medium"
RANKS = "8,64,1024"
BANDWIDTHS = "10gbit,100gbit"
LATENCIES = "2us,5us,20us"
UNCAPPED = 2**62  # a credit no iteration reaches
HOROVOD_FUSION_BYTES = 64 * MIB


def old_defaults(ranks: int) -> dict[str, int]:
    """The defaults before the link rule."""
    return {"partition_bytes": 4 * MIB, "credit_bytes": 4 * MIB * min(16, max(2, ranks)), "fusion_bytes": MIB}


def row(
    model: str,
    layers: list,
    ranks: int,
    rate: float,
    latency: float,
    iterations: int,
    warmup: int,
    grid: bool,
    algorithm: str = "ring",
    rounds: str = "channel",
) -> dict:
    """One table row: each schedule's iteration time over the best schedule's."""

    def run(policy: str, sizes: dict[str, int], mode: str, where: str = rounds) -> float:
        result = simulate(
            layers,
            ranks,
            rate,
            latency,
            policy,
            sizes["partition_bytes"],
            sizes["credit_bytes"],
            sizes["fusion_bytes"],
            mode,
            0.001,
            -1.0,
            iterations,
            warmup,
            algorithm=algorithm,
            rounds=where,
        )
        return float(result["iteration_s"])

    best = float(simulate_ideal(layers, ranks, rate, iterations, warmup, latency, algorithm)["iteration_s"])
    defaults = default_sizes(ranks, rate, latency, algorithm=algorithm, rounds=rounds)
    on_data = default_sizes(ranks, rate, latency, algorithm=algorithm, rounds="data")
    fifo = {"partition_bytes": 0, "credit_bytes": UNCAPPED, "fusion_bytes": HOROVOD_FUSION_BYTES}
    times = {
        "defaults": run("priority", defaults, "overlap"),
        "old_defaults": run("priority", old_defaults(ranks), "overlap"),
        "fifo": run("fifo", fifo, "barrier"),
        # Rounds queued behind the bytes on the link, with the defaults for that (the rule before).
        "defaults_rounds_on_data": run("priority", on_data, "overlap", "data"),
    }
    if grid:
        sizes = ("partition_bytes", "credit_bytes", "fusion_bytes")
        times["grid_best"] = min(run("priority", dict(zip(sizes, s)), "overlap") for s in settings_grid())
    return {
        "model": model,
        "ranks": ranks,
        "bandwidth_bytes_per_s": rate,
        "latency_s": latency,
        "algorithm": algorithm,
        "rounds": rounds,
        "defaults": defaults,
        "defaults_rounds_on_data": on_data,
        "best_s": best,
        **{f"{name}_s": t for name, t in times.items()},
        **{f"{name}_vs_best": t / best for name, t in times.items()},
    }


def table(
    models: Sequence[str],
    ranks: Sequence[int],
    rates: Sequence[float],
    latencies: Sequence[float],
    iterations: int = 6,
    warmup: int = 2,
    threads: int = 2,
    grid: bool = True,
    algorithm: str = "ring",
    rounds: str = "channel",
) -> list[dict[str, Any]]:
    """Every row of the grid, in (ranks, bandwidth, latency, model) order."""
    layers = {
        m: schedule.sim_layers(
            schedule.timed_layers(schedule.load_model(m), schedule.DEFAULT_DEVICE_TFLOPS, 1, 1)
        )
        for m in models
    }
    keys = list(itertools.product(ranks, rates, latencies, models))
    with ThreadPoolExecutor(max(1, threads)) as pool:  # the simulator releases the GIL
        return list(
            pool.map(
                lambda k: row(
                    k[3], layers[k[3]], k[0], k[1], k[2], iterations, warmup, grid, algorithm, rounds
                ),
                keys,
            )
        )


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = [
        (
            "| ranks | Gbit/s | latency us | model | defaults partition / credit / fusion | defaults / best "
            "| old defaults / best | fifo / best | grid best / best | defaults, rounds behind data / best |"
        ),
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sizes = " / ".join(
            f"{r['defaults'][k] / MIB:g} MiB" for k in ("partition_bytes", "credit_bytes", "fusion_bytes")
        )
        lines.append(
            f"| {r['ranks']} | {r['bandwidth_bytes_per_s'] * 8e-9:g} | {r['latency_s'] * 1e6:g} | {r['model']} | {sizes} "
            f"| {r['defaults_vs_best']:.3f} | {r['old_defaults_vs_best']:.3f} | {r['fifo_vs_best']:.3f} "
            + (f"| {r['grid_best_vs_best']:.3f} " if "grid_best_vs_best" in r else "| - ")
            + f"| {r['defaults_rounds_on_data_vs_best']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the table and writes it as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--ranks", default=RANKS)
    parser.add_argument("--bandwidths", default=BANDWIDTHS)
    parser.add_argument("--latencies", default=LATENCIES)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-grid", action="store_true", help="skip the grid's best setting (faster)")
    parser.add_argument(
        "--algorithm",
        default="ring",
        choices=ALGORITHMS,
        help="the allreduce the transport runs (default ring)",
    )
    parser.add_argument(
        "--rounds",
        default="channel",
        choices=("channel", "data"),
        help="agreement rounds on the control channel (default) or queued behind the data on the link",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = table(
        args.models.split(","),
        [int(n) for n in args.ranks.split(",")],
        [parse_rate(r) for r in args.bandwidths.split(",")],
        [parse_duration(t) for t in args.latencies.split(",")],
        args.iterations,
        args.warmup,
        args.threads,
        not args.no_grid,
        args.algorithm,
        args.rounds,
    )
    print(markdown(rows))
    worst = max(rows, key=lambda r: r["defaults_vs_best"])
    print(
        f"\n# worst defaults / best: {worst['defaults_vs_best']:.3f} ({worst['model']}, {worst['ranks']} ranks, "
        f"{worst['bandwidth_bytes_per_s'] * 8e-9:g} Gbit/s, {worst['latency_s'] * 1e6:g} us)"
    )
    within = sum(r["defaults_vs_best"] <= 1.10 for r in rows)
    print(f"# defaults within 10% of the best schedule: {within} of {len(rows)}")
    if all("grid_best_s" in r for r in rows):
        near = sum(r["defaults_s"] <= 1.10 * r["grid_best_s"] for r in rows)
        print(f"# defaults within 10% of the grid's best setting: {near} of {len(rows)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/sim_defaults_table.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        document = {"command": command, "algorithm": args.algorithm, "rounds": args.rounds, "rows": rows}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
