"""A short training loop under COMMSCHED_AUTOTUNE=1: every iteration's sums checked against numpy.

Run on 2+ ranks by tests/test_autotune_ranks.py. Each rank's data is drawn from a seed of
(rank, iteration, tensor), so every rank can compute the exact expected sums locally.
Prints one JSON line per rank with what it saw.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import commsched
from commsched import autotune

# (element count, dtype); forward order, so priority = index.
TENSORS = [
    (300, np.int64),
    (70_000, np.float32),
    (5_000, np.int32),
    (200_000, np.float32),
    (40_000, np.int64),
]
KEYS = ("policy", "partition_bytes", "credit_bytes", "fusion_bytes")


def data(rank: int, iteration: int, index: int) -> np.ndarray:
    """This rank's contribution to one tensor in one iteration."""
    count, dtype = TENSORS[index]
    rng = np.random.default_rng([rank, iteration, index])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-(2**20), 2**20, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def main() -> int:
    iterations = int(sys.argv[1])
    comm = MPI.COMM_WORLD
    commsched.init(transport="mpi")  # COMMSCHED_AUTOTUNE=1 and friends come from the environment
    ranks, rank = commsched.size(), commsched.rank()
    mismatches: list[str] = []
    seen: list[list[object]] = []
    for iteration in range(iterations):
        buffers = [data(rank, iteration, i) for i in range(len(TENSORS))]
        handles = []
        for i in reversed(range(len(TENSORS))):  # backward: last layer first
            time.sleep(0.0005)
            handles.append(commsched.allreduce_async(buffers[i], name=f"t{i}", priority=i))
        for handle in handles:
            handle.wait(timeout=60)
        for i, got in enumerate(buffers):
            parts = [data(r, iteration, i) for r in range(ranks)]
            if np.issubdtype(got.dtype, np.integer):
                ok = np.array_equal(got, np.sum(parts, axis=0, dtype=got.dtype))
            else:
                ok = np.allclose(got, np.sum(np.asarray(parts, np.float64), axis=0), rtol=1e-5, atol=1e-5)
            if not ok:
                mismatches.append(f"iteration {iteration} tensor {i}")
        settings = commsched.config()
        current = [settings[k] for k in KEYS]
        if not seen or seen[-1] != current:
            seen.append(current)
        commsched.autotune_step()
    result = autotune.result()
    final = [commsched.config()[k] for k in KEYS]
    everyone = comm.allgather(final)
    print(
        json.dumps(
            {
                "rank": rank,
                "mismatches": mismatches,
                "seen": seen,
                "final": final,
                "final_everywhere_same": all(f == final for f in everyone),
                "result": None if result is None else {k: result[k] for k in (*KEYS, "env", "iterations")},
            }
        ),
        flush=True,
    )
    commsched.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
