"""Rank program for tests/test_gloo_ring.py: reduce-scatters and all-gathers large enough for the native
Gloo transport's ring collectives (csrc/transport/gloo/gloo_ring.cc), for every dtype and op, with uneven
parts, a rank with no part, several in flight at once and on a process set, checked exactly against numpy;
small ones must stay on Gloo's own collectives.

Run under a torchrun-style launcher (python -m commsched.run -n N). --peer-exits: rank 1 leaves while a
large reduce-scatter is on the wire; rank 0 must fail with an error naming what broke, not hang."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
import torch

import commsched
from commsched.transports import gloo

DTYPES = ["float16", "bfloat16", "float32", "float64", "int16", "int32", "int64", "uint8", "int8", "bool"]
ROW = 20_000  # elements per row: every collective below moves more than the ring's 64 KiB floor


def values(dtype: str, shape: tuple[int, ...], rank: int, salt: int) -> np.ndarray:
    """Small integers per rank, so every sum, product and average is exact in every dtype."""
    rng = np.random.default_rng([salt, rank])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0 if dtype == "uint8" else -3, 4, shape).astype(np.float64)


def as_input(reference: np.ndarray, dtype: str) -> Any:
    """What a rank submits: numpy, or a torch tensor for bfloat16 (numpy has none)."""
    if dtype == "bfloat16":
        return torch.tensor(reference, dtype=torch.bfloat16)
    return reference.astype(dtype)


def as_numpy(result: Any) -> np.ndarray:
    """A result as numpy: float64 for numbers, bool kept."""
    if isinstance(result, torch.Tensor):
        return result.to(torch.float64).numpy()
    return result if result.dtype == bool else result.astype(np.float64)


def reference(arrays: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """The reduction as commsched defines it: integer average floor-divides, 8-bit integers wrap."""
    if dtype == "bool":
        return np.stack(arrays).all(0) if op in ("min", "product") else np.stack(arrays).any(0)
    stacked = np.stack(arrays)
    reduced = {"min": stacked.min(0), "max": stacked.max(0), "product": stacked.prod(0)}.get(
        op, stacked.sum(0)
    )
    if op == "average":
        floating = dtype in ("float16", "bfloat16", "float32", "float64")
        reduced = reduced / len(arrays) if floating else np.floor(reduced / len(arrays))
    return reduced.astype(dtype).astype(np.float64) if dtype in ("uint8", "int8") else reduced


def check(what: str, got: Any, expected: np.ndarray) -> None:
    """Fails this rank with the first mismatch, named (floating averages within rounding)."""
    actual = as_numpy(got).reshape(expected.shape)
    close = np.isclose(actual, expected, rtol=1e-2, atol=1e-2) if "average" in what else actual == expected
    if not np.all(close):
        bad = int(np.flatnonzero(~close)[0])
        raise SystemExit(
            f"rank {commsched.rank()}: {what}: element {bad} is {actual.flat[bad]}, expected {expected.flat[bad]}"
        )


def rings() -> int:
    """Launches that ran as ring collectives on this rank so far."""
    return int(gloo.last_seed.counters()["rings"])


def rows_of(total: int, size: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s part of a reduce-scatter of `total` rows: the first ranks one more."""
    start = sum(total // size + (r < total % size) for r in range(rank))
    return start, total // size + (rank < total % size)


def reduce_scatters(rank: int, size: int, members: list[int], process_set: Any, tag: str) -> int:
    """Every dtype, sum and average, uneven rows, all in flight at once; a member keeping nothing; int16 wrapping."""
    me = members.index(rank)
    n = len(members)
    total = 2 * n + 1
    pending = []
    for d, dtype in enumerate(DTYPES[:-1]):  # not bool: the core reduce-scatters with sum and average only
        for o, op in enumerate(("sum", "average")):
            every = [values(dtype, (total, ROW), r, 100 * d + o) for r in members]
            handle = commsched.reducescatter_async(
                as_input(every[me], dtype), op=op, name=f"{tag}.rs.{dtype}.{op}", process_set=process_set
            )
            start, rows = rows_of(total, n, me)
            pending.append(
                (
                    f"{tag} reducescatter {op} of {dtype}",
                    handle,
                    reference(every, op, dtype)[start : start + rows],
                )
            )
    before = rings()
    for what, handle, expected in pending:
        check(what, handle.wait(60), expected)
    # n - 1 rows: the last member keeps nothing, and the others one row each.
    every = [values("float32", (n - 1, 4 * ROW), r, 7) for r in members]
    kept = commsched.reducescatter(
        every[me].astype(np.float32), name=f"{tag}.rs.empty", process_set=process_set
    )
    start, rows = rows_of(n - 1, n, me)
    check(f"{tag} reducescatter with a member keeping nothing", kept, np.sum(every, 0)[start : start + rows])
    # Near the int16 limit: sums wrap as int16 arithmetic does.
    line = np.full((n, ROW), 30_000 + me, dtype=np.int16)
    kept = commsched.reducescatter(line, name=f"{tag}.rs.wrap", process_set=process_set)
    wrapped = np.full((1, ROW), sum(30_000 + m for m in range(n)), dtype=np.int64).astype(np.int16)
    check(f"{tag} int16 reducescatter that wraps", kept, wrapped.astype(np.float64))
    if rings() == before:
        raise SystemExit(f"rank {rank}: no {tag} reducescatter ran as a ring collective")
    return len(pending) + 2


def allgathers(rank: int, size: int, members: list[int], process_set: Any, tag: str) -> int:
    """Every dtype, member m giving m rows (the first none), several in flight; a big one in segments."""
    me = members.index(rank)
    pending = []
    for d, dtype in enumerate(DTYPES):
        every = [values(dtype, (m, ROW), r, 500 + d) for m, r in enumerate(members)]
        handle = commsched.allgather_async(
            as_input(every[me], dtype), name=f"{tag}.ag.{dtype}", process_set=process_set
        )
        pending.append((f"{tag} allgather of {dtype}", handle, np.concatenate(every)))
    before = rings()
    for what, handle, expected in pending:
        check(what, handle.wait(60), expected)
    # 3 MiB per member: several segments per step.
    big = [np.arange(786_432, dtype=np.float32) * (m + 1) for m in range(len(members))]
    check(
        f"{tag} allgather of 3 MiB each",
        commsched.allgather(big[me], name=f"{tag}.ag.big", process_set=process_set),
        np.concatenate(big),
    )
    if rings() == before:
        raise SystemExit(f"rank {rank}: no {tag} allgather ran as a ring collective")
    return len(pending) + 1


def small_ones_stay_on_gloo(rank: int, size: int) -> None:
    """Under the ring's floor, a reduce-scatter and an all-gather go to Gloo's own collectives."""
    before = rings()
    kept = commsched.reducescatter(np.ones((size, 1000), np.float32), name="small.rs")
    gathered = commsched.allgather(np.full((2, 100), rank, np.int32), name="small.ag")
    check("small reducescatter", kept, np.full((1, 1000), float(size)))
    check("small allgather", gathered, np.repeat(np.arange(size), 2)[:, None] * np.ones((1, 100)))
    if rings() != before:
        raise SystemExit(f"rank {rank}: a small collective ran as a ring collective")


def peer_exits(rank: int) -> None:
    """Rank 1 leaves while a large ring reduce-scatter is on the wire; rank 0 fails with a named error."""
    data = np.ones((2, 8 * 1024 * 1024), np.float32)  # 64 MiB: long enough on the wire to be cut off
    commsched.reducescatter(data[:, :1024].copy(), name="warm")
    handle = commsched.reducescatter_async(data, name="cut")
    if rank == 1:
        time.sleep(0.02)
        sys.stdout.flush()
        os._exit(0)
    try:
        handle.wait(60)
    except (commsched.CommschedError, ValueError) as error:
        text = str(error)
        # Whichever notices first names the lost rank: the ring's own pair, or the control channel.
        named = (
            "gloo reducescatter",
            "control channel: the connection to rank 1",
            "control channel: rank 1 closed its connection",
        )
        assert any(what in text for what in named) and ("failed" in text or "lost contact" in text), text
        print(f"rank {rank}: failed as expected: {text}", flush=True)
        return
    raise SystemExit("rank 0: a reduce-scatter whose peer left succeeded")


def main() -> None:
    """Runs the scenario named on the command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-exits", action="store_true")
    args = parser.parse_args()
    commsched.init(transport="gloo", stall_timeout=5, partition_bytes="64MiB")
    rank, size = commsched.rank(), commsched.size()
    assert gloo.last_path == "native", gloo.last_path
    if args.peer_exits:
        peer_exits(rank)
        return
    everyone = list(range(size))
    checked = reduce_scatters(rank, size, everyone, None, "all") + allgathers(
        rank, size, everyone, None, "all"
    )
    small_ones_stay_on_gloo(rank, size)
    if size > 2:
        # Members 0 and 2: group ranks differ from job ranks.
        pair = commsched.add_process_set([0, size - 1])
        if rank in (0, size - 1):
            members = [0, size - 1]
            checked += reduce_scatters(rank, size, members, pair, "set") + allgathers(
                rank, size, members, pair, "set"
            )
        commsched.remove_process_set(pair)
    commsched.shutdown()
    print(f"rank {rank}: RING OK {checked} collectives", flush=True)


if __name__ == "__main__":
    main()
