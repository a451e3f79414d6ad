"""Rank program for tests/test_gloo_native.py: which Gloo path init() took, and exact allreduce (sum,
average) and broadcast results for every dtype against numpy, inline, launched, partitioned and fused.

Run under a torchrun-style launcher (python -m commsched.run -n N). Arguments: --expect native|python,
or --peer-exits to check that a rank leaving mid-job fails the others' collectives with a named error."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
import torch

import commsched
from commsched.transports import gloo

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8"]
FLOATING = {"float16", "bfloat16", "float32", "float64"}
# Elements: inside an agreement report (inline), one launch, and past the partition size (cut into chunks).
COUNTS = [3, 20_000, 700_000]


def values(dtype: str, count: int, rank: int) -> np.ndarray:
    """This rank's input as float64: small integers, so every sum is exact in every dtype."""
    base = np.arange(count) % 7
    return (base + rank).astype(np.float64) if dtype == "uint8" else (base + 2 * rank - 1).astype(np.float64)


def tensor_of(dtype: str, data: np.ndarray) -> torch.Tensor:
    """A CPU torch tensor of `dtype` (numpy has no bfloat16) holding `data`."""
    return torch.from_numpy(data).to(getattr(torch, dtype))


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as float64, exactly (every dtype here converts to float64 without loss)."""
    return tensor.to(torch.float64).numpy()


def check(what: str, got: torch.Tensor, expected: np.ndarray) -> None:
    """Fails this rank with the first mismatch, named."""
    actual = as_numpy(got)
    if not np.array_equal(actual, expected):
        bad = int(np.flatnonzero(actual != expected)[0])
        raise SystemExit(
            f"rank {commsched.rank()}: {what}: element {bad} is {actual[bad]}, expected {expected[bad]}"
        )


def run_collectives(rank: int, size: int) -> int:
    """Every dtype, sum and average and broadcast from every root; returns how many were checked."""
    checked = 0
    for dtype in DTYPES:
        for count in COUNTS:
            mine = tensor_of(dtype, values(dtype, count, rank))
            commsched.allreduce(mine, name=f"sum.{dtype}.{count}")
            check(f"sum of {count} {dtype}", mine, sum(values(dtype, count, r) for r in range(size)))
            if dtype in FLOATING:
                # Rank r holds base + r: the average base + (size - 1) / 2 is exact in binary.
                base = np.arange(count) % 7
                mine = tensor_of(dtype, base + float(rank))
                commsched.allreduce(mine, name=f"avg.{dtype}.{count}", op="average")
                check(f"average of {count} {dtype}", mine, base + (size - 1) / 2)
            for root in range(size):
                mine = tensor_of(dtype, values(dtype, count, rank))
                commsched.broadcast(mine, root=root, name=f"bcast.{dtype}.{count}.{root}")
                check(f"broadcast of {count} {dtype} from {root}", mine, values(dtype, count, root))
            checked += 2 + size + (dtype in FLOATING)
    # Many small tensors of every dtype at once: fused launches and inline ones in one round.
    batch = [(dtype, count) for dtype in DTYPES for count in (5, 3000)]
    tensors = [tensor_of(d, values(d, c, rank)) for d, c in batch]
    handles = [commsched.allreduce_async(t, name=f"batch.{i}") for i, t in enumerate(tensors)]
    for handle in handles:
        handle.wait()
    for (dtype, count), tensor in zip(batch, tensors):
        check(f"batched sum of {count} {dtype}", tensor, sum(values(dtype, count, r) for r in range(size)))
    return checked + len(batch)


def run_shaped_edges(rank: int, size: int) -> int:
    """What the collectives suite does not reach: even allgather parts (gathered in place), a rank with
    nothing to give or keep, int16 reductions that wrap (Gloo reduces them in int32), bool moved as bytes."""
    rows = 20_000  # past the inline size: every one of these goes over the wire
    even = [np.arange(rows * 2, dtype=np.int16).reshape(rows, 2) - 1000 * r for r in range(size)]
    got = commsched.allgather(even[rank].copy(), name="edge.ag.even")
    check("even allgather of int16", torch.from_numpy(got), np.concatenate(even).astype(np.float64))
    # Rank 0 gives no rows; the others r * 3 rows of bools.
    flags = [np.arange(r * 3 * rows, dtype=np.int64).reshape(-1, 1) % 3 == r for r in range(size)]
    got = commsched.allgather(flags[rank].copy(), name="edge.ag.empty")
    assert got.dtype == bool and np.array_equal(got, np.concatenate(flags)), "allgather with an empty rank"
    # One row of a reducescatter: every rank but 0 keeps nothing.
    line = np.full((1, rows), 30_000 + rank, dtype=np.int16)
    kept = commsched.reducescatter(line, name="edge.rs.one")
    wrapped = np.full((1, rows), sum(30_000 + r for r in range(size)), dtype=np.int64).astype(np.int16)
    assert kept.shape == ((1, rows) if rank == 0 else (0, rows)), kept.shape
    assert rank != 0 or np.array_equal(kept, wrapped), f"int16 reducescatter: {kept[0, :3]}"
    for op, reference in (("sum", np.sum), ("min", np.min), ("max", np.max), ("product", np.prod)):
        # Near the int16 limit, of both signs: sums and products wrap, min and max need the sign.
        every = [(np.arange(rows) % 200 + 32_600 - 50 * r).astype(np.int16) for r in range(size)]
        mine = every[rank].copy()
        expected = reference(np.stack(every).astype(np.int64), axis=0).astype(np.int16)
        commsched.allreduce(mine, name=f"edge.ar.int16.{op}", op=op)
        assert np.array_equal(mine, expected), f"int16 {op}: {mine[:3]} != {expected[:3]}"
    # Rank 0 sends nothing; every other rank sends each rank `rows` bools.
    sent = np.zeros((0 if rank == 0 else rows * size, 3), dtype=bool)
    sent[::2] = True
    splits = [0 if rank == 0 else rows] * size
    output, received = commsched.alltoall(sent, splits, name="edge.a2a.bool")
    assert received == [0] + [rows] * (size - 1), received
    pattern = np.zeros((rows, 3), dtype=bool)
    pattern[::2] = True
    assert np.array_equal(output, np.concatenate([pattern] * (size - 1))), "bool alltoall"
    return 4 + 4


def expect_path(expected: str) -> None:
    """The transport the core runs is Gloo, over the native or the Python path as asked."""
    assert commsched.config()["transport"] == "gloo", commsched.config()
    assert gloo.last_path.startswith(expected), gloo.last_path


def peer_exits(rank: int) -> None:
    """Rank 1 leaves without a word; rank 0 fails with an error naming what broke, and does not hang."""
    commsched.allreduce(np.ones(4, np.float32), name="before")
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)
    time.sleep(0.5)
    try:
        # The failure surfaces in this collective, or, when a heartbeat round met it first, as the
        # core having stopped with the same message. On one host the agreement rounds run on the
        # TCP control channel, so the first to notice may be that channel rather than Gloo's op.
        commsched.allreduce(np.ones(100_000, np.float32), name="after", timeout=60)
    except (commsched.CommschedError, ValueError) as error:
        text = str(error)
        named = (
            "gloo agreement exchange",
            "gloo allreduce",
            "control channel: the connection to rank 1",
            "control channel: rank 1 closed its connection",
        )
        assert any(what in text for what in named), text
        assert "failed" in text, text
        print(f"rank {rank}: failed as expected: {text}", flush=True)
        return
    raise SystemExit("rank 0: an allreduce with a departed peer succeeded")


def main() -> None:
    """Runs the scenario named on the command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect", choices=("native", "python"), default="native")
    parser.add_argument("--peer-exits", action="store_true")
    args = parser.parse_args()
    commsched.init(transport="gloo", log_level="info", stall_timeout=5, partition_bytes="1MiB")
    rank, size = commsched.rank(), commsched.size()
    expect_path(args.expect)
    if args.peer_exits:
        peer_exits(rank)
        return
    checked = run_collectives(rank, size) + run_shaped_edges(rank, size)
    if args.expect == "native":
        counters = gloo.last_seed.counters()
        assert counters["launches"] > 0 and counters["exchanges"] > 0, counters
    else:
        assert gloo.last_seed is None
    commsched.shutdown()
    # Nothing of commsched's holds the job's process groups after shutdown (the seed kept for its
    # counters once did, through the process-set maker): a group still referenced is torn down while
    # the interpreter exits, when torch's Gloo threads can no longer take the GIL (an abort at exit).
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, gloo.Groups)], (
        "process groups outlive shutdown()"
    )
    print(f"rank {rank}: OK {checked} collectives over {gloo.last_path}", flush=True)


if __name__ == "__main__":
    main()
