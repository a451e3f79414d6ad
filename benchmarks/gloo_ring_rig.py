#!/usr/bin/env python3
"""Reduce-scatter, all-gather and allreduce over commsched's native Gloo transport, timed on the rig.

A rank program: run it under the shaped-link rig, once with the ring (the default) and once with
Gloo's own collectives, and compare the medians against the link's time for the bytes::

    python benchmarks/netrig.py --ranks 2 --rate 1gbit --launcher torch -- python benchmarks/gloo_ring_rig.py
    COMMSCHED_GLOO_RING=0 python benchmarks/netrig.py --ranks 2 --rate 1gbit --launcher torch -- \\
        python benchmarks/gloo_ring_rig.py

Sizes are per rank's input for a reduce-scatter and an allreduce, of the whole output for an
all-gather (float32); "many" submits several at once, as a training step's buckets are. Rank 0
prints one line per case: median, min and max of --repeats timed runs, in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

import commsched


def timed(rank: int, what: str, run: Callable[[], None], repeats: int) -> None:
    """Runs `run` once to warm up, then `repeats` times between barriers; rank 0 prints the times."""
    run()
    times = []
    for _ in range(repeats):
        commsched.barrier()
        started = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - started))
    if rank == 0:
        ring = os.environ.get("COMMSCHED_GLOO_RING", "1")
        print(
            f"ring={ring} ranks={commsched.size()} {what:36s} median {statistics.median(times):7.1f} "
            f"min {min(times):7.1f} max {max(times):7.1f} ms",
            flush=True,
        )


def main() -> None:
    """Times every case on this rank's part of the job."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="16,4,1,0.25", help="MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    commsched.init(transport="gloo", partition_bytes="64MiB")  # one collective per call, not partitions
    rank, size = commsched.rank(), commsched.size()
    for mib in (float(s) for s in args.sizes.split(",")):
        elements = int(mib * 2**18) // size * size
        whole = np.ones((size, elements // size), np.float32)
        part = np.ones(elements // size, np.float32)
        flat = np.ones(elements, np.float32)
        cases = (
            ("reducescatter", lambda w=whole, m=mib: commsched.reducescatter(w, name=f"rs.{m}")),
            ("allgather", lambda p=part, m=mib: commsched.allgather(p, name=f"ag.{m}")),
            ("allreduce", lambda f=flat, m=mib: commsched.allreduce(f, name=f"ar.{m}")),
        )
        for kind, run in cases:
            timed(rank, f"{kind} {mib:g} MiB", run, args.repeats)
    # A training step's buckets: 16 reduce-scatters of 1 MiB in flight together, then 16 all-gathers.
    pieces = [np.ones((size, 2**18 // size), np.float32) for _ in range(16)]
    shards = [np.ones(2**18 // size, np.float32) for _ in range(16)]

    def many(kind: str) -> None:
        if kind == "rs":
            handles = [commsched.reducescatter_async(p, name=f"many.rs.{i}") for i, p in enumerate(pieces)]
        else:
            handles = [commsched.allgather_async(s, name=f"many.ag.{i}") for i, s in enumerate(shards)]
        for handle in handles:
            handle.wait()

    timed(rank, "many: 16 x reducescatter 1 MiB", lambda: many("rs"), args.repeats)
    timed(rank, "many: 16 x allgather 1 MiB", lambda: many("ag"), args.repeats)
    commsched.shutdown()


if __name__ == "__main__":
    main()
