"""`commsched-sim`: predicts iteration times with the real scheduling core on a virtual clock.

The C++ Scheduler that runs in training is driven by a modelled network (per-message
latency, bandwidth, the allreduce algorithm for N ranks, collectives in flight sharing the
link) and by a replayed model profile, for any number of ranks and any bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from commsched._core import simulate, simulate_ideal
from commsched.bench import report, schedule
from commsched.collective_model import ALGORITHMS
from commsched.config import parse_duration, parse_size
from commsched.link_defaults import ROUNDS, default_sizes

DEFAULT_RANKS = "2,4,8,16,64,256,1024"


def parse_rate(text: str) -> float:
    """A link rate such as 10gbit, 400mbit or 1.25GB/s, in bytes per second."""
    lowered = text.strip().lower().replace("/s", "ps")
    for suffix, factor in (
        ("tbit", 1e12 / 8),
        ("gbit", 1e9 / 8),
        ("mbit", 1e6 / 8),
        ("kbit", 1e3 / 8),
        ("gbps", 1e9),
        ("mbps", 1e6),
        ("kbps", 1e3),
        ("bps", 1.0),
        ("bit", 1 / 8),
    ):
        if lowered.endswith(suffix):
            try:
                return float(lowered[: -len(suffix)]) * factor
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"{text!r} is not a rate; use e.g. 10gbit, 400mbit or 1.25GBps")


def parse_size_costs(text: str) -> list[tuple[int, float]]:
    """'64KiB:0.6,1MiB:0.8' -> [(65536, 0.6), (1048576, 0.8)], in increasing size."""
    costs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        size, sep, factor = item.partition(":")
        try:
            cost = (parse_size(size), float(factor))
        except ValueError:
            cost = (0, 0.0)
        if not sep or cost[0] <= 0 or not cost[1] > 0:
            raise ValueError(
                f"size cost {item!r} is not SIZE:FACTOR with both above 0; e.g. --size-costs 64KiB:0.6,1MiB:0.8"
            )
        costs.append(cost)
    costs.sort()
    if len({size for size, _ in costs}) != len(costs):
        raise ValueError(f"--size-costs {text!r} gives a size twice")
    return costs


def predict(
    layers: list[tuple[str, float, float, list[int]]],
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    settings: dict[str, Any],
    policies: Sequence[str],
    modes: Sequence[str],
    exchange_s: float = -1.0,
    iterations: int = 6,
    warmup: int = 2,
    link: str = "fifo",
    size_costs: Sequence[tuple[int, float]] = (),
    scale: float = 1.0,
    algorithm: str = "ring",
    rounds: str = "channel",
    shard: bool = False,
) -> list[dict[str, Any]]:
    """One row per (policy, mode): simulated iteration time with the bound and the best schedule.

    `size_costs` is [(bytes, factor)]: the cost per byte of a collective of that size relative to
    the bandwidth (see parse_size_costs). A size of None is commsched's default for the link
    (link_defaults.default_sizes), for a model `scale` times larger, divided by `scale`, as the replay does.
    The rows' communication_s (m), bound_s (max(c, m)), sum_s (c + m) and hidden count every byte at
    the best cost per byte the size costs give, as the best schedule does, so that
    bound_s <= best_s <= iteration_s: one allreduce of everything, at its own size's cost, can take
    longer than the partitioned collectives the scheduler sends.
    `algorithm` is the allreduce the transport runs (collective_model.ALGORITHMS); the defaults and
    the best schedule use the same one. `rounds` is where agreement rounds travel: "channel" (their
    own connection, the default across hosts) or "data" (behind the collectives' bytes); the
    defaults follow it as init() does. `shard` replays ZeRO-2's split (reduce-scatter in backward,
    all-gather after the step, each half an allreduce) against the best schedule for the split; at
    one rank nothing crosses a wire and every row is the compute.
    """
    if ranks == 1:
        return _one_rank_rows(layers, settings, policies, modes, bandwidth_bytes_per_s, algorithm)
    given_partition = settings.get("partition_bytes")
    link_defaults = default_sizes(
        ranks,
        bandwidth_bytes_per_s,
        latency_s,
        partition_bytes=int(given_partition * scale) if given_partition else None,
        algorithm=algorithm,
        rounds=rounds,
    )
    settings = {
        **settings,
        **{name: max(1, int(v / scale)) for name, v in link_defaults.items() if settings.get(name) is None},
    }
    credit = int(settings["credit_bytes"])
    # The best schedule moves every byte at the best rate the link showed at any message size, and
    # pays the algorithm's latency once per reduction.
    best_rate = bandwidth_bytes_per_s / min([1.0] + [factor for _, factor in size_costs])
    best = simulate_ideal(layers, ranks, best_rate, iterations, warmup, latency_s, algorithm, shard)
    rows = []
    for policy in policies:
        for mode in modes:
            result = simulate(
                layers,
                ranks,
                bandwidth_bytes_per_s,
                latency_s,
                policy,
                int(settings["partition_bytes"]),
                credit,
                int(settings["fusion_bytes"]),
                mode,
                float(settings["cycle_time"]),
                exchange_s,
                iterations,
                warmup,
                link,
                list(size_costs),
                algorithm,
                rounds,
                shard,
            )
            result.pop("iteration_starts_s")
            # The columns' c and m: those of the best schedule (see the docstring).
            result.update({name: best[name] for name in ("compute_s", "communication_s", "bound_s", "sum_s")})
            comm = result["communication_s"]
            hidden = (result["sum_s"] - result["iteration_s"]) / comm if comm else 1.0
            rows.append(
                dict(
                    result,
                    policy=policy,
                    mode=mode,
                    ranks=ranks,
                    partition_bytes=int(settings["partition_bytes"]),
                    credit_bytes=credit,
                    fusion_bytes=int(settings["fusion_bytes"]),
                    bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                    algorithm=algorithm,
                    best_s=best["iteration_s"],
                    hidden=min(1.0, max(0.0, hidden)),
                )
            )
    return _compare(rows)


def _compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    baseline = {(r["policy"], r["mode"]): r["iteration_s"] for r in rows}.get(("fifo", "barrier"))
    for row in rows:
        row["vs_best"] = row["iteration_s"] / row["best_s"]
        row["speedup"] = baseline / row["iteration_s"] if baseline else None
    return rows


def _one_rank_rows(
    layers: list[tuple[str, float, float, list[int]]],
    settings: dict[str, Any],
    policies: Sequence[str],
    modes: Sequence[str],
    bandwidth_bytes_per_s: float,
    algorithm: str,
) -> list[dict[str, Any]]:
    # One rank holds every shard: no collective moves a byte, so each schedule is the compute.
    compute = sum(forward + backward for _, forward, backward, _ in layers)
    zero = {"launches": 0, "fused_launches": 0, "cycles": 0, "max_bytes_in_flight": 0, "communication_s": 0.0}
    sizes = {
        name: int(settings.get(name) or 0) for name in ("partition_bytes", "credit_bytes", "fusion_bytes")
    }
    rows = [
        dict(
            zero,
            **sizes,
            iteration_s=compute,
            compute_s=compute,
            bound_s=compute,
            sum_s=compute,
            best_s=compute,
            hidden=1.0,
            policy=policy,
            mode=mode,
            ranks=1,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            algorithm=algorithm,
        )
        for policy in policies
        for mode in modes
    ]
    return _compare(rows)


# The split's collectives as the simulator costs them: half of an allreduce of these algorithms.
SHARD_ALGORITHMS = ("ring", "halving-doubling")

COLUMNS: list[report.Column] = [
    ("ranks", "ranks", "d"),
    ("gbit", "Gbit/s", ".3g"),
    ("policy", "policy", ""),
    ("mode", "mode", ""),
    ("iteration_ms", "iter ms", ".2f"),
    ("bound_ms", "max(c,m) ms", ".2f"),
    ("best_ms", "best ms", ".2f"),
    ("sum_ms", "c+m ms", ".2f"),
    ("hidden_pct", "hidden %", ".0f"),
    ("vs_best", "x best", ".3f"),
    ("speedup", "vs fifo/barrier", ".3f"),
    ("launches", "launches", "d"),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commsched-sim", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="vgg16, resnet50, bert-base, gpt2-medium or a profile .json"
    )
    parser.add_argument(
        "--ranks", default=DEFAULT_RANKS, help=f"comma list of rank counts (default {DEFAULT_RANKS})"
    )
    parser.add_argument(
        "--bandwidth", default="10gbit", help="comma list of link rates, e.g. 1gbit,10gbit,100gbit"
    )
    parser.add_argument("--latency", default="20us", help="per-message latency, e.g. 20us")
    parser.add_argument(
        "--exchange",
        default=None,
        help="agreement exchange time (default: latency up to 8 ranks, ceil(log2 n) * latency beyond)",
    )
    parser.add_argument(
        "--link",
        choices=("fifo", "fair"),
        default="fifo",
        help="how collectives in flight share a link: in start order (one TCP stream, MPI) or equally",
    )
    parser.add_argument(
        "--algorithm",
        default="ring",
        help="the allreduce the transport runs: ring (Gloo, gRPC), halving-doubling (Rabenseifner), "
        "recursive-doubling, tree (NCCL's double binary tree), or a library's choice by size: "
        "mpich (recursive doubling up to 2 KiB, halving-doubling above) or nccl (the faster of ring and tree)",
    )
    parser.add_argument(
        "--rounds",
        choices=ROUNDS,
        default="channel",
        help="where agreement rounds travel: channel (their own connection: the control channel across "
        "hosts, the default) or data (queued behind the collectives' bytes, COMMSCHED_CONTROL_CHANNEL=transport); "
        "the default sizes follow it",
    )
    parser.add_argument(
        "--size-costs",
        default="",
        help="measured cost per byte by collective size, relative to --bandwidth, e.g. 64KiB:0.6,4MiB:0.9 "
        "(commsched-bench schedule measures it; linear in log size between, flat outside); the best "
        "schedule and m move every byte at the smallest factor",
    )
    parser.add_argument(
        "--device-tflops",
        type=float,
        default=schedule.DEFAULT_DEVICE_TFLOPS,
        help=f"device rate that turns the profile's FLOPs into compute time (default {schedule.DEFAULT_DEVICE_TFLOPS:g})",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every compute time by this")
    parser.add_argument("--scale", type=float, default=1.0, help="divide tensor sizes and compute by this")
    schedule.add_compute_over_comm(
        parser,
        "one ring allreduce of all gradients, its bandwidth term (2(n-1)/n of the bytes at the link rate), "
        "as commsched-bench schedule measures it: ignores --bandwidth and picks that rate per rank count",
    )
    parser.add_argument(
        "--policies",
        type=schedule._list(schedule.POLICIES),
        default=list(schedule.POLICIES),
        help="comma list: priority, fifo (default both)",
    )
    parser.add_argument(
        "--modes",
        type=schedule._list(schedule.MODES),
        default=list(schedule.MODES),
        help="comma list: overlap (each layer's next forward waits for its own parameters), barrier "
        "(the next iteration waits for every reduction); default both",
    )
    link_default = "default: what commsched fits to each link (ranks, bandwidth, latency), as init() does"
    parser.add_argument("--partition-bytes", default=None, help=f"e.g. 4MiB; {link_default}")
    parser.add_argument("--credit-bytes", default=None, help=f"e.g. 16MiB; {link_default}")
    parser.add_argument("--fusion-bytes", default=None, help=f"e.g. 4MiB; {link_default}")
    parser.add_argument(
        "--cycle-time", default="1ms", help="the core's cycle time (COMMSCHED_CYCLE_TIME; default 1ms)"
    )
    parser.add_argument(
        "--iterations", type=int, default=6, help="simulated iterations averaged per row (default 6)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="simulated iterations before those measured (default 2)"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write results as JSON ('-': to stdout, and the table to stderr)"
    )
    parser.add_argument(
        "--shard",
        action="store_true",
        help="ZeRO-2's split: each gradient reduce-scattered in backward, each parameter all-gathered after "
        "the step in forward order (overlap: each layer's forward waits for its own; barrier: for all), each "
        "half an allreduce; best is the best schedule for the split; --ranks may include 1",
    )
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of commsched-sim."""
    args = _parser().parse_args(argv)
    try:
        settings = {
            "partition_bytes": parse_size(args.partition_bytes) if args.partition_bytes else None,
            "credit_bytes": parse_size(args.credit_bytes) if args.credit_bytes else None,
            "fusion_bytes": parse_size(args.fusion_bytes) if args.fusion_bytes else None,
            "cycle_time": parse_duration(args.cycle_time),
        }
        latency = parse_duration(args.latency)
        exchange = parse_duration(args.exchange) if args.exchange else -1.0
        rank_counts = [int(n) for n in args.ranks.split(",")]
        if min(rank_counts) < (1 if args.shard else 2):
            least = (
                "1 or more ranks in each count with --shard"
                if args.shard
                else "2 or more ranks in each count"
            )
            raise ValueError(f"--ranks {args.ranks!r}: the simulator needs {least}")
        rates = [parse_rate(r) for r in args.bandwidth.split(",")]
        size_costs = parse_size_costs(args.size_costs)
        if args.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {args.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if args.shard and args.algorithm not in SHARD_ALGORITHMS:
            raise ValueError(
                f"--shard models reduce-scatter and all-gather as half of a ring or halving-doubling allreduce; "
                f"--algorithm {args.algorithm} has no such half: use --algorithm {' or '.join(SHARD_ALGORITHMS)}"
            )
    except (ValueError, argparse.ArgumentTypeError) as error:
        print(f"commsched-sim: {error}", file=sys.stderr)
        return 2
    profile = schedule.load_model(args.model)
    layers = schedule.timed_layers(profile, args.device_tflops, args.scale, args.time_scale)
    spec = schedule.sim_layers(layers)
    total = schedule.gradient_bytes(layers)
    compute = schedule.compute_s(layers)
    rows: list[dict[str, Any]] = []
    for ranks in rank_counts:
        if args.compute_over_comm:
            # compute = R x comm, comm the bandwidth term of one ring allreduce of every gradient (as
            # commsched-bench schedule measures it: a raw allreduce of all gradients).
            rates_here = [2.0 * (ranks - 1) / ranks * total * args.compute_over_comm / compute]
        else:
            rates_here = rates
        for rate in rates_here:
            rows += predict(
                spec,
                ranks,
                rate,
                latency,
                settings,
                args.policies,
                args.modes,
                exchange,
                args.iterations,
                args.warmup,
                args.link,
                size_costs,
                args.scale,
                args.algorithm,
                args.rounds,
                args.shard,
            )
    out = report.text_stream(args.json)
    print(
        f"# {profile.name}: {report.human_size(total)} of gradients, compute {compute * 1e3:.2f} ms per iteration "
        f"(FLOPs at {args.device_tflops:g} TFLOP/s, time scale {args.time_scale:g}, scale {args.scale:g}); "
        f"latency {latency * 1e6:g} us, {args.algorithm} "
        f"{'reduce-scatter in backward + all-gather after the step (ZeRO-2)' if args.shard else 'allreduce'}, "
        "agreement rounds "
        f"{'on their own channel' if args.rounds == 'channel' else 'behind the data'}; simulated with the real scheduler",
        file=out,
    )
    sizes = {
        (row["ranks"], row["bandwidth_bytes_per_s"]): "/".join(
            report.human_size(row[name]) for name in ("partition_bytes", "credit_bytes", "fusion_bytes")
        )
        for row in rows
        if row["ranks"] > 1  # one rank sends nothing: no sizes to show
    }
    if sizes:
        print(
            "# partition/credit/fusion: "
            + ", ".join(f"{text} at {n} ranks, {rate * 8e-9:.3g} Gbit/s" for (n, rate), text in sizes.items())
            + (
                ""
                if args.partition_bytes and args.credit_bytes and args.fusion_bytes
                else " (unset: commsched's for the link)"
            ),
            file=out,
        )
    table = [dict(report.timing_fields(row), gbit=row["bandwidth_bytes_per_s"] * 8 / 1e9) for row in rows]
    print(report.format_table(COLUMNS, table), file=out)
    print(f"# {schedule.LEAST_COMMUNICATION}", file=out)
    if args.json:
        report.dump_json(
            {
                "model": profile.name,
                "compute_s": compute,
                "gradient_bytes": total,
                "latency_s": latency,
                "algorithm": args.algorithm,
                "rounds": args.rounds,
                "shard": args.shard,
                "size_costs": size_costs,
                "settings": settings,
                "results": rows,
            },
            args.json,
        )
    if args.plot:
        labels = [dict(row, label=f"{row['ranks']}r {row['policy']}\n{row['mode']}") for row in rows]
        report.plot_iterations(labels, args.plot, f"{profile.name} (simulated)", ("label",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
