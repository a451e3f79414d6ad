"""Rank program for the gRPC failure tests: a few checked allreduces, then a pause, then more.

--pause-file F: after the first round, rank 0 waits until F exists (the test intrudes meanwhile).
--kill-rank R --kill-after K: rank R kills itself (SIGKILL) after K rounds; the others must fail
with an error naming it, and print how long that took.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import commsched


def one_round(number: int, rank: int, size: int) -> None:
    """An allreduce and a broadcast checked against numpy."""
    data = np.arange(50_000, dtype=np.float32) * (rank + 1) + number
    commsched.allreduce(data, name=f"a{number}", timeout=60)
    reference = np.arange(50_000, dtype=np.float64) * sum(range(1, size + 1)) + number * size
    assert np.array_equal(data.astype(np.float64), reference), (
        f"rank {rank}: round {number} allreduce differs"
    )
    value = np.full(1000, rank, dtype=np.int64)
    commsched.broadcast(value, root=size - 1, name=f"b{number}", timeout=60)
    assert (value == size - 1).all(), f"rank {rank}: round {number} broadcast differs"


def main() -> int:
    """Runs the rounds the arguments ask for."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause-file", default="")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-after", type=int, default=1)
    args = parser.parse_args()
    commsched.init(transport="grpc")
    rank, size = commsched.rank(), commsched.size()
    one_round(0, rank, size)
    if args.pause_file and rank == 0:
        print("rank 0: waiting for the intruder", flush=True)
        deadline = time.monotonic() + 25
        while not os.path.exists(args.pause_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    started = time.monotonic()
    try:
        for number in range(1, args.rounds + 1):
            if rank == args.kill_rank and number > args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            one_round(number, rank, size)
            if args.kill_rank >= 0:
                time.sleep(0.2)  # keep the survivors busy while the victim dies
    except (commsched.CommschedError, TimeoutError) as error:
        print(f"rank {rank}: FAILED after {time.monotonic() - started:.1f}s: {error}", flush=True)
        return 3
    commsched.shutdown()
    print(f"rank {rank}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
