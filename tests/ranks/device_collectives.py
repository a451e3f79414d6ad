"""Device-memory collectives through the core and the NCCL (or CUDA-aware MPI) transport, over the fake
CUDA/NCCL library.

Run under mpiexec with COMMSCHED_NCCL_LIBRARY / COMMSCHED_CUDART_LIBRARY pointing at the fake. The
fake runs stream work on worker threads and reduces across the real ranks, so a collective that
does not wait for its producer, or a fused copy that runs out of order, shows as a wrong number.
Every result is checked exactly against numpy. Prints "DEVICE OK <case>" per passing case.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_cuda import FakeCudaArray

import commsched

SIDE_STREAM = 0x5EED  # a producer's stream the fake has never seen: it gets a worker of its own
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8]


def rank_values(dtype: type, count: int, rank: int, salt: int) -> np.ndarray:
    """Small values that no dtype overflows when summed over a few ranks, distinct per rank and tensor."""
    values = (np.arange(count) * 7 + rank * 13 + salt) % 23
    return values.astype(dtype)


def expected_sum(dtype: type, count: int, size: int, salt: int) -> np.ndarray:
    """The sum over ranks, computed on the host in a wide type and cast back."""
    total = sum(rank_values(np.int64, count, r, salt) for r in range(size))
    return total.astype(dtype)


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Raises naming the tensor when the result differs from the reference."""
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(
            f"{name}: {bad.size} wrong elements, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
        )


def mixed_tensors(policy: str, size: int, rank: int) -> None:
    """Many tensors of every dtype and size, some cut into chunks and some fused, in a shuffled order."""
    rng = np.random.default_rng(17)  # the same sizes on every rank
    specs = [(DTYPES[i % len(DTYPES)], int(rng.choice([1, 3, 64, 500, 3000, 40_000]))) for i in range(60)]
    arrays = []
    for index, (dtype, count) in enumerate(specs):
        # Odd ones say the per-thread default stream produced them: an event is recorded and waited on.
        stream = 2 if index % 2 else None
        arrays.append(FakeCudaArray(rank_values(dtype, count, rank, index), stream=stream))
    order = np.random.default_rng(rank).permutation(len(specs))  # each rank submits in its own order
    handles = {}
    for index in order:
        dtype, count = specs[index]
        handles[index] = commsched.allreduce_async(
            arrays[index], name=f"{policy}.t{index}", priority=int(index)
        )
    for index, handle in handles.items():
        handle.wait(60)
        dtype, count = specs[index]
        check(f"{policy}.t{index}", arrays[index].host, expected_sum(dtype, count, size, index))
    print(f"DEVICE OK mixed {policy}", flush=True)


def average_and_broadcast(size: int, rank: int) -> None:
    """op="average" runs as ncclAvg (fused and partitioned alike); broadcasts take the root's bytes."""
    floats = [FakeCudaArray(rank_values(np.float64, n, rank, n), stream=None) for n in (5, 7, 20_000)]
    handles = [commsched.allreduce_async(a, name=f"avg{i}", op="average") for i, a in enumerate(floats)]
    for handle, array, n in zip(handles, floats, (5, 7, 20_000)):
        handle.wait(60)
        want = sum(rank_values(np.float64, n, r, n) for r in range(size)) / size
        check(handle.name, array.host, want)
    root = size - 1
    sent = [FakeCudaArray(rank_values(np.int32, n, rank, 1), stream=None) for n in (9, 11, 30_000)]
    handles = [commsched.broadcast_async(a, root=root, name=f"bcast{i}") for i, a in enumerate(sent)]
    for handle, array, n in zip(handles, sent, (9, 11, 30_000)):
        handle.wait(60)
        check(handle.name, array.host, rank_values(np.int32, n, root, 1))
    print("DEVICE OK average-broadcast", flush=True)


def late_producer(size: int, rank: int, library: ctypes.CDLL, delay_us: int) -> None:
    """A producer writes the gradient late on a side stream; submitted at once, the collective must wait.

    Without the wait on the submit-time event the collective would sum the zeros there before the
    write, and the result would be wrong. Both an unfused (partitioned) and a fused tensor are checked.
    """
    library.fake_launch_write.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint,
    ]
    cases = [("late.big", 50_000)] + [(f"late.small{i}", 16 + i) for i in range(4)]
    sources, targets, handles = [], [], []
    for name, count in cases:
        source = rank_values(np.float32, count, rank, 3)
        target = FakeCudaArray(np.zeros(count, np.float32), stream=SIDE_STREAM)
        library.fake_launch_write(
            SIDE_STREAM, target.host.ctypes.data, source.ctypes.data, source.nbytes, delay_us
        )
        handles.append(commsched.allreduce_async(target, name=name))
        sources.append(source)
        targets.append(target)
    for handle, target, (name, count) in zip(handles, targets, cases):
        handle.wait(60)
        check(name, target.host, expected_sum(np.float32, count, size, 3))
    # The late tensor holds the credit, so the small ones queue behind it and share launches,
    # whatever the host's timing (with nothing holding them, each may go out in its own round).
    stats = commsched.stats()
    assert stats["fused_launches"] > 0 and stats["launches"] < stats["chunks"], stats
    print(f"DEVICE OK late-producer fused={stats['fused_launches']}", flush=True)


def refusal_reaches_every_rank(size: int, rank: int) -> None:
    """A tensor the device transport refuses on one rank (on another GPU there) fails on every rank at
    once, naming that rank, instead of leaving the others waiting for it."""
    wrong = rank == size - 1
    array = FakeCudaArray(np.ones(8, np.float32), stream=None, device_id=3 if wrong else None)
    if wrong:
        try:
            commsched.allreduce_async(array, name="elsewhere")
        except ValueError as error:
            assert "cuda:3" in str(error), error
        else:
            raise AssertionError("a tensor on another GPU was accepted")
    else:
        handle = commsched.allreduce_async(array, name="elsewhere")
        try:
            handle.wait(20)  # far below COMMSCHED_STALL_SHUTDOWN
        except commsched.CollectiveError as error:
            assert error.rank == size - 1 and "cuda:3" in str(error), error
        else:
            raise AssertionError("the other ranks' collective did not fail")
    print("DEVICE OK refusal", flush=True)


def main() -> None:
    """Runs the cases named on the command line on this rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay-us", type=int, default=200_000)
    parser.add_argument("--transport", default="nccl", help="nccl, or mpi for a CUDA-aware MPI")
    args = parser.parse_args()
    library = ctypes.CDLL(os.environ["COMMSCHED_CUDART_LIBRARY"])
    for policy in ("priority", "fifo"):
        commsched.init(
            device="cuda",
            transport=args.transport,
            policy=policy,
            partition_bytes="16KiB",
            fusion_bytes="64KiB",
        )
        size, rank = commsched.size(), commsched.rank()
        mixed_tensors(policy, size, rank)
        if policy == "priority":
            average_and_broadcast(size, rank)
            late_producer(size, rank, library, args.delay_us)
            refusal_reaches_every_rank(size, rank)
        commsched.shutdown()
    print("DEVICE ALL OK", flush=True)


if __name__ == "__main__":
    main()
