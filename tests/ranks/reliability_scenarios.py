"""Rank program for the reliability tests (memory safety, refusals, scalars, bounded state).

The scenario is the first argument; each prints `SCENARIO-OK <rank>` when every check held.
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np

import commsched

BIG = 1 << 20  # float32 elements: 4 MiB, so the allocator maps it and unmaps it when freed


def _wait_for_completed(count: int, timeout_s: float = 60) -> None:
    """Waits until the core has completed `count` tensors on this rank."""
    deadline = time.monotonic() + timeout_s
    while commsched.stats()["completed_tensors"] < count:
        assert time.monotonic() < deadline, commsched.stats()
        time.sleep(0.01)


def dropped_handles() -> None:
    """Arrays and handles dropped while in flight: the collective must not write into freed memory."""
    import torch

    commsched.init(stall_timeout=30, stall_shutdown=60)
    rank, size = commsched.rank(), commsched.size()
    if rank == 0:
        # Dropped at once, before the other rank has submitted: nothing but the core refers to them.
        commsched.allreduce_async(np.ones(BIG, np.float32), "numpy")
        commsched.allreduce_async(torch.ones(BIG, dtype=torch.float32), "torch")
        commsched.broadcast_async(np.ones(BIG, np.float32), 1, "broadcast")
        try:
            commsched.allreduce(np.ones(BIG, np.float32), "fast", timeout=0.05)  # the one-call path
        except TimeoutError:
            pass
        else:
            raise AssertionError("the other rank held 'fast' back, yet it finished")
        gc.collect()
        # New memory, possibly where the dropped arrays were: the late collectives must not touch it.
        fillers = [np.full(BIG, 7.0, np.float32) for _ in range(6)]
        fillers += [torch.full((BIG,), 7.0) for _ in range(3)]
        _wait_for_completed(4)
        assert all(float(filler.min()) == float(filler.max()) == 7.0 for filler in fillers)
        deadline = time.monotonic() + 30
        while commsched._core.kept_owners() and time.monotonic() < deadline:  # released once done
            time.sleep(0.01)
        assert commsched._core.kept_owners() == 0
    else:
        time.sleep(1.0)
        values = [np.ones(BIG, np.float32), torch.ones(BIG), np.full(BIG, 3.0, np.float32)]
        handles = [
            commsched.allreduce_async(values[0], "numpy"),
            commsched.allreduce_async(values[1], "torch"),
            commsched.broadcast_async(values[2], 1, "broadcast"),
        ]
        fast = commsched.allreduce(np.ones(BIG, np.float32), "fast", timeout=60)
        for handle in handles:
            handle.wait(timeout=60)
        assert float(values[0].min()) == float(values[0].max()) == size
        assert float(values[1].min()) == float(values[1].max()) == size
        assert float(values[2].min()) == 3.0 and float(fast.max()) == size
    commsched.allreduce(np.ones(1), "done", timeout=60)
    commsched.shutdown()


def _expect_refused_elsewhere(handle: commsched.Handle, refusing_rank: int, reason: str) -> None:
    """The handle fails soon with a CollectiveError naming the refusing rank and the reason."""
    try:
        handle.wait(timeout=20)  # far below COMMSCHED_STALL_SHUTDOWN, which the others waited for
    except commsched.CollectiveError as error:
        text = str(error)
        assert f"'{handle.name}' was refused on rank {refusing_rank}" in text and reason in text, text
        assert error.rank == refusing_rank, error.rank
    else:
        raise AssertionError(f"'{handle.name}' completed although rank {refusing_rank} refused it")


def refused_on_one_rank() -> None:
    """A submission refused on one rank only fails on every rank at once, with the same reason."""
    commsched.init(stall_timeout=60, stall_shutdown=120)
    rank, size = commsched.rank(), commsched.size()
    started = time.monotonic()
    # op="average" on a bool tensor, on rank 1 only.
    if rank == 1:
        try:
            commsched.allreduce_async(np.ones(4, bool), "avg", op="average")
        except ValueError as error:
            assert "not defined for bool" in str(error), error
        else:
            raise AssertionError("average of bools was accepted")
    else:
        _expect_refused_elsewhere(
            commsched.allreduce_async(np.ones(4, np.float32), "avg", op="average"), 1, "not defined for bool"
        )
    # A root that is no rank, on rank 0 only; the others submitted first.
    if rank == 0:
        time.sleep(0.3)
        try:
            commsched.broadcast_async(np.ones(4), root=size + 3, name="root")
        except ValueError as error:
            assert "is not a rank" in str(error), error
        else:
            raise AssertionError("a broadcast from a missing rank was accepted")
    else:
        _expect_refused_elsewhere(
            commsched.broadcast_async(np.ones(4), root=0, name="root"), 0, "is not a rank"
        )
    # Refused in Python (a read-only array) on the last rank, before the others submit.
    if rank == size - 1:
        frozen = np.ones(4)
        frozen.flags.writeable = False
        try:
            commsched.allreduce_async(frozen, "frozen")
        except TypeError as error:
            assert "read-only" in str(error), error
        else:
            raise AssertionError("a read-only array was accepted")
    else:
        time.sleep(0.3)
        _expect_refused_elsewhere(commsched.allreduce_async(np.ones(4), "frozen"), size - 1, "read-only")
    assert time.monotonic() - started < 30, "refusals took as long as a stall"
    # The job goes on, and a refused name is free for a valid submission on every rank.
    for name in ("avg", "root", "frozen", "after"):
        result = commsched.allreduce(np.full(3, rank + 1.0), name, timeout=60)
        assert np.array_equal(result, np.full(3, size * (size + 1) / 2)), (name, result)
    commsched.shutdown()


def non_finite_scale() -> None:
    """NaN the same on every rank is refused at submit naming the argument, not blamed on a mismatch;
    infinity on one rank fails every rank at once; finite factors still scale as numpy does."""
    commsched.init(stall_timeout=60, stall_shutdown=120)
    rank, size = commsched.rank(), commsched.size()
    started = time.monotonic()
    for argument in ("prescale_factor", "postscale_factor"):
        name = f"nan.{argument}"
        try:
            commsched.allreduce(np.ones(3), name, timeout=30, **{argument: float("nan")})
        except ValueError as error:
            text = str(error)
            assert f"{argument} of '{name}' is nan" in text and "finite" in text, text
            assert "does not match" not in text, text
        else:
            raise AssertionError(f"{argument}=nan was accepted")
    # Infinity on rank 0 only; the others submit a valid factor under the same name.
    if rank == 0:
        try:
            commsched.allreduce_async(np.ones(3), "inf", postscale_factor=float("inf"))
        except ValueError as error:
            assert "postscale_factor of 'inf' is inf" in str(error), error
        else:
            raise AssertionError("postscale_factor=inf was accepted")
    else:
        time.sleep(0.3)
        _expect_refused_elsewhere(
            commsched.allreduce_async(np.ones(3), "inf", postscale_factor=2.0),
            0,
            "postscale_factor of 'inf' is inf",
        )
    assert time.monotonic() - started < 30, "refusals took as long as a stall"
    data = np.arange(5.0) + rank
    result = commsched.allreduce(data, "scaled", timeout=60, prescale_factor=0.5, postscale_factor=3.0)
    expected = 3.0 * np.sum([0.5 * (np.arange(5.0) + r) for r in range(size)], axis=0)
    assert np.array_equal(result, expected), (result, expected)
    commsched.shutdown()


def zero_dim() -> None:
    """0-d arrays and tensors are reduced in place; immutable scalars are refused on every rank."""
    import torch

    commsched.init()
    rank, size = commsched.rank(), commsched.size()
    total = sum(r + 1.5 for r in range(size))
    value = np.array(rank + 1.5)
    assert commsched.allreduce(value, "sync") is value and float(value) == total, value
    value = np.array(rank + 1.5, np.float32)
    commsched.allreduce_async(value, "async").wait(timeout=60)
    assert float(value) == total, value
    counter = np.array(rank + 1, np.int64)
    commsched.allreduce_async(counter, "int").wait(timeout=60)
    assert int(counter) == size * (size + 1) // 2, counter
    tensor = torch.tensor(rank + 1.5)
    commsched.allreduce_async(tensor, "torch", op="average").wait(timeout=60)
    assert float(tensor) == total / size, tensor
    root_value = np.array(float(rank))
    commsched.broadcast(root_value, root=size - 1, name="bcast")
    assert float(root_value) == size - 1, root_value
    for scalar in (np.float64(2.5), 2.5):
        try:
            commsched.allreduce(scalar, "scalar")
        except TypeError as error:
            assert "immutable" in str(error) and "1-element or 0-d array" in str(error), error
        else:
            raise AssertionError(f"the scalar {scalar!r} was accepted")
    commsched.allreduce(np.ones(1), "done", timeout=60)
    commsched.shutdown()


def many_names() -> None:
    """Thousands of distinct names: the name cache stays bounded, and forgotten names still agree."""
    commsched.init()
    rank, size = commsched.rank(), commsched.size()
    count = int(sys.argv[2])
    for step in range(count):
        value = np.full(2, rank + step, np.int64)
        commsched.allreduce(value, f"layer{step}.weight")
        assert value[0] == size * step + size * (size - 1) // 2, (step, value)
    cached = commsched.stats()["cached_names"]
    assert 0 < cached <= int(sys.argv[3]), cached
    # The oldest names were forgotten, the newest are cached: mixed in flight, every rank agrees.
    names = [f"layer{step}.weight" for step in (*range(50), *range(count - 50, count))]
    order = np.random.default_rng(rank).permutation(len(names))
    arrays = {name: np.full(3, rank + 1, np.int64) for name in names}
    handles = [commsched.allreduce_async(arrays[names[i]], names[i]) for i in order]
    for handle in handles:
        assert (handle.wait(timeout=60) == size * (size + 1) // 2).all(), handle.name
    assert commsched.stats()["cached_names"] <= int(sys.argv[3])
    commsched.shutdown()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print(f"SCENARIO-OK {sys.argv[1]}", flush=True)
