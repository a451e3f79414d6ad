"""Rank program for small tensors that ride inline in the agreement round, and for callers that
run the core themselves while they wait; the scenario is the first argument.

Each scenario prints `SCENARIO-OK <rank>` when every rank saw what it should.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import commsched


def identical() -> None:
    """Inline float sums are bit-identical on every rank; int, half, average and broadcast are exact."""
    commsched.init()
    rank, size = commsched.rank(), commsched.size()
    rng = np.random.default_rng(7 + rank)
    mine = rng.standard_normal(300).astype(np.float32)  # 1200 bytes: inline
    total = commsched.allreduce(mine.copy(), "noisy")
    everyone = MPI.COMM_WORLD.allgather(total.tobytes())
    assert all(other == everyone[0] for other in everyone), "inline sums differ between ranks"
    expected = sum(np.random.default_rng(7 + r).standard_normal(300).astype(np.float64) for r in range(size))
    assert np.allclose(total, expected, rtol=1e-5, atol=1e-5)
    ints = commsched.allreduce(np.full(17, rank + 1, np.int64), "ints")
    assert (ints == size * (size + 1) // 2).all()
    halves = commsched.allreduce(np.full(9, rank, np.float16), "halves", op="average")
    assert (halves == np.float16((size - 1) / 2)).all(), halves
    message = commsched.broadcast(np.full(5, rank, np.uint8), root=size - 1, name="from-last")
    assert (message == size - 1).all()
    assert commsched.stats()["inline_tensors"] == 4, commsched.stats()
    commsched.shutdown()


def mixed() -> None:
    """Rank 0 turns inline payloads off: every rank then sends the tensor as a collective."""
    commsched.init(inline_bytes=0 if MPI.COMM_WORLD.rank == 0 else "4KiB")
    rank, size = commsched.rank(), commsched.size()
    result = commsched.allreduce(np.full(8, rank, np.int32), "small")
    assert (result == size * (size - 1) // 2).all()
    stats = commsched.stats()
    assert stats["inline_tensors"] == 0 and stats["launches"] == 1, stats
    commsched.shutdown()


def budget() -> None:
    """Small tensors past one round's inline budget go as collectives: some inline, the rest fused."""
    # A 1 s heartbeat and submissions that do not wake the core's thread: the waiting caller runs
    # the round, so (almost always) one round sees all 40 tensors, 640 KiB where 128 KiB may ride.
    commsched.init(inline_bytes="64KiB", cycle_time="1s")
    rank, size = commsched.rank(), commsched.size()
    arrays = [np.full(4096, rank + i, np.float32) for i in range(40)]  # 16 KiB each
    MPI.COMM_WORLD.Barrier()
    with commsched._caller_drives():
        handles = [commsched.allreduce_async(a, f"small.{i}") for i, a in enumerate(arrays)]
    for i, handle in enumerate(handles):
        assert (handle.wait(timeout=60) == size * i + size * (size - 1) // 2).all(), i
    stats = commsched.stats()
    assert 0 < stats["inline_tensors"] < 40 and stats["launches"] >= 1, stats
    commsched.shutdown()


def threads() -> None:
    """Four threads per rank submit and wait at once, small and big tensors: all correct, none hangs."""
    commsched.init()
    size = commsched.size()
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for step in range(150):
                count = 3 if step % 3 else 70_000  # inline, and a collective of its own
                data = np.full(count, index + step, np.float64)
                commsched.allreduce(data, f"w{index}.{step}", timeout=60)
                assert (data == size * (index + step)).all()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert not errors, errors
    commsched.shutdown()


def late() -> None:
    """Rank 0 waits (and runs the core) while rank 1 submits late: a short wait times out, a long one returns."""
    commsched.init()
    rank = commsched.rank()
    if rank == 1:
        time.sleep(0.5)
    handle = commsched.allreduce_async(np.ones(4, np.float32), "late")
    if rank == 0:
        try:
            handle.wait(timeout=0.05)
        except TimeoutError as error:
            assert "late" in str(error)
        else:
            raise AssertionError("the wait returned before rank 1 submitted")
    assert (handle.wait(timeout=30) == commsched.size()).all()
    # The synchronous call (one C++ call for a host buffer) times out alike, and the collective
    # still completes behind it.
    if rank == 1:
        time.sleep(0.5)
    data = np.ones(4, np.float32)
    if rank == 0:
        try:
            commsched.allreduce(data, "late_sync", timeout=0.05)
        except TimeoutError as error:
            assert "late_sync" in str(error)
        else:
            raise AssertionError("the synchronous call returned before rank 1 submitted")
    else:
        commsched.allreduce(data, "late_sync", timeout=30)
    commsched.allreduce(np.zeros(1), "after", timeout=30)
    assert (data == commsched.size()).all()
    commsched.shutdown()


if __name__ == "__main__":
    scenarios = {"identical": identical, "mixed": mixed, "budget": budget, "threads": threads, "late": late}
    scenarios[sys.argv[1]]()
    print("SCENARIO-OK", MPI.COMM_WORLD.rank, flush=True)
