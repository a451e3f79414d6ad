"""Rank program of the fault-injection matrix (tests/test_faults.py): checked allreduces, one rank faults.

Every rank allreduces `grad.<step>` for --steps steps and checks the sum against numpy. At
--fault-step, rank --victim injects --fault instead of submitting:
  kill      SIGKILL itself           stop      SIGSTOP itself (hangs, holding its sockets)
  raise     an uncaught exception    skip      never submits grad.<step>, goes on with the next
  shutdown  commsched.shutdown() early, then a clean exit
  stop-in-flight  submits a 64 MiB grad.<step> like every rank and, once the others submit it too,
            SIGSTOPs itself while it is on the wire
A rank whose collective fails (or finds commsched stopped) prints `FAULT-SEEN rank R: <error>` and
exits with status 3.
--out DIR receives pid.<rank> at start and fault.time (time.time() of the fault) from the victim.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import commsched
from commsched.launch import detect

ELEMENTS = 64 * 1024  # 256 KiB per tensor: above the inline size, so each step is a real collective
# 64 MiB: the step of stop-in-flight, long enough on the wire to be stopped in.
LARGE_ELEMENTS = 16 * 1024 * 1024
IN_FLIGHT_S = 0.05  # from submitting it until the victim stops: the agreement is through, the bytes are not


def inject(fault: str, out: Path, step: int) -> None:
    """Does the fault to this process (returns only for skip and shutdown)."""
    (out / "fault.time").write_text(repr(time.time()))
    print(f"FAULT-INJECTED {fault} at grad.{step}", flush=True)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "raise":
        raise RuntimeError(f"injected fault before grad.{step}")
    elif fault == "shutdown":
        commsched.shutdown()
        sys.exit(0)


def others_submitted(out: Path, size: int, rank: int) -> None:
    """Returns once every other rank is about to submit the large tensor (at most 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all((out / f"submitting.{other}").exists() for other in range(size) if other != rank):
            return
        time.sleep(0.005)


def main() -> int:
    """Runs the steps, injecting the fault on the victim."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--fault",
        choices=("none", "kill", "stop", "raise", "skip", "shutdown", "stop-in-flight"),
        default="none",
    )
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = detect().rank
    (args.out / f"pid.{rank}").write_text(str(os.getpid()))
    commsched.init(transport=args.transport)
    size = commsched.size()
    in_flight = args.fault == "stop-in-flight"
    for step in range(args.steps):
        elements = LARGE_ELEMENTS if in_flight and step == args.fault_step else ELEMENTS
        data = np.full(elements, rank + 1 + step, dtype=np.float32)
        if rank == args.victim and step == args.fault_step and args.fault != "none":
            if in_flight:
                commsched.allreduce_async(data, name=f"grad.{step}")
                others_submitted(args.out, size, rank)
                time.sleep(IN_FLIGHT_S)
            inject("stop" if in_flight else args.fault, args.out, step)
            if args.fault == "skip":
                continue
        elif in_flight and step == args.fault_step:
            (args.out / f"submitting.{rank}").touch()
        try:
            commsched.allreduce(data, name=f"grad.{step}")
        # ValueError: commsched stopped (naming why) before this rank submitted the tensor.
        except (commsched.CommschedError, TimeoutError, ValueError) as error:
            print(f"FAULT-SEEN rank {rank}: {error}", flush=True)
            return 3
        expected = size * (size + 1) / 2 + size * step
        assert np.array_equal(data, np.full(elements, expected, np.float32)), (
            f"rank {rank}: grad.{step} differs"
        )
    print(f"RANK-DONE {rank}", flush=True)
    commsched.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
