"""Rank program of tests/test_gloo_python_faults.py: rank 1 stops while a 128 MiB allreduce is in flight.

Every rank submits one checked small allreduce, then a 128 MiB one. Once every rank has submitted
it, rank 1 either SIGSTOPs itself (--fault stop) or calls commsched.shutdown() (--fault shutdown),
and waits for its own handle in the second case. A rank whose wait fails prints
`FAULT-SEEN rank R: <error>` and exits with status 3. Each rank prints `PATH rank R: <transport path>`
(the Gloo transport it runs on). --out DIR receives pid.<rank>, submitted.<rank> and fault.time.
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
from commsched.transports import gloo

VICTIM = 1
LARGE_ELEMENTS = 32 * 1024 * 1024  # 128 MiB of float32: 64 MiB finished before the fault on a busy host once
IN_FLIGHT_S = 0.005  # from every rank's submission until the victim stops: the 128 MiB take longer


def main() -> int:
    """Submits the large allreduce and, on the victim, stops mid-flight."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=("stop", "shutdown"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = detect().rank
    (args.out / f"pid.{rank}").write_text(str(os.getpid()))
    commsched.init(transport="gloo")
    size = commsched.size()
    print(f"PATH rank {rank}: {gloo.last_path}", flush=True)
    small = np.full(1024, rank + 1, np.float32)
    commsched.allreduce(small, name="small")
    assert np.array_equal(small, np.full(1024, size * (size + 1) / 2, np.float32))
    data = np.full(LARGE_ELEMENTS, rank + 1, np.float32)
    handle = commsched.allreduce_async(data, name="large")
    (args.out / f"submitted.{rank}").touch()
    if rank == VICTIM:
        deadline = time.monotonic() + 30
        while not all((args.out / f"submitted.{r}").exists() for r in range(size)):
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.005)
        time.sleep(IN_FLIGHT_S)
        (args.out / "fault.time").write_text(repr(time.time()))
        if args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            commsched.shutdown()
    try:
        handle.wait(timeout=60)
    except (commsched.CommschedError, TimeoutError) as error:
        print(f"FAULT-SEEN rank {rank}: {type(error).__name__}: {error}", flush=True)
        return 3
    print(f"RANK-DONE {rank}", flush=True)
    commsched.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
