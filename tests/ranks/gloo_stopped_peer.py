"""Rank program for tests/test_gloo_stopped_peer.py: rank 1 stops itself (SIGSTOP) while a large
reduce-scatter or all-gather is on the wire; rank 0's wait fails naming rank 1 and the tensor, and its
shutdown() returns within a bound. Rank 0 SIGKILLs the stopped rank at the end, so the job ends.

Run under `python -m commsched.run -n 2`. Arguments: --kind reducescatter|allgather; --pid-dir DIR
(rank 1 leaves its pid there, so a test can end it whatever happens); --no-stall-shutdown (keeps
COMMSCHED_STALL_SHUTDOWN at its default: shutdown() then waits for the stopped rank's report up to
that long) with --poll (rank 0 polls done() so the core's own thread runs the rounds); --kill-at-exit
(rank 0 kills the stopped rank only once its interpreter finalizes, so the stuck collective fails
then, as when a launcher ends the stopped rank at that moment; rank 0's exit status is then 3);
--stop-in-transport (the Python Gloo transport only: rank 1 stops inside the transport's start of 'cut',
so the collective is on the wire whatever the agreement's pace)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import commsched
from commsched.transports import gloo

STALL_S = 2.0
# Past this, rank 0 prints its stacks (where it hangs) and exits instead of waiting on.
WATCHDOG_S = 40.0
# How long rank 0's finalization waits after killing the stopped rank: Gloo's threads see the
# connection fail within it.
FAIL_AT_EXIT_S = 0.5


class KillAtExit:
    """Kills `pid` when the interpreter finalizes (module globals are cleared after Python stopped
    letting other threads take the GIL), then waits so the stuck collective fails meanwhile."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.kill = os.kill
        self.sleep = time.sleep

    def __del__(self) -> None:
        self.kill(self.pid, signal.SIGKILL)
        self.sleep(FAIL_AT_EXIT_S)


_kept: list[KillAtExit] = []


def stop_once_started() -> None:
    """Makes the Python Gloo transport stop this process right after it started a large collective."""
    start = gloo.GlooTransport.start_collective

    def start_then_stop(
        self: Any, kind: str, dtype: str, op: str, address: int, count: int, *rest: Any, **named: Any
    ) -> Any:
        pending = start(self, kind, dtype, op, address, count, *rest, **named)
        if count >= 1024 * 1024:
            os.kill(os.getpid(), signal.SIGSTOP)
        return pending

    gloo.GlooTransport.start_collective = start_then_stop  # type: ignore[method-assign]


def submit(kind: str) -> Any:
    """A warm-up, then the 64 MiB collective named 'cut' that rank 1 stops in the middle of."""
    data = np.ones((2, 8 * 1024 * 1024), np.float32)
    if kind == "reducescatter":
        commsched.reducescatter(data[:, :1024].copy(), name="warm")
        return commsched.reducescatter_async(data, name="cut")
    commsched.allgather(data[:, :1024].copy(), name="warm")
    return commsched.allgather_async(data, name="cut")


def wait_for_cut(handle: Any, poll: bool) -> None:
    """Waits for 'cut'; raises what the wait raised."""
    if poll:
        # done() leaves the rounds to the core's own thread; wait() would run them on this one.
        deadline = time.monotonic() + STALL_S
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not handle.done():
            raise TimeoutError(f"'cut' not done after {STALL_S}s")
    handle.wait(60)


def main() -> None:
    """Runs the scenario; rank 0 prints what its wait raised and how long its shutdown() took."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("reducescatter", "allgather"), default="reducescatter")
    parser.add_argument("--pid-dir", type=Path)
    parser.add_argument("--no-stall-shutdown", action="store_true")
    parser.add_argument("--poll", action="store_true")
    parser.add_argument("--kill-at-exit", action="store_true")
    parser.add_argument("--stop-in-transport", action="store_true")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    stop = {} if args.no_stall_shutdown else {"stall_shutdown": STALL_S}
    commsched.init(transport="gloo", stall_timeout=STALL_S, partition_bytes="64MiB", **stop)
    rank = commsched.rank()
    if args.stop_in_transport and rank == 1:
        stop_once_started()
    pids = commsched.allgather(np.array([[os.getpid()]], np.int64), name="pids")
    if args.pid_dir is not None and rank == 1:
        (args.pid_dir / "pid.1").write_text(str(os.getpid()))
    handle = submit(args.kind)
    if rank == 1 and args.stop_in_transport:
        handle.wait(60)  # the transport stops this rank inside the collective
        return
    if rank == 1:
        # At once: 64 MiB cannot cross before this, and any later a busy host's scheduler let the
        # collective finish before the stop in one CI run.
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # only once continued, which the test never does
    print(f"rank 0: over {gloo.last_path}", flush=True)
    started = time.monotonic()
    try:
        wait_for_cut(handle, args.poll)
        print("rank 0: 'cut' succeeded although its peer was stopped", flush=True)
    except (commsched.CommschedError, TimeoutError) as error:
        print(f"rank 0: failed after {time.monotonic() - started:.1f}s: {error}", flush=True)
    started = time.monotonic()
    try:
        commsched.shutdown()
    except commsched.CommschedError as error:
        print(f"rank 0: shutdown raised: {error}", flush=True)
    print(f"rank 0: shutdown returned after {time.monotonic() - started:.1f}s", flush=True)
    if args.kill_at_exit:
        _kept.append(KillAtExit(int(pids[1, 0])))
        print("rank 0: exiting with status 3", flush=True)
        raise SystemExit(3)
    os.kill(int(pids[1, 0]), signal.SIGKILL)
    print("rank 0: exiting", flush=True)


if __name__ == "__main__":
    main()
