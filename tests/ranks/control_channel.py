"""Rank program for tests/test_control_channel.py: allreduce, allgather and broadcast checked against
numpy while agreement rounds travel where COMMSCHED_CONTROL_CHANNEL says, then the core's counters.

Runs under mpiexec (python -m mpi4py) or a torchrun-style launcher (COMMSCHED_TRANSPORT=gloo).
Arguments: --expect tcp|transport (where the rounds must have gone), --expect init-error (init()
must fail; the message is printed), or --expect peer-exits (rank 1 leaves; the others must fail
naming it, through the channel)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import commsched

# Elements: inline in a report, one launch, and past the partition size set by the test (chunks).
COUNTS = [3, 5_000, 300_000]


def values(count: int, rank: int, salt: int) -> np.ndarray:
    """Small integers, so float32 sums are exact."""
    return ((np.arange(count) * 3 + salt) % 11 + rank).astype(np.float32)


def check(what: str, got: np.ndarray, expected: np.ndarray) -> None:
    """Ends this rank with the first difference, named."""
    if got.shape != expected.shape or not np.array_equal(got, expected):
        raise SystemExit(f"rank {commsched.rank()}: {what} differs from numpy")


def run_collectives(rank: int, size: int) -> int:
    """Allreduces, allgathers and broadcasts from every root; returns how many were checked."""
    checked = 0
    for step in range(3):
        for count in COUNTS:
            mine = values(count, rank, step)
            commsched.allreduce(mine, name=f"sum.{step}.{count}")
            check(f"allreduce of {count}", mine, sum(values(count, r, step) for r in range(size)))
            rows = [values(count // 100 + r + 1, r, step) for r in range(size)]  # a different length per rank
            gathered = np.asarray(commsched.allgather(rows[rank].copy(), name=f"gather.{step}.{count}"))
            check(f"allgather of {count}", gathered, np.concatenate(rows))
            for root in range(size):
                data = values(count, rank, step + 7)
                commsched.broadcast(data, root=root, name=f"bcast.{step}.{count}.{root}")
                check(f"broadcast of {count} from {root}", data, values(count, root, step + 7))
                checked += 1
            checked += 2
    return checked


def peer_exits(rank: int) -> None:
    """Rank 1 leaves without a word; every other rank's next collective fails naming rank 1."""
    commsched.allreduce(np.ones(4, np.float32), name="before")
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)
    time.sleep(0.5)
    try:
        commsched.allreduce(np.ones(100_000, np.float32), name="after", timeout=60)
    except commsched.RankFailure as error:
        if error.rank != 1 or "control channel" not in str(error):
            raise SystemExit(f"rank {rank}: the failure names rank {error.rank}, not 1: {error}") from None
        print(f"PEER-EXIT-OK on rank {rank}, RankFailure.rank={error.rank}: {error}", flush=True)
        return
    except ValueError as error:  # stopped before the submission: the message still names the rank
        if "control channel" not in str(error) or "rank 1" not in str(error):
            raise SystemExit(f"rank {rank}: unexpected error: {error}") from None
        print(f"PEER-EXIT-OK on rank {rank}, stopped before submitting: {error}", flush=True)
        return
    raise SystemExit(f"rank {rank}: an allreduce with a departed peer succeeded")


def main() -> None:
    """Runs the collectives, then prints where the rounds went."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect", choices=("tcp", "transport", "init-error", "peer-exits"), required=True)
    expect = parser.parse_args().expect
    if expect == "init-error":
        try:
            commsched.init()
        except Exception as error:  # noqa: BLE001 - the test reads the message
            print(
                f"rank {os.environ.get('RANK', os.environ.get('PMI_RANK', '?'))}: init failed: {error}",
                flush=True,
            )
            return
        raise SystemExit(f"rank {commsched.rank()}: init() succeeded, expected a failure")
    commsched.init()
    rank, size = commsched.rank(), commsched.size()
    if expect == "peer-exits":
        peer_exits(rank)
        return
    checked = run_collectives(rank, size)
    stats = commsched.stats()
    rounds, cycles = stats["control_channel_rounds"], stats["cycles"]
    channel = "tcp" if rounds > 0 else "transport"
    if channel != expect or (expect == "tcp" and rounds != cycles):
        raise SystemExit(
            f"rank {rank}: {rounds} of {cycles} rounds over the control channel, expected {expect}"
        )
    print(
        f"rank {rank}: OK {checked} collectives over {commsched.config()['transport']}, rounds over {channel}, "
        f"{stats['spun_rounds']} spun"
    )
    commsched.shutdown()


if __name__ == "__main__":
    main()
