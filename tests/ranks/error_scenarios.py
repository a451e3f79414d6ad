"""Rank program for the error-path tests; the scenario is the first argument.

Each scenario prints `SCENARIO-OK <rank>` when every rank saw what it should.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import commsched
from commsched.link_defaults import default_sizes
from commsched.link_probe import rounds_path, transport_algorithm


def mismatch() -> None:
    """Rank 1 submits a bigger tensor under the same name: every rank's handle fails, the job goes on."""
    commsched.init()
    rank = commsched.rank()
    handle = commsched.allreduce_async(np.ones(10 + (rank == 1) * 5, np.float32), "w")
    try:
        handle.wait(timeout=30)
    except commsched.CommschedError as error:
        text = str(error)
        assert "'w'" in text and "rank 1 submitted allreduce float32[15]" in text, text
        assert "float32[10]" in text, text
    else:
        raise AssertionError("a mismatched tensor was reduced")
    good = commsched.allreduce(np.ones(4, np.int64), "after", timeout=30)
    assert (good == commsched.size()).all()
    commsched.shutdown()


def grouped_lengths() -> None:
    """grouped_allreduce with another number of tensors on one rank: every rank's call fails at once
    naming the lengths, whichever side is shorter; nothing is left pending (with a stall limit of 2 s,
    a leftover member would stop the job before the checks after it), and the job goes on."""
    commsched.init(stall_timeout=1, stall_shutdown=2)
    rank, size = commsched.rank(), commsched.size()
    others = "ranks " + ",".join(map(str, range(1, size))) if size > 2 else "rank 1"
    for name, mine, theirs in (("short", 1, 2), ("long", 3, 2)):
        length = mine if rank == 0 else theirs
        arrays = [np.full(4, rank + 1.0) for _ in range(length)]
        started = time.monotonic()
        try:
            commsched.grouped_allreduce(arrays, name=name, timeout=20)
        except commsched.CollectiveError as error:
            text = str(error)
            shorter, longer = sorted([(mine, "rank 0"), (theirs, others)])
            expected = (
                f"grouped_allreduce '{name}' was called with {shorter[0]} tensor{'s' * (shorter[0] > 1)} on "
                f"{shorter[1]} and {longer[0]} tensors on {longer[1]}"
            )
            assert expected in text, text
            assert time.monotonic() - started < 10, "the mismatch was found only after a wait"
        else:
            raise AssertionError(
                f"rank {rank}: a grouped_allreduce of {length} tensors against another length returned"
            )
    time.sleep(2.5)  # past the stall limit: a member still pending anywhere would have stopped the job
    same = commsched.grouped_allreduce([np.ones(3), np.ones(2)], name="short", timeout=20)
    assert all((array == size).all() for array in same), same
    assert (commsched.allreduce(np.ones(4), "after", timeout=20) == size).all()
    commsched.shutdown()


def duplicate() -> None:
    """A second in-flight use of one name is refused at once."""
    commsched.init()
    if commsched.rank() == 0:
        # Rank 1 holds its 'dup' back, so rank 0's first one cannot finish before the second try.
        first = commsched.allreduce_async(np.ones(3), "dup")
        time.sleep(0.2)  # the core has announced it by now, and says so
        try:
            commsched.allreduce_async(np.ones(3), "dup")
        except ValueError as error:
            assert "already in flight (waiting for other ranks)" in str(error) and "'dup'" in str(error), (
                error
            )
        else:
            raise AssertionError("a second in-flight use of 'dup' was accepted")
    else:
        time.sleep(0.5)
        first = commsched.allreduce_async(np.ones(3), "dup")
    assert (first.wait(timeout=30) == commsched.size()).all()
    again = commsched.allreduce(np.ones(3), "dup", timeout=30)  # the name is free once done
    assert (again == commsched.size()).all()
    commsched.shutdown()


def stall() -> None:
    """Rank 1 submits late: the others warn (naming tensor and rank, and the hint for its name, added
    before init()), then it completes."""
    commsched._add_stall_hint("lat", "a hint given before init()")
    commsched.init(stall_timeout=1, stall_shutdown=30)
    if commsched.rank() == 1:
        time.sleep(3.5)
    result = commsched.allreduce(np.ones(2), "late", timeout=30)
    assert (result == commsched.size()).all()
    commsched.shutdown()


def stall_shutdown() -> None:
    """Rank 1 never submits: every rank stops with an error naming the tensor, the missing rank and the
    hint of the longest prefix of its name (hints added while running)."""
    commsched.init(stall_timeout=1, stall_shutdown=2)
    commsched._add_stall_hint("ne", "too general")
    commsched._add_stall_hint("neve", "an earlier hint")
    commsched._add_stall_hint("neve", "the most specific hint")
    started = time.monotonic()
    if commsched.rank() != 1:
        try:
            commsched.allreduce(np.ones(2), "never", timeout=60)
        except commsched.RankFailure as error:  # pending when it stopped
            assert "never" in str(error) and "not on ranks 1" in str(error), error
            assert str(error).endswith("(the most specific hint)"), error
            assert isinstance(error.rank, int), error.rank
        else:
            raise AssertionError("a stalled tensor completed")
    else:
        while commsched.is_initialized() and time.monotonic() - started < 60:
            time.sleep(0.05)
    # Submitted after the stop: the same class as a handle pending at the stop, on every path.
    for submit in (commsched.allreduce, commsched.allreduce_async):
        try:
            submit(np.ones(2), "never")
        except commsched.RankFailure as error:
            assert "not running" in str(error) and "stall" in str(error).lower(), error
            # init() again cannot bring a failed rank back: the message points to elastic training.
            assert "init()" not in str(error) and "commsched.elastic.run" in str(error), error
            assert isinstance(error, commsched.NotRunningError) and isinstance(
                error, commsched.CommschedError
            )
        else:
            raise AssertionError("a rank could still submit after the stall shutdown")
    assert time.monotonic() - started < 30, "the stall shutdown took too long"
    commsched.shutdown()


def shutdown_pending() -> None:
    """Rank 0 shuts down with a handle pending: it fails clearly, and rank 1 learns commsched stopped."""
    commsched.init()
    if commsched.rank() == 0:
        handle = commsched.allreduce_async(np.ones(2), "orphan")
        commsched.shutdown()
        try:
            handle.wait(timeout=10)
        except commsched.NotRunningError as error:
            assert "shutdown() was called on rank 0" in str(error) and "orphan" in str(error), error
            assert not isinstance(error, commsched.RankFailure), "a clean shutdown is no rank's failure"
        else:
            raise AssertionError("a pending handle completed although rank 1 never submitted it")
    else:
        deadline = time.monotonic() + 30
        while commsched.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.02)
        # What this rank was started on stays true until its own shutdown(), as in Horovod, and
        # asking for it waits on no peer (local_size() once split MPI's world on every call).
        from commsched import _horovod as hvd

        assert hvd.is_initialized() and hvd.local_size() == commsched.local_size() == 2
        assert (hvd.local_rank(), hvd.cross_rank(), hvd.cross_size()) == (1, 0, 1)
        assert commsched.mpi_enabled() == (commsched.config()["transport"] == "mpi"), commsched.config()
        # This rank never asked to stop: the error says why it stopped and what every rank must do,
        # not to call init() first.
        for attempt in (lambda: commsched.allreduce_async(np.ones(2), "orphan"), commsched.join):
            try:
                attempt()
            except commsched.NotRunningError as error:
                text = str(error)
                assert (
                    "shutdown() was called on rank 0" in text and "stops commsched on every rank" in text
                ), text
                assert "call commsched.init() before" not in text, text
            else:
                raise AssertionError("rank 1 could submit or join after rank 0 shut down")
        commsched.shutdown()
        try:
            commsched.allreduce_async(np.ones(2), "late")
        except commsched.NotRunningError as error:  # its own shutdown(): init() is the fix
            assert "commsched.init()" in str(error), error
        else:
            raise AssertionError("rank 1 could submit after its own shutdown()")


def reconfigure() -> None:
    """Settings switch on every rank together; integer results stay exact across switches."""
    commsched.init(policy="priority")
    rank, size = commsched.rank(), commsched.size()
    settings = commsched.config()  # the defaults fitted to the link init() measured
    # As init() fits them: with the transport's algorithm and the fixed cost per large message the
    # probe measured (nonzero when this host's MPI was slow per message that run).
    fitted = default_sizes(
        size,
        settings["link_bandwidth"],
        settings["link_latency"],
        algorithm=transport_algorithm("mpi"),
        rounds=rounds_path(settings["control_channel"], "mpi"),
        collective_overhead_s=settings["collective_overhead"] + settings["link_message_cost"],
    )
    assert {name: settings[name] for name in fitted} == fitted, settings
    rng = np.random.default_rng(rank)
    variants = [
        {"policy": "fifo"},
        {"policy": "priority", "partition_bytes": "8KiB", "credit_bytes": "16KiB", "fusion_bytes": "2KiB"},
        {"policy": "priority", "partition_bytes": "1MiB", "credit_bytes": "4MiB", "fusion_bytes": 0},
    ]
    for step, variant in enumerate(variants * 2):
        commsched.reconfigure(**variant)
        handles = []
        for i in rng.permutation(40):
            data = np.arange(int(i) * 500, dtype=np.int64) * (rank + 1)
            handles.append((commsched.allreduce_async(data, f"r{i}", priority=int(i)), int(i)))
            if i % 7 == 0:
                time.sleep(0.001)
        for handle, i in handles:
            expected = np.arange(i * 500, dtype=np.int64) * (size * (size + 1) // 2)
            assert np.array_equal(handle.wait(timeout=60), expected), (step, i)
    commsched.allreduce(np.zeros(1), "settle", timeout=30)
    assert commsched.config()["partition_bytes"] == 1024**2, commsched.config()
    assert commsched.config()["fusion_bytes"] == 0
    commsched.shutdown()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print(f"SCENARIO-OK {sys.argv[1]}", flush=True)
