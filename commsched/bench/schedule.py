"""`commsched-bench schedule`: replays a model's training step on the launched ranks.

Compute is emulated by sleeping (the CPU stays free, as it would with a GPU doing
the work); the gradients are real float32 buffers of the profile's sizes that go
through the real transport under the chosen policy. Two loop shapes are replayed:
barrier (the next iteration waits for every reduction) and overlap (each layer's
next forward waits only for its own parameters).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, TextIO

from commsched.bench import calibration, report
from commsched.bench.overhead import measure_collective_overhead, measure_message_cost
from commsched.bench.replay import (
    TimedLayer,
    bucket_limit,
    replay,
    replay_shard,
    round_share,
    shard_sim_layers,
    warm_up,
)
from commsched.config import parse_size, resolve
from commsched.link_defaults import MessageCost, default_inline_bytes, default_sizes

POLICIES = ("priority", "fifo")
MODES = ("overlap", "barrier")
DEFAULT_DEVICE_TFLOPS = 100.0
# What m of the max(c,m), c+m and hidden columns is, in both tools' tables.
LEAST_COMMUNICATION = (
    "m: every gradient byte at the best cost per byte the link showed at any message size (the best "
    "schedule's rate) plus one reduction's latency, the least communication any schedule has; "
    "hidden: the share of m hidden behind compute"
)
# compute = R x communication, in `commsched-bench schedule` and `commsched-sim` alike.
COMPUTE_FLAG = "--compute-over-comm"
_OLD_COMPUTE_FLAG = "--compute-ratio"
_COMPUTE_MEANING = (
    "compute = R x communication: 1 makes them equal, 10 leaves communication a tenth of compute"
)


class _Renamed(argparse.Action):
    """A flag that was renamed: refused with a message that names the new one and what it means."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, meaning: str, **kwargs: Any):
        super().__init__(
            option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
        )
        self.replacement, self.meaning = replacement, meaning

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser.error(
            f"{option_string} was renamed {self.replacement} ({self.meaning}); "
            f"e.g. {self.replacement} {values if values is not None else 1}"
        )


class _Gone(argparse.Action):
    """--cut-at-partition: what --shard does now; refused naming the flag that does the opposite."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.replacement = replacement

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser.error(
            f"{option_string} is gone: --shard cuts parameters over the bucket limit into pieces as "
            f"training does; {self.replacement} replays them whole"
        )


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def add_compute_over_comm(
    parser: argparse.ArgumentParser, communication: str, default: float | None = None
) -> None:
    """--compute-over-comm R (compute = R x `communication`), and --compute-ratio refused with its new name."""
    parser.add_argument(
        COMPUTE_FLAG,
        dest="compute_over_comm",
        type=_positive,
        default=default,
        metavar="R",
        help=f"{_COMPUTE_MEANING}; communication is {communication}",
    )
    parser.add_argument(
        _OLD_COMPUTE_FLAG, action=_Renamed, replacement=COMPUTE_FLAG, meaning=_COMPUTE_MEANING
    )


def load_model(name_or_path: str) -> Any:
    """A ModelProfile by shipped name, or from a JSON file recorded with commsched.bench.models."""
    from commsched.bench import models

    if name_or_path.endswith(".json") or Path(name_or_path).exists():
        return models.load_profile(name_or_path)
    return models.get_profile(name_or_path)


def timed_layers(
    profile: Any, device_tflops: float, scale: float = 1.0, time_scale: float = 1.0
) -> list[TimedLayer]:
    """Layers with compute time from FLOPs at `device_tflops`; sizes and compute divided by `scale`."""
    if device_tflops <= 0 or scale < 1 or time_scale <= 0:
        raise ValueError("need device_tflops > 0, scale >= 1 and time_scale > 0")
    per_flop = time_scale / (device_tflops * 1e12 * scale)
    layers = []
    for layer in profile.layers:
        params = [
            (name, max(1, math.prod(shape) // int(scale) if scale > 1 else math.prod(shape)))
            for name, shape in layer.params
        ]
        layers.append(
            TimedLayer(layer.name, layer.forward_flops * per_flop, layer.backward_flops * per_flop, params)
        )
    return layers


def rescale_compute(layers: list[TimedLayer], factor: float) -> list[TimedLayer]:
    """The same layers with compute times multiplied by `factor`."""
    return [TimedLayer(l.name, l.forward_s * factor, l.backward_s * factor, l.params) for l in layers]


def sim_layers(layers: list[TimedLayer]) -> list[tuple[str, float, float, list[int]]]:
    """The simulator's view of the layers: float32 gradient bytes per parameter."""
    return [(l.name, l.forward_s, l.backward_s, [4 * count for _, count in l.params]) for l in layers]


def compute_s(layers: list[TimedLayer]) -> float:
    """Forward plus backward time of one iteration."""
    return sum(l.forward_s + l.backward_s for l in layers)


def gradient_bytes(layers: list[TimedLayer]) -> int:
    """Total float32 gradient bytes of one iteration."""
    return sum(4 * count for l in layers for _, count in l.params)


_SCALED_SETTINGS = ("partition_bytes", "credit_bytes", "fusion_bytes", "inline_bytes")


def _replay_sizes(
    args: argparse.Namespace,
    ranks: int,
    bandwidth: float,
    latency_s: float,
    overhead_s: float = 0.0,
    message_cost: MessageCost | None = None,
) -> dict[str, Any]:
    """Sizes for the replay: each flag as given; else, unless COMMSCHED_* sets it, the default
    commsched fits to this link (link_defaults.default_sizes) divided by --scale.

    Shrinking tensors by --scale without shrinking the chunk sizes would change how many
    chunks each tensor has, so the replay would no longer stand for the full-size model.
    commsched's fixed cost per collective (`overhead_s`) does not shrink with the bytes: against
    the full-size model's collectives it weighs --scale times as much. So does the transport's own
    fixed cost per large message (`message_cost`, probed on fast links: link_probe.probe_message_cost),
    whose rate is the one partitions move at. A size fitted as 0 (off) stays 0.
    """
    given = {name: getattr(args, name) for name in _SCALED_SETTINGS}
    # A partition set by flag or variable is kept; the fitted credit then counts whole ones of it.
    partition = given["partition_bytes"] or os.environ.get("COMMSCHED_PARTITION_BYTES")
    full_partition = parse_size(partition) * args.scale if partition else None
    fixed_s = message_cost.fixed_s if message_cost else 0.0
    fitted: dict[str, int] = default_sizes(
        ranks,
        bandwidth,
        latency_s,
        partition_bytes=int(full_partition or 0) or None,
        collective_overhead_s=(overhead_s + fixed_s) * args.scale,
        message_bandwidth_bytes_per_s=message_cost.bandwidth_bytes_per_s if message_cost else None,
    )
    credit = given["credit_bytes"] or os.environ.get("COMMSCHED_CREDIT_BYTES")
    full_credit = int(parse_size(credit) * args.scale) if credit else fitted["credit_bytes"]
    fitted["inline_bytes"] = default_inline_bytes(ranks, bandwidth, latency_s, full_credit)
    sizes: dict[str, Any] = {}
    for name in _SCALED_SETTINGS:
        if given[name] is not None or os.environ.get(f"COMMSCHED_{name.upper()}"):
            sizes[name] = given[name]  # None: init() reads the variable
        else:
            sizes[name] = max(1, int(fitted[name] / args.scale)) if fitted[name] else 0
    return sizes


def run(args: argparse.Namespace) -> int:
    """Replays the profile under every requested policy and mode; rank 0 prints the report."""
    if args.shard and args.autotune:
        print("commsched-bench schedule: --shard replays fixed settings; drop --autotune", file=sys.stderr)
        return 2
    import numpy as np
    from mpi4py import MPI

    import commsched
    from commsched import autotune
    from commsched.bench import sim_cli

    comm = MPI.COMM_WORLD
    ranks, rank = comm.Get_size(), comm.Get_rank()
    if ranks < 2:
        print(
            "commsched-bench schedule replays data-parallel training: launch it on 2 or more ranks, "
            "e.g. mpiexec -n 2 commsched-bench schedule --model vgg16",
            file=sys.stderr,
        )
        return 2
    profile = load_model(args.model)
    layers = timed_layers(profile, args.device_tflops, args.scale, args.time_scale)
    total_bytes = gradient_bytes(layers)
    comm_s = calibration.raw_allreduce_s(comm, total_bytes, args.calibration_repeats)
    small_s = calibration.raw_allreduce_s(comm, 4, 20)
    time_scale = args.time_scale
    if args.compute_over_comm:
        # Sets compute to a chosen multiple of the measured communication time.
        factor = args.compute_over_comm * comm_s / compute_s(layers)
        layers = rescale_compute(layers, factor)
        time_scale *= factor
    bandwidth = 2.0 * (ranks - 1) / ranks * total_bytes / comm_s  # payload bytes per second on the wire
    latency = small_s / (2 * (ranks - 1))
    overhead_s = measure_collective_overhead(comm)
    message_cost = measure_message_cost(comm, bandwidth, latency)
    sizes = _replay_sizes(args, ranks, bandwidth, latency, overhead_s, message_cost)
    credit = resolve({k: v for k, v in sizes.items() if v is not None}).credit_for(ranks)
    size_costs = (
        calibration.measure_size_costs(comm, total_bytes, credit, comm_s, small_s, args.calibration_repeats)
        if args.size_costs
        else []
    )
    whole = bool(args.shard and args.whole_params)
    grads = [
        np.random.default_rng(rank).random(count, dtype=np.float32) for l in layers for _, count in l.params
    ]
    # --autotune adds one run per mode that starts from the defaults and tunes during the
    # warm-up; the fixed policies still run, for the baseline the speedup is measured against.
    runs = [(p, args.modes, False) for p in args.policies]
    runs += [("autotune", [m], True) for m in args.modes] if args.autotune else []
    progress = report.Progress(
        sum(len(m) * (1 if tuned else min(args.rounds, args.iterations)) for _, m, tuned in runs),
        "schedule",
        enabled=None if rank == 0 else False,
    )
    periods: dict[tuple[str, str], list[float]] = {}
    used_by: dict[tuple[str, str], dict[str, Any]] = {}
    settings: dict[str, Any] = {}
    # The sizes scaled from commsched's defaults stand for the defaults: with --autotune the
    # search starts there and may change them, as it would change the defaults themselves.
    starting = [
        name
        for name in _SCALED_SETTINGS
        if name in autotune.FIELDS and getattr(args, name) is None and sizes[name] is not None
    ]
    warm_up(layers, grads, bandwidth, latency, sizes, args)
    # Rounds interleave the policies, so a host that speeds up or slows down during the run
    # (other jobs, frequency) weighs on each alike; a tuned run keeps its iterations together.
    for round_index in range(args.rounds):
        for policy, modes, tuned in runs:
            count = args.iterations if tuned else round_share(args.iterations, args.rounds, round_index)
            if count == 0 or (tuned and round_index > 0):
                continue
            commsched.init(
                policy=None if tuned else policy,
                autotune=False if tuned else None,
                transport="mpi",
                cycle_time=args.cycle_time,
                # The link as measured here: the sizes are given, but the core also paces its tests of
                # collectives in flight by the per-message latency (COMMSCHED_POLL_INTERVAL unset).
                link_bandwidth=bandwidth,
                link_latency=latency,
                **sizes,
            )
            if tuned:
                autotune.start(starting=starting)
            settings = settings or commsched.config()  # the header shows the first run's settings
            for mode in modes:
                comm.Barrier()
                if args.shard:  # cut into training's pieces and buckets at the settings init() took
                    measured = replay_shard(layers, grads, mode, count, args.warmup, whole)
                else:
                    measured = replay(layers, grads, mode, count, args.warmup)
                periods.setdefault((policy, mode), []).extend(measured)
                used_by[(policy, mode)] = commsched.config()  # what the tuner chose, for the simulator
                progress.step(f"{policy}/{mode}")
            commsched.shutdown()
    rows = []
    used = []
    for (policy, mode), measured in periods.items():
        # The mean is what a run takes; the median and the slowest iteration show stalls.
        rows.append(
            {
                "policy": policy,
                "mode": mode,
                "iteration_s": comm.allreduce(statistics.fmean(measured), op=MPI.MAX),
                "median_iteration_s": comm.allreduce(statistics.median(measured), op=MPI.MAX),
                "slowest_iteration_s": comm.allreduce(max(measured), op=MPI.MAX),
                # Each measured iteration on its slowest rank, so a stall can be placed.
                "iterations_s": calibration.slowest_per_iteration(comm, measured),
            }
        )
        used.append(used_by[(policy, mode)])
    if rank != 0:
        return 0
    spec = sim_layers(layers)

    def simulated(layout: list[tuple[str, float, float, list[int]]], s: dict[str, Any], mode: str) -> Any:
        return sim_cli.predict(
            layout,
            ranks,
            bandwidth,
            latency,
            s,
            [s["policy"]],
            [mode],
            size_costs=size_costs,
            shard=args.shard,
        )[0]

    # The split replays training's buckets, and the simulator follows them; best for the split
    # stays per tensor (each gradient reduce-scattered the moment it is ready), the lower bound.
    predicted = [
        simulated(
            shard_sim_layers(layers, bucket_limit(s, ranks), ranks, whole) if args.shard else spec,
            s,
            row["mode"],
        )
        for s, row in zip(used, rows)
    ]
    best_s = simulated(spec, used[0], rows[0]["mode"])["best_s"] if args.shard else predicted[0]["best_s"]
    compute = compute_s(layers)
    # m of the columns, as in commsched-sim: every gradient byte at the best cost per byte the link
    # showed (the size costs), one reduction's latency: no schedule communicates in less, so
    # max(c, m) <= best. The raw allreduce of everything (comm_s) can be slower than commsched's
    # partitioned collectives, and is kept in the header.
    least_s = predicted[0]["communication_s"]
    baseline = next((r["iteration_s"] for r in rows if (r["policy"], r["mode"]) == ("fifo", "barrier")), None)
    for row, sim, settings_used in zip(rows, predicted, used):
        row.update(
            compute_s=compute,
            communication_s=least_s,
            bound_s=max(compute, least_s),
            best_s=best_s,
            sum_s=compute + least_s,
            sim_s=sim["iteration_s"],
        )
        row["hidden"] = min(1.0, max(0.0, (compute + least_s - row["iteration_s"]) / least_s))
        row["vs_best"] = row["iteration_s"] / best_s
        row["speedup"] = baseline / row["iteration_s"] if baseline else None
        # Against the median: raw MPI on the rig stalls 30-100 ms in ~3% of iterations by itself
        # (benchmarks/raw_stalls.py), a hiccup neither the scheduler nor the network model causes.
        row["sim_error"] = (sim["iteration_s"] - row["median_iteration_s"]) / row["median_iteration_s"]
        row["sim_error_vs_mean"] = (sim["iteration_s"] - row["iteration_s"]) / row["iteration_s"]
        if row["policy"] == "autotune":
            row["settings"] = {name: settings_used[name] for name in autotune.FIELDS}
    header = {
        "model": profile.name,
        "ranks": ranks,
        "shard": args.shard,
        "whole_params": whole,
        "scale": args.scale,
        "device_tflops": args.device_tflops,
        "time_scale": time_scale,
        "gradient_bytes": total_bytes,
        "compute_s": compute,
        "communication_s": comm_s,
        "least_communication_s": least_s,
        "bandwidth_bytes_per_s": bandwidth,
        "latency_s": latency,
        "collective_overhead_s": overhead_s,
        # The transport's rate and fixed cost per allreduce at 1-16 MiB (None: not probed, a slow link).
        "message_cost": dataclasses.astuple(message_cost) if message_cost else None,
        "size_costs": size_costs,
        "settings": settings,
        "iterations": args.iterations,
        "warmup": args.warmup,
    }
    print_schedule(header, rows, report.text_stream(args.json))
    if args.json:
        report.dump_json({"run": header, "results": rows}, args.json)
    if args.plot:
        report.plot_iterations(
            rows, args.plot, f"{profile.name} on {ranks} ranks (replay)", ("policy", "mode")
        )
    return 0


COLUMNS: list[report.Column] = [
    ("policy", "policy", ""),
    ("mode", "mode", ""),
    ("iteration_ms", "iter ms", ".1f"),
    ("slowest_ms", "slowest ms", ".1f"),
    ("bound_ms", "max(c,m) ms", ".1f"),
    ("best_ms", "best ms", ".1f"),
    ("sum_ms", "c+m ms", ".1f"),
    ("hidden_pct", "hidden %", ".0f"),
    ("vs_best", "x best", ".3f"),
    ("speedup", "vs fifo/barrier", ".3f"),
    ("sim_ms", "sim ms", ".1f"),
    ("sim_err_pct", "sim err %", "+.1f"),
]


def print_schedule(header: dict[str, Any], rows: list[dict[str, Any]], out: TextIO | None = None) -> None:
    """Prints the replay's settings and one row per policy and mode (to stdout, or `out`)."""
    out = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=out)

    split = (
        ", reduce-scatter in backward and all-gather after the step (ZeRO-2)" if header.get("shard") else ""
    )
    if header.get("whole_params"):
        split += ", each parameter whole"
    say(
        f"# model {header['model']} on {header['ranks']} ranks{split}, sizes and compute scaled down by {header['scale']:g}"
        f" ({report.human_size(header['gradient_bytes'])} of gradients per iteration)"
    )
    say(
        f"# compute {header['compute_s'] * 1e3:.1f} ms (FLOPs at {header['device_tflops']:g} TFLOP/s,"
        f" time scale {header['time_scale']:.4g}); communication {header['communication_s'] * 1e3:.1f} ms"
        f" (raw MPI allreduce of all gradients, {header['bandwidth_bytes_per_s'] * 8 / 1e9:.3f} Gbit/s on the wire,"
        f" {header['latency_s'] * 1e6:.0f} us per message; commsched adds"
        f" {header.get('collective_overhead_s', 0.0) * 1e6:.0f} us per collective: for training on these hosts,"
        f" COMMSCHED_COLLECTIVE_OVERHEAD={round(header.get('collective_overhead_s', 0.0) * 1e6)}us)"
    )
    if header.get("message_cost"):
        rate, fixed_s = header["message_cost"]
        say(
            f"# allreduces of 1-16 MiB: {rate * 8 / 1e9:.3f} Gbit/s plus {fixed_s * 1e6:.0f} us each beyond the"
            " latencies (partitions and fusion cover this and commsched's cost)"
        )
    if header["size_costs"]:
        costs = ", ".join(f"{report.human_size(size)} {factor:.2f}" for size, factor in header["size_costs"])
        say(f"# simulator's cost per byte by message size, relative to that: {costs}")
    chosen = header["settings"]
    say(
        f"# partition {report.human_size(chosen['partition_bytes'])}, credit {report.human_size(chosen['credit_bytes'])},"
        f" fusion {report.human_size(chosen['fusion_bytes'])} (sizes not given are commsched's defaults for this link / scale)"
    )
    table = [
        dict(
            report.timing_fields(row),
            slowest_ms=row["slowest_iteration_s"] * 1e3,
            sim_ms=row["sim_s"] * 1e3,
            sim_err_pct=row["sim_error"] * 100,
        )
        for row in rows
    ]
    say(report.format_table(COLUMNS, table))
    say("# slowest: the slowest measured iteration; sim err: the simulator against the median iteration")
    if "least_communication_s" in header:
        say(f"# {LEAST_COMMUNICATION} ({header['least_communication_s'] * 1e3:.1f} ms)")
    for row in rows:
        if "settings" in row:
            used = row["settings"]
            say(
                f"# autotune chose for {row['mode']}: {used['policy']}, partition {report.human_size(used['partition_bytes'])},"
                f" credit {report.human_size(used['credit_bytes'])}, fusion {report.human_size(used['fusion_bytes'])}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `schedule` subcommand's flags."""
    parser.add_argument(
        "--model", required=True, help="vgg16, resnet50, bert-base, gpt2-medium or a profile .json"
    )
    parser.add_argument("--policies", type=_list(POLICIES), default=list(POLICIES), help="comma list")
    parser.add_argument(
        "--modes", type=_list(MODES), default=list(MODES), help="comma list: overlap, barrier"
    )
    parser.add_argument(
        "--iterations", type=_count, default=5, help="measured iterations per policy and mode"
    )
    parser.add_argument("--warmup", type=int, default=2, help="iterations before measuring")
    parser.add_argument(
        "--rounds",
        type=_count,
        default=3,
        help="interleave the policies in this many rounds, the iterations spread over them (default 3)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=16.0,
        help="divide tensor sizes and compute by this, so the replay fits a small machine",
    )
    parser.add_argument(
        "--device-tflops",
        type=float,
        default=DEFAULT_DEVICE_TFLOPS,
        help="device rate that turns the profile's FLOPs into compute time",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every compute time by this")
    add_compute_over_comm(
        parser, "one raw MPI allreduce of all gradients, measured first (overrides --time-scale)"
    )
    parser.add_argument("--partition-bytes", default=None, help="e.g. 4MiB (default: commsched's)")
    parser.add_argument("--credit-bytes", default=None, help="e.g. 8MiB")
    parser.add_argument("--fusion-bytes", default=None, help="e.g. 1MiB")
    parser.add_argument("--inline-bytes", default=None, help="e.g. 512 (tensors up to it ride in the round)")
    parser.add_argument("--cycle-time", default=None, help="core cycle time, e.g. 1ms")
    parser.add_argument(
        "--autotune",
        action="store_true",
        help="add one run per mode that tunes the settings online during the warm-up (use e.g. --warmup 150)",
    )
    parser.add_argument(
        "--calibration-repeats", type=int, default=3, help="raw allreduces timed to measure comm"
    )
    parser.add_argument(
        "--size-costs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the cost per byte by message size, for the simulator's column and for m and best "
        "(a few seconds; without it every size costs what the raw allreduce of all gradients does)",
    )
    parser.add_argument(
        "--shard",
        action="store_true",
        help="ZeRO-2's split: reduce-scatter each gradient in backward, all-gather each parameter after "
        "the step (overlap: each layer's forward waits for its own; barrier: for all); best is the split's",
    )
    parser.add_argument(
        "--whole-params",
        action="store_true",
        help="with --shard: send each parameter whole, however big (the layout before shard=True cut "
        "parameters over the bucket limit into pieces), to compare with",
    )
    parser.add_argument("--cut-at-partition", action=_Gone, replacement="--whole-params")
    parser.add_argument(
        "--json", metavar="PATH", help="write results as JSON ('-': to stdout, and the table to stderr)"
    )
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart")


def _list(options: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        values = [value.strip() for value in text.split(",") if value.strip()]
        bad = [value for value in values if value not in options]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(options)}")
        return values

    return parse
