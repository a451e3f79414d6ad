"""How commsched's default partition, credit and fusion sizes were chosen: a simulator sweep.

For each model profile, rank count and network (communication = compute, and 10x faster),
runs the real scheduler on the virtual clock for every setting of a grid (priority policy,
overlap mode) and scores each setting by its geometric-mean slowdown against the best
schedule possible. Prints the best settings and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from commsched.bench import schedule
from commsched.bench.sim_cli import predict
from commsched.config import resolve

MIB = 1024**2
PARTITIONS = [MIB // 2, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]
# Credit in partitions; None is commsched's default, one partition per rank (2 to 16).
CREDIT_MULTIPLES: list[int | None] = [1, 2, 4, 8, None]
FUSIONS = [256 * 1024, MIB, 4 * MIB]
MODELS = ["vgg16", "resnet50", "bert-base", "gpt2-medium"]


def grid(scale: float = 1.0) -> Iterator[tuple[dict, dict]]:
    """Every grid setting at full scale, with the same sizes divided by `scale` for a scaled replay."""
    for partition, multiple, fusion in itertools.product(PARTITIONS, CREDIT_MULTIPLES, FUSIONS):
        full = {
            "partition_bytes": partition,
            "credit_bytes": None if multiple is None else partition * multiple,
            "fusion_bytes": fusion,
            "cycle_time": 0.001,
        }
        yield full, {k: int(v / scale) if k.endswith("_bytes") and v else v for k, v in full.items()}


def sweep(ranks: list[int], ratios: list[float], latency_s: float) -> list[dict]:
    """Every (model, ranks, ratio, setting) with its simulated iteration time over the best possible."""
    results = []
    for model in MODELS:
        layers = schedule.timed_layers(schedule.load_model(model), 100.0, 1.0, 1.0)
        spec = schedule.sim_layers(layers)
        total = schedule.gradient_bytes(layers)
        compute = schedule.compute_s(layers)
        for n, ratio in itertools.product(ranks, ratios):
            rate = 2.0 * (n - 1) / n * total / (ratio * compute)
            for settings, _ in grid():
                row = predict(
                    spec, n, rate, latency_s, settings, ["priority"], ["overlap"], iterations=4, warmup=1
                )[0]
                results.append(dict(model=model, ranks=n, ratio=ratio, **settings, vs_best=row["vs_best"]))
    return results


def sweep_replays(paths: list[Path]) -> list[dict]:
    """The same grid on links a replay measured (its JSON header), sizes scaled as the replay's."""
    results = []
    for path in paths:
        run = json.loads(path.read_text())["run"]
        layers = schedule.timed_layers(
            schedule.load_model(run["model"]), run["device_tflops"], run["scale"], run["time_scale"]
        )
        spec = schedule.sim_layers(layers)
        for full, scaled in grid(run["scale"]):
            row = predict(
                spec,
                run["ranks"],
                run["bandwidth_bytes_per_s"],
                run["latency_s"],
                scaled,
                ["priority"],
                ["overlap"],
                size_costs=[tuple(cost) for cost in run["size_costs"]],
            )[0]
            # Reported at full scale, so a row reads as a candidate default.
            results.append(
                dict(model=run["model"], ranks=run["ranks"], ratio=None, **full, vs_best=row["vs_best"])
            )
    return results


def main() -> int:
    """Runs the sweep and prints the best settings by geometric-mean slowdown."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", default="2,8,64")
    parser.add_argument("--ratios", default="1,0.1", help="communication / compute ratios")
    parser.add_argument("--latency", type=float, default=20e-6)
    parser.add_argument(
        "--replays",
        type=Path,
        nargs="+",
        help="instead, sweep on the links these `commsched-bench schedule --json` runs measured",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.replays:
        results = sweep_replays(args.replays)
    else:
        results = sweep(
            [int(n) for n in args.ranks.split(",")], [float(r) for r in args.ratios.split(",")], args.latency
        )
    scores: dict[tuple, list[float]] = {}
    for row in results:
        key = (row["partition_bytes"], row["credit_bytes"], row["fusion_bytes"])
        scores.setdefault(key, []).append(math.log(row["vs_best"]))
    ranked = sorted(
        ((math.exp(sum(v) / len(v)), max(v), key) for key, v in scores.items()), key=lambda r: r[:2]
    )
    print(f"{'partition':>10}{'credit':>10}{'fusion':>10}{'geomean x best':>16}{'worst x best':>14}")
    defaults = resolve({}, environ={})
    current = (defaults.partition_bytes, defaults.credit_bytes, defaults.fusion_bytes)
    shown = ranked[:10] + [row for row in ranked[10:] if row[2] == current]
    for geomean, worst, (partition, credit, fusion) in shown:
        credit_text = "per-rank" if credit is None else f"{credit / MIB:g}M"
        print(
            f"{partition / MIB:>9g}M{credit_text:>10}{fusion / MIB:>9g}M{geomean:>16.4f}{math.exp(worst):>14.3f}"
            + ("  (the defaults)" if (partition, credit, fusion) == current else "")
        )
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
