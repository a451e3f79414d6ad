"""Fits commsched's default partition, credit and fusion sizes to the link: a simulator sweep.

For every network of a grid (rank count x bandwidth x per-message latency) and every model
profile, in two regimes (compute at the profile's device speed, and compute scaled to equal the
communication, where the schedule matters most), runs the real scheduler on the virtual clock
(priority policy, overlap mode) for every setting of a size grid, and scores each against the
best schedule possible (commsched._core.simulate_ideal with the same latency and allreduce
algorithm, --algorithm). Then searches the constants of link_defaults.DefaultRule, whose sizes depend on
the link only through its delay (bandwidth x the algorithm's message latencies; the ring's
2(n-1) x latency by default), for the rule with the smallest worst-case slowdown against each
case's best grid setting. Agreement rounds travel on the control channel (--rounds channel), not
behind the collectives' bytes on the link, as they do by default across hosts (--rounds data for
rounds in the transport's own connection). --keep-pinned searches only among the rules that give
the pinned links (PINNED_LINKS: the rig's, and 2-8 ranks at 10-100 Gbit/s) the sizes the code's
rule gives them, so a refit needs no new rig measurement. Prints the rule and its table and
writes them as JSON (the rule's constants go into commsched/link_defaults.py).

    python benchmarks/choose_defaults.py --keep-pinned --json docs/data/default_rule.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from commsched._core import simulate, simulate_ideal

from commsched import collective_model
from commsched.bench import schedule
from commsched.config import parse_duration, parse_rate
from commsched.link_defaults import (
    DEFAULT_RULE,
    LARGEST_PARTITION_BYTES,
    ROUNDS_ON_DATA_RULE,
    DefaultRule,
    default_sizes,
    link_delay_bytes,
)

MIB = 1024**2
PARTITIONS = [1 << k for k in range(17, 29)]  # 128 KiB .. 256 MiB
CREDIT_PARTITIONS = [1, 2, 4, 8, 16, 32, 64]
FUSIONS = [256 * 1024, MIB, 4 * MIB, 16 * MIB, 64 * MIB]
MODELS = ["vgg16", "resnet50", "bert-base", "gpt2-medium"]
RANKS = "2,8,64,1024"
BANDWIDTHS = "1gbit,10gbit,100gbit"
LATENCIES = "2us,5us,20us,50us"
REGIMES = ("device", "balanced")  # compute at the profile's device speed; compute = communication
# The rule's search space (see link_defaults.DefaultRule).
PARTITION_SCALES = [MIB * 2.0**k for k in range(-2, 4)]
PARTITION_EXPONENTS = [0.0, 0.25, 0.5]
MIN_PARTITIONS = [256 * 1024, 512 * 1024, MIB, 2 * MIB, 4 * MIB]
MAX_PARTITIONS = [4 * MIB, 16 * MIB, 64 * MIB]
CREDIT_SCALES = [MIB * 2.0**k for k in range(-2, 7)]
CREDIT_EXPONENTS = [0.5, 0.75, 1.0]
MIN_CREDIT_PARTITIONS = [1, 2, 4]
MAX_CREDIT_PARTITIONS = CREDIT_PARTITIONS[-1]
# Links whose sizes a refit keeps (--keep-pinned): 2-4 ranks at 1 Gbit/s and 10-60 us per message
# (the shaped rig, where every replay figure was measured) and 2-8 ranks at 10-100 Gbit/s and
# 2-20 us (one host or a few), so a refit changes only links the simulator alone covers.
PINNED_LINKS = [
    *itertools.product(range(2, 5), [1e8, 1.25e8], [t * 1e-6 for t in (10, 20, 30, 45, 60)]),
    *itertools.product(range(2, 9), [1.25e9, 3.125e9, 1.25e10], [t * 1e-6 for t in (2, 5, 10, 20)]),
]

Network = tuple[int, float, float]  # ranks, bytes/s, seconds per message
Setting = tuple[int, int, int]  # partition, credit, fusion
Case = tuple[Network, str, str]  # network, model, regime


def settings_grid() -> list[Setting]:
    """Every (partition, credit, fusion) the sweep simulates."""
    return [(p, p * k, f) for p, k, f in itertools.product(PARTITIONS, CREDIT_PARTITIONS, FUSIONS)]


def case_layers(model: Any, network: Network, regime: str) -> list:
    """The simulator's layers of a timed profile, compute scaled to the communication when balanced."""
    if regime == "balanced":
        ranks, rate, _ = network
        communication = 2.0 * (ranks - 1) / ranks * schedule.gradient_bytes(model) / rate
        model = schedule.rescale_compute(model, communication / schedule.compute_s(model))
    return schedule.sim_layers(model)


def case_delay_bytes(network: Network, algorithm: str = "ring") -> float:
    """The link's delay default_sizes fits to: under a library's choice, that of the algorithm it
    runs for the partition the current rule picks."""
    ranks, rate, latency = network
    partition = default_sizes(*network, algorithm=algorithm)["partition_bytes"]
    concrete = collective_model.resolve(algorithm, partition, max(2, ranks), rate, latency)
    return link_delay_bytes(ranks, rate, latency, concrete)


def simulate_setting(
    layers: list,
    network: Network,
    setting: Setting,
    iterations: int,
    warmup: int,
    algorithm: str = "ring",
    rounds: str = "channel",
) -> float:
    """Iteration seconds of one setting under priority + overlap."""
    ranks, rate, latency = network
    partition, credit, fusion = setting
    result = simulate(
        layers,
        ranks,
        rate,
        latency,
        "priority",
        partition,
        credit,
        fusion,
        "overlap",
        0.001,
        -1.0,
        iterations,
        warmup,
        algorithm=algorithm,
        rounds=rounds,
    )
    return float(result["iteration_s"])


def sweep(
    networks: Sequence[Network],
    models: Sequence[str],
    regimes: Sequence[str],
    iterations: int,
    warmup: int,
    threads: int,
    algorithm: str = "ring",
    rounds: str = "channel",
) -> dict[Case, dict[str, Any]]:
    """For each (network, model, regime): the best schedule's time and every grid setting's time."""
    grid = settings_grid()
    timed = {
        m: schedule.timed_layers(schedule.load_model(m), schedule.DEFAULT_DEVICE_TFLOPS, 1, 1) for m in models
    }

    def one(case: Case) -> dict[str, Any]:
        network, model, regime = case
        ranks, rate, latency = network
        layers = case_layers(timed[model], network, regime)
        best = simulate_ideal(layers, ranks, rate, iterations, warmup, latency, algorithm)["iteration_s"]
        times = {s: simulate_setting(layers, network, s, iterations, warmup, algorithm, rounds) for s in grid}
        return {"best_s": float(best), "times": times}

    cases = list(itertools.product(networks, models, regimes))
    with ThreadPoolExecutor(max(1, threads)) as pool:  # the simulator releases the GIL
        return dict(zip(cases, pool.map(one, cases)))


def _power_of_two_index(values: np.ndarray, low: int, high: int, grid: Sequence[int]) -> np.ndarray:
    """Index into `grid` (consecutive powers of two) of each value rounded to 2**k within [low, high]."""
    exponents = np.round(np.log2(np.maximum(values, 1e-300)))
    exponents = np.clip(exponents, math.log2(low), math.log2(high))
    return (exponents - math.log2(grid[0])).astype(int)


def _rule_indices(rule: DefaultRule, delays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices into PARTITIONS and CREDIT_PARTITIONS of the sizes link_defaults' formula gives each
    delay under `rule` (a partition at the rule's largest grows so the credit fits in the most
    partitions, up to link_defaults.LARGEST_PARTITION_BYTES)."""
    credit = rule.credit_scale_bytes * (delays / MIB) ** rule.credit_exponent
    p_index = _power_of_two_index(
        rule.partition_scale_bytes * (delays / MIB) ** rule.partition_exponent,
        rule.min_partition_bytes,
        rule.max_partition_bytes,
        PARTITIONS,
    )
    top = PARTITIONS.index(rule.max_partition_bytes)
    grown = _power_of_two_index(
        credit / rule.max_credit_partitions,
        rule.max_partition_bytes,
        max(rule.max_partition_bytes, LARGEST_PARTITION_BYTES),
        PARTITIONS,
    )
    p_index = np.where(p_index == top, grown, p_index)
    partitions = np.array(PARTITIONS, float)[p_index]
    k_index = _power_of_two_index(
        credit / partitions, rule.min_credit_partitions, rule.max_credit_partitions, CREDIT_PARTITIONS
    )
    return p_index, k_index


def _formula_sizes(rule: DefaultRule, delays: np.ndarray) -> np.ndarray:
    """(partition, credit) rows the rule's formula gives each delay, as fit() scores them."""
    p_index, k_index = _rule_indices(rule, delays)
    partitions = np.array(PARTITIONS, float)[p_index]
    return np.stack([partitions, partitions * np.array(CREDIT_PARTITIONS, float)[k_index]])


def rule_for(rounds: str) -> DefaultRule:
    """The rule link_defaults.default_sizes applies when agreement rounds travel on `rounds`."""
    return DEFAULT_RULE if rounds == "channel" else ROUNDS_ON_DATA_RULE


def fit(
    table: dict[Case, dict[str, Any]],
    algorithm: str = "ring",
    credit_only: bool = False,
    rounds: str = "channel",
    keep_pinned: bool = False,
) -> tuple[DefaultRule, tuple[float, float]]:
    """The rule with the smallest worst case (to 0.1%, then geometric mean) over the sweep, searched
    with numpy; `credit_only` searches the credit's scale and exponent and keeps the rest of
    the rule link_defaults.default_sizes takes for these `rounds` (partition, fusion, least credit), so small
    links keep their defaults. `keep_pinned` searches every constant but only among the rules that
    give PINNED_LINKS the sizes the code's rule gives them, so the pinned links keep
    theirs while the others may change."""
    partition_space = list(
        itertools.product(PARTITION_SCALES, PARTITION_EXPONENTS, MIN_PARTITIONS, MAX_PARTITIONS)
    )
    min_credits, fusions = MIN_CREDIT_PARTITIONS, FUSIONS
    kept = rule_for(rounds)
    if credit_only:
        partition_space = [
            (
                kept.partition_scale_bytes,
                kept.partition_exponent,
                kept.min_partition_bytes,
                kept.max_partition_bytes,
            )
        ]
        min_credits, fusions = [kept.min_credit_partitions], [kept.fusion_bytes]
    cases = list(table)
    grid = settings_grid()
    shape = (len(PARTITIONS), len(CREDIT_PARTITIONS), len(FUSIONS))
    # log(time / case's best grid time), by case and grid position.
    logs = np.empty((len(cases), *shape))
    for c, case in enumerate(cases):
        times = table[case]["times"]
        floor = min(times.values())
        for partition, credit, fusion in grid:
            index = (
                PARTITIONS.index(partition),
                CREDIT_PARTITIONS.index(credit // partition),
                FUSIONS.index(fusion),
            )
            logs[(c, *index)] = math.log(times[(partition, credit, fusion)] / floor)
    delays = np.array([case_delay_bytes(case[0], algorithm) for case in cases])
    rows = np.arange(len(cases))
    pinned = np.array([case_delay_bytes(link, algorithm) for link in PINNED_LINKS])
    pinned_sizes = _formula_sizes(kept, pinned)
    if keep_pinned:
        fusions = [kept.fusion_bytes]
    best: tuple[tuple[float, float], tuple[float, float], DefaultRule] | None = None
    for p_scale, p_exp, p_min, p_max in partition_space:
        if p_min > p_max or (p_exp == 0 and (p_min, p_max) != (MIN_PARTITIONS[0], MAX_PARTITIONS[-1])):
            continue  # a constant partition needs no clamps: one spelling of each
        for c_scale, c_exp, k_min in itertools.product(CREDIT_SCALES, CREDIT_EXPONENTS, min_credits):
            candidate = DefaultRule(
                p_scale, p_exp, p_min, p_max, c_scale, c_exp, k_min, MAX_CREDIT_PARTITIONS, kept.fusion_bytes
            )
            if keep_pinned and not np.array_equal(_formula_sizes(candidate, pinned), pinned_sizes):
                continue
            p_index, k_index = _rule_indices(candidate, delays)
            picked = logs[rows, p_index, k_index, :]  # (cases, fusions)
            for fusion in fusions:
                f = FUSIONS.index(fusion)
                score = (float(np.exp(picked[:, f].max())), float(np.exp(picked[:, f].mean())))
                # Worst cases within 0.1% of each other tie; the geometric mean then decides.
                key = (round(score[0], 3), score[1])
                if best is None or key < best[0]:
                    best = (key, score, dataclasses.replace(candidate, fusion_bytes=fusion))
    assert best is not None
    return best[2], best[1]


def score_rule(
    rule: DefaultRule, table: dict[Case, dict[str, Any]], algorithm: str = "ring"
) -> tuple[float, float]:
    """(worst, geometric mean) over the cases of the rule's time over the case's best grid setting."""
    logs = []
    for (network, _, _), entry in table.items():
        setting = tuple(default_sizes(*network, rule=rule, algorithm=algorithm).values())
        time_s = entry["times"].get(setting)
        if time_s is None:
            return math.inf, math.inf
        logs.append(math.log(time_s / min(entry["times"].values())))
    return math.exp(max(logs)), math.exp(sum(logs) / len(logs))


def old_defaults(ranks: int) -> Setting:
    """The defaults before the rule: 4 MiB partitions, one per rank as credit (2 to 16), 1 MiB fusion."""
    return 4 * MIB, 4 * MIB * min(16, max(2, ranks)), MIB


def summary(
    table: dict[Case, dict[str, Any]], rule: DefaultRule, algorithm: str = "ring"
) -> list[dict[str, Any]]:
    """One row per case: the rule's, the old defaults' and the grid's best against the best schedule."""
    rows = []
    for (network, model, regime), entry in sorted(table.items(), key=lambda item: (item[0][0], item[0][2])):
        ranks, rate, latency = network
        times = entry["times"]
        best_setting = min(times, key=times.get)
        chosen = tuple(default_sizes(*network, rule=rule, algorithm=algorithm).values())
        old = old_defaults(ranks)
        rows.append(
            {
                "model": model,
                "regime": regime,
                "ranks": ranks,
                "bandwidth_bytes_per_s": rate,
                "latency_s": latency,
                "best_s": entry["best_s"],
                "defaults": dict(zip(("partition_bytes", "credit_bytes", "fusion_bytes"), chosen)),
                "defaults_vs_best": times[chosen] / entry["best_s"],
                "old_defaults_vs_best": times[old] / entry["best_s"] if old in times else None,
                "grid_best": dict(zip(("partition_bytes", "credit_bytes", "fusion_bytes"), best_setting)),
                "grid_best_vs_best": times[best_setting] / entry["best_s"],
            }
        )
    return rows


def _sizes(values: Sequence[int]) -> str:
    return "/".join(f"{v / MIB:g}M" for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the sweep, fits the rule, prints it with its table and writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=RANKS, help=f"comma list (default {RANKS})")
    parser.add_argument("--bandwidths", default=BANDWIDTHS, help=f"comma list (default {BANDWIDTHS})")
    parser.add_argument("--latencies", default=LATENCIES, help=f"comma list (default {LATENCIES})")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--regimes", default=",".join(REGIMES), help="device (profile's compute), balanced")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--algorithm",
        default="ring",
        choices=collective_model.ALGORITHMS,
        help="the allreduce the transport runs (default ring)",
    )
    parser.add_argument(
        "--rounds",
        default="channel",
        choices=("channel", "data"),
        help="agreement rounds on the control channel (default) or queued behind the data on the link",
    )
    parser.add_argument(
        "--credit-only",
        action="store_true",
        help="fit the credit's scale and exponent only, keeping the partition and fusion of config's rule",
    )
    parser.add_argument(
        "--keep-pinned",
        action="store_true",
        help="fit every constant among the rules that keep the sizes of the pinned links (PINNED_LINKS)",
    )
    parser.add_argument("--json", type=Path, help="write the rule and its table here")
    args = parser.parse_args(argv)
    networks = list(
        itertools.product(
            [int(n) for n in args.ranks.split(",")],
            [parse_rate(r) for r in args.bandwidths.split(",")],
            [parse_duration(t) for t in args.latencies.split(",")],
        )
    )
    table = sweep(
        networks,
        args.models.split(","),
        args.regimes.split(","),
        args.iterations,
        args.warmup,
        args.threads,
        args.algorithm,
        args.rounds,
    )
    rule, (worst, geomean) = fit(table, args.algorithm, args.credit_only, args.rounds, args.keep_pinned)
    current_worst, current_geomean = score_rule(rule_for(args.rounds), table, args.algorithm)
    print(f"# fitted rule: {rule}")
    print(f"# against each model's best grid setting: worst {worst:.3f}, geomean {geomean:.4f}")
    print(
        f"# config's rule for rounds on the {args.rounds} now: worst {current_worst:.3f}, geomean {current_geomean:.4f}"
    )
    rows = summary(table, rule, args.algorithm)
    print(
        "| ranks | Gbit/s | us | model | defaults p/c/f | defaults / best | old defaults / best | grid best / best |"
    )
    print("|---:|---:|---:|---|---|---:|---:|---:|")
    for row in rows:
        old = row["old_defaults_vs_best"]
        print(
            f"| {row['ranks']} | {row['bandwidth_bytes_per_s'] * 8e-9:g} | {row['latency_s'] * 1e6:g} | {row['model']} | {row['regime']} "
            f"| {_sizes(list(row['defaults'].values()))} | {row['defaults_vs_best']:.3f} "
            f"| {'-' if old is None else f'{old:.3f}'} | {row['grid_best_vs_best']:.3f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "command": "python benchmarks/choose_defaults.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "algorithm": args.algorithm,
            "rounds": args.rounds,
            "rule": dataclasses.asdict(rule),
            "worst_vs_grid_best": worst,
            "geomean_vs_grid_best": geomean,
            "iterations": args.iterations,
            "warmup": args.warmup,
            "rows": rows,
        }
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
