"""Rank program for tests/test_wait_stopped_peer.py: rank 1 stops itself (SIGSTOP) before it submits
'x'; rank 0's `wait(timeout)` on 'x' must raise TimeoutError on time although the agreement round it
drives waits for the stopped rank (the stall limits are far longer). Rank 0 then continues rank 1
(SIGCONT), and the round left open goes on: 'x' completes with the right sum on both ranks.

With --shutdown, rank 0 instead calls shutdown() while rank 1 is stopped: it must return after about
COMMSCHED_STALL_TIMEOUT (STALL_S here), not the far longer COMMSCHED_STALL_SHUTDOWN; rank 0 then
SIGKILLs rank 1.

Arguments: --transport gloo|mpi (run under `python -m commsched.run -n 2` or `mpiexec -n 2`), --shutdown."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path

import numpy as np

import commsched

# Past this a rank prints its stacks (where it hangs) and exits instead of waiting on.
WATCHDOG_S = 50.0
WAITS_S = (1.0, 0.5)  # rank 0's timed waits while rank 1 is stopped
STALL_S = 2.0  # COMMSCHED_STALL_TIMEOUT with --shutdown


def wait_until_stopped(pid: int) -> None:
    """Returns once process `pid` is in the stopped state ('T' in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(2000):
        if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.005)
    raise RuntimeError(f"rank 1 (pid {pid}) did not stop")


def shut_down_beside_a_stopped_rank(rank: int, stopped_pid: int) -> None:
    """Rank 1 stops; rank 0 times its shutdown(), then ends rank 1."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    wait_until_stopped(stopped_pid)
    started = time.monotonic()
    commsched.shutdown()
    print(f"rank 0: shutdown returned after {time.monotonic() - started:.2f}s", flush=True)
    os.kill(stopped_pid, signal.SIGKILL)


def main() -> None:
    """Runs the scenario; rank 0 prints how long each timed wait took and both print the sum."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=("gloo", "mpi"), required=True)
    parser.add_argument("--shutdown", action="store_true")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    # A stall limit far past the waits: only the waits' own timeouts may end them. The round left
    # open is named in a warning after COMMSCHED_STALL_TIMEOUT, shorter than the waits.
    commsched.init(
        transport=args.transport, stall_timeout=STALL_S if args.shutdown else 1.0, stall_shutdown=40.0
    )
    rank = commsched.rank()
    pids = commsched.allgather(np.array([[os.getpid()]], np.int64), name="pids")
    if args.shutdown:
        shut_down_beside_a_stopped_rank(rank, int(pids[1, 0]))
        return
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        total = commsched.allreduce(np.full(1024, 2.0, np.float32), name="x", op="sum")
        print(f"rank 1: sum {total[0]:g}", flush=True)
        commsched.shutdown()
        return
    wait_until_stopped(int(pids[1, 0]))
    handle = commsched.allreduce_async(np.ones(1024, np.float32), name="x", op="sum")
    for timeout in WAITS_S:
        started = time.monotonic()
        try:
            handle.wait(timeout)
            print("rank 0: 'x' finished although rank 1 was stopped", flush=True)
        except TimeoutError:
            print(
                f"rank 0: wait({timeout}) raised TimeoutError after {time.monotonic() - started:.2f}s",
                flush=True,
            )
    os.kill(int(pids[1, 0]), signal.SIGCONT)
    total = handle.wait(30)
    print(f"rank 0: sum {total[0]:g}", flush=True)
    commsched.shutdown()


if __name__ == "__main__":
    main()
