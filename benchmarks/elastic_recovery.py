"""Seconds from the SIGKILL of one of 4 ranks to the next completed step at 3 ranks, under
`commsched-run -n 4 --min-np 3` (elastic training, the survivors re-form without restarting).

    python benchmarks/elastic_recovery.py [--trials 5] [--ranks 4] [--transport gloo]

Each trial runs tests/elastic_ranks/train.py; the rank launched as the last one SIGKILLs itself after
step() of step 3 and writes the time just before; the survivors write the time of every completed
step. Recovery is the first step at the smaller size minus the kill. Prints the median and range.
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


def trial(ranks: int, transport: str, timeout_s: float) -> float:
    """One elastic run with one SIGKILL; returns seconds from the kill to the next step at ranks - 1."""
    with tempfile.TemporaryDirectory(prefix="elastic-recovery-") as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        env.update(
            ELASTIC_OUT=out,
            ELASTIC_TIMES="1",
            ELASTIC_KILL=f"{ranks - 1}:0:3",
            COMMSCHED_TRANSPORT=transport,
        )
        command = [sys.executable, "-m", "commsched.run", "-n", str(ranks), "--min-np", str(ranks - 1)]
        done = subprocess.run(
            [*command, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the elastic run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        killed = _times(Path(out) / f"times.{ranks - 1}", "fault")[0]
        after = [
            when
            for member in range(ranks - 1)
            for when in _times(Path(out) / f"times.{member}", f"step {ranks - 1}")
            if when > killed
        ]
        return min(after) - killed


def _times(path: Path, what: str) -> list[float]:
    lines = path.read_text().splitlines()
    return [float(line.split(" ", 1)[0]) for line in lines if line.split(" ", 1)[1] == what]


def main() -> None:
    """Runs the trials and prints each and the median with the range."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="elastic runs (default 5)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks at the start (default 4)")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "grpc"), help="default gloo")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per run before it counts as hung"
    )
    args = parser.parse_args()
    seconds = []
    for number in range(args.trials):
        seconds.append(trial(args.ranks, args.transport, args.timeout))
        print(f"trial {number + 1}: {seconds[-1]:.2f} s", flush=True)
    print(
        f"SIGKILL of 1 of {args.ranks} ranks to the next step at {args.ranks - 1} ({args.transport}): "
        f"median {statistics.median(seconds):.2f} s, range {min(seconds):.2f}-{max(seconds):.2f} s "
        f"over {len(seconds)} trials"
    )


if __name__ == "__main__":
    main()
