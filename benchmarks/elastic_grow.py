"""Seconds from a discovery-script change to the first step at the new size, under
`commsched-run -n 2 --max-np 3 --host-discovery-script S` (elastic growth: a new rank joins).

    python benchmarks/elastic_grow.py [--trials 5] [--transport gloo]

Each trial runs tests/elastic_ranks/train.py with a discovery script giving 2 slots; the rank
launched as 0 rewrites it to give 3 in step 2 and notes the time. Growth is the first step a rank
completes at 3 ranks minus that time: the launcher's poll (about once a second), the new rank's
start (Python and torch imported), the survivors' commit seeing the notice, the re-forming at 3,
the state broadcast and one step. Prints each trial and the median with the range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "elastic_ranks" / "train.py"


def trial(transport: str, timeout_s: float) -> float:
    """One run growing from 2 to 3 ranks; returns seconds from the script change to a step at 3."""
    with tempfile.TemporaryDirectory(prefix="elastic-grow-") as out:
        discovery = Path(out) / "discover.sh"
        discovery.write_text("#!/bin/sh\necho localhost:2\n")
        discovery.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        env.update(
            ELASTIC_OUT=out,
            ELASTIC_TIMES="1",
            ELASTIC_GROW="0:2:3",
            ELASTIC_SCRIPT=str(discovery),
            COMMSCHED_TRANSPORT=transport,
        )
        command = [sys.executable, "-m", "commsched.run", "-n", "2", "--min-np", "2", "--max-np", "3"]
        command += ["--host-discovery-script", str(discovery), str(SCRIPT)]
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the elastic run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        changed = _times(Path(out) / "times.0", "script changed")[0]
        after = [
            when for times in Path(out).glob("times.*") for when in _times(times, "step 3") if when > changed
        ]
        return min(after) - changed


def _times(path: Path, what: str) -> list[float]:
    lines = path.read_text().splitlines()
    return [float(line.split(" ", 1)[0]) for line in lines if line.split(" ", 1)[1] == what]


def main() -> None:
    """Runs the trials and prints each and the median with the range."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="elastic runs (default 5)")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "grpc"), help="default gloo")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per run before it counts as hung"
    )
    args = parser.parse_args()
    seconds = []
    for number in range(args.trials):
        seconds.append(trial(args.transport, args.timeout))
        print(f"trial {number + 1}: {seconds[-1]:.2f} s", flush=True)
    print(
        f"discovery script 2 -> 3 slots to the first step at 3 ranks ({args.transport}): "
        f"median {statistics.median(seconds):.2f} s, range {min(seconds):.2f}-{max(seconds):.2f} s "
        f"over {len(seconds)} trials"
    )


if __name__ == "__main__":
    main()
