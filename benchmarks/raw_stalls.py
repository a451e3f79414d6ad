#!/usr/bin/env python3
"""How often the transport stalls by itself: a model's gradient allreduces with raw MPI, no commsched.

Each iteration starts every gradient's nonblocking allreduce at once (backward order, as fifo
without a credit would), waits for all of them, then idles for the compute gap. The slowest
iterations against the median show the hiccups the network and host add on their own, which a
replay's slowest iteration can then be read against.

Usage (root, for the network namespaces)::

    python benchmarks/netrig.py --ranks 3 --rate 1gbit -- $(which python) benchmarks/raw_stalls.py --model resnet50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Times raw allreduce iterations on every rank; rank 0 prints the spread (and JSON)."""
    import numpy as np
    from mpi4py import MPI

    from commsched.bench import report, schedule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="profile whose gradient sizes are reduced")
    parser.add_argument(
        "--scale", type=float, default=16.0, help="divide tensor sizes by this (as the replay)"
    )
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--gap", type=float, default=0.03, help="seconds idle between iterations")
    parser.add_argument(
        "--stall-factor", type=float, default=1.3, help="an iteration this many medians long stalled"
    )
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.stall_factor <= 1.0:
        parser.error("--iterations must be at least 1 and --stall-factor above 1")

    comm = MPI.COMM_WORLD
    layers = schedule.timed_layers(schedule.load_model(args.model), 100.0, args.scale, 1.0)
    counts = [count for layer in reversed(layers) for _, count in reversed(layer.params)]
    sends = [np.ones(count, np.float32) for count in counts]
    receives = [np.empty_like(buffer) for buffer in sends]
    mine = []
    for _ in range(args.iterations):
        comm.Barrier()
        start = time.perf_counter()
        MPI.Request.Waitall([comm.Iallreduce(send, receive) for send, receive in zip(sends, receives)])
        mine.append(time.perf_counter() - start)
        time.sleep(args.gap)
    per_rank = comm.gather(mine)
    if comm.Get_rank() != 0:
        return 0
    # An iteration lasts as long as its slowest rank took.
    periods = [max(times) for times in zip(*per_rank)]
    median = statistics.median(periods)
    stalled = [p for p in periods if p > args.stall_factor * median]
    result = {
        "model": args.model,
        "ranks": comm.Get_size(),
        "gradient_bytes": 4 * sum(counts),
        "iterations": len(periods),
        "median_s": median,
        "mean_s": statistics.fmean(periods),
        "slowest_s": max(periods),
        "stall_factor": args.stall_factor,
        "stalled": len(stalled),
        "stalled_extra_s": sum(p - median for p in stalled),
    }
    print(
        f"# raw MPI: {result['gradient_bytes'] / 2**20:.1f} MiB of {args.model} gradients per iteration"
        f" in {len(counts)} nonblocking allreduces, {result['ranks']} ranks"
    )
    print(
        report.format_table(
            [
                ("median_ms", "median ms", ".1f"),
                ("mean_ms", "mean ms", ".1f"),
                ("slowest_ms", "slowest ms", ".1f"),
                ("stalled", f"> {args.stall_factor:g}x median", "d"),
                ("iterations", "iterations", "d"),
            ],
            [
                {
                    "median_ms": median * 1e3,
                    "mean_ms": result["mean_s"] * 1e3,
                    "slowest_ms": result["slowest_s"] * 1e3,
                    "stalled": len(stalled),
                    "iterations": len(periods),
                }
            ],
        )
    )
    if args.json:
        report.dump_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
