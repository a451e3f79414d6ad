#!/usr/bin/env python3
"""A long randomized soak: rounds of random collectives, each checked against numpy, until time is up.

Every round, every rank submits the same random set of tensors (sizes from empty to ~1 MB, every
dtype, allreduce sum/average and broadcast, random priorities) in its own random order, with random
pauses, then checks each result. A collective that does not finish within --hang-after seconds is a
hang; the soak stops there (the ranks no longer agree on what runs). At the end it prints the
collectives checked, the wrong results and the hangs, and exits non-zero if there was either.

Usage::

    python benchmarks/soak.py --ranks 3 --transport mpi --minutes 10
    python benchmarks/soak.py --ranks 4 --transport gloo --minutes 30 --settings partition_bytes=64KiB

(CI runs the short version: tests/ranks/random_collectives.py through tests/test_multirank.py and
tests/test_transports.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "float64", "int32", "int64", "float16")
RESULT = "SOAK-RESULT "


def plan(rng: object, count: int) -> list[dict]:
    """One round's tensors, the same on every rank (the round's seed is shared)."""
    import numpy as np

    assert isinstance(rng, np.random.Generator)
    tensors = []
    for i in range(count):
        dtype = DTYPES[int(rng.choice(len(DTYPES), p=[0.35, 0.2, 0.2, 0.2, 0.05]))]
        size = (
            int(rng.choice([0, 1, 3, 17]))
            if rng.random() < 0.05
            else int(np.exp(rng.uniform(0, np.log(250_000))))
        )
        kind = "broadcast" if rng.random() < 0.1 else "allreduce"
        op = "average" if dtype.startswith("float") and kind == "allreduce" and rng.random() < 0.5 else "sum"
        tensors.append(
            {
                "index": i,
                "dtype": dtype,
                "size": size,
                "kind": kind,
                "op": op,
                "priority": int(rng.integers(-50, 50)),
            }
        )
    return tensors


def run_rank(arguments: argparse.Namespace) -> int:
    """One rank's part: rounds until the deadline; prints one SOAK-RESULT JSON line."""
    import numpy as np

    import commsched

    settings = dict(item.split("=", 1) for item in arguments.settings)
    commsched.init(transport=arguments.transport, **settings)
    rank, size = commsched.rank(), commsched.size()
    checked = wrong = hangs = 0
    first_problem = ""
    # Every rank agrees on the deadline's round count through a tiny allreduce per round.
    deadline = time.monotonic() + arguments.minutes * 60
    for round_number in range(10**9):
        go_on = np.array([1 if time.monotonic() < deadline else 0], np.int32)
        commsched.allreduce(go_on, name=f"soak.go.{round_number}", timeout=arguments.hang_after)
        if go_on[0] < size:  # some rank's time is up: every rank stops at this same round
            break
        rng = np.random.default_rng([arguments.seed, round_number])
        tensors = plan(rng, arguments.tensors)
        mine = np.random.default_rng([arguments.seed, round_number, rank])
        handles = []
        for index in mine.permutation(len(tensors)):
            spec = tensors[int(index)]
            base = np.random.default_rng([arguments.seed, round_number, int(index), 1])
            if spec["dtype"] == "float16" or spec["dtype"].startswith("int"):
                values = base.integers(-8, 8, spec["size"])  # exact in every dtype at any rank count
            else:
                values = base.uniform(-1, 1, spec["size"])
            array = (values * (rank + 1) + rank).astype(spec["dtype"])
            name = f"soak.{round_number}.{index}"
            root = int(index) % size
            if mine.random() < 0.02:
                time.sleep(float(mine.uniform(0, 0.003)))
            if spec["kind"] == "broadcast":
                handle = commsched.broadcast_async(array, root=root, name=name, priority=spec["priority"])
                reference = values * (root + 1) + root
            else:
                handle = commsched.allreduce_async(array, name, priority=spec["priority"], op=spec["op"])
                reference = sum(values * (r + 1) + r for r in range(size))
                reference = reference / size if spec["op"] == "average" else reference
            handles.append((handle, spec, np.asarray(reference, np.float64)))
        for handle, spec, reference in handles:
            try:
                result = handle.wait(timeout=arguments.hang_after).astype(np.float64)
            except TimeoutError as error:
                hangs += 1
                first_problem = first_problem or f"round {round_number}: {error}"
                break
            checked += 1
            tolerance = 2e-3 if spec["dtype"] == "float16" else 1e-5
            if not np.allclose(result, reference, rtol=tolerance, atol=tolerance):
                wrong += 1
                first_problem = first_problem or f"round {round_number}: {spec} differs from numpy"
        if hangs:
            break
    print(
        RESULT
        + json.dumps(
            {"rank": rank, "checked": checked, "wrong": wrong, "hangs": hangs, "first_problem": first_problem}
        ),
        flush=True,
    )
    if not hangs:
        commsched.shutdown()
    return 1 if wrong or hangs else 0


def launch(arguments: argparse.Namespace, passthrough: list[str]) -> int:
    """Starts the ranks (mpiexec for MPI, commsched-run otherwise) and sums up their results."""
    program = [str(Path(__file__).resolve()), "--rank-program", *passthrough]
    if arguments.transport == "mpi":
        mpiexec = Path(sys.executable).parent / "mpiexec"
        command = [
            str(mpiexec if mpiexec.exists() else shutil.which("mpiexec") or "mpiexec"),
            "-n",
            str(arguments.ranks),
            sys.executable,
            *program,
        ]
    else:
        command = [sys.executable, "-m", "commsched.run", "-n", str(arguments.ranks), *program]
    environment = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    )
    started = time.monotonic()
    limit = arguments.minutes * 60 + 10 * arguments.hang_after + 120
    try:
        done = subprocess.run(
            command, env=environment, capture_output=True, text=True, timeout=limit, check=False
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = (
            (expired.stdout or b"").decode(errors="replace")
            if isinstance(expired.stdout, bytes)
            else (expired.stdout or ""),
            -1,
        )
    results = [json.loads(line.split(RESULT, 1)[1]) for line in output.splitlines() if RESULT in line]
    checked = sum(r["checked"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    hangs = sum(r["hangs"] for r in results) + (arguments.ranks - len(results))  # a silent rank hung too
    print(f"soak: {arguments.ranks} ranks over {arguments.transport}, {time.monotonic() - started:.0f}s")
    print(f"collectives checked: {checked}")
    print(f"wrong results: {wrong}")
    print(f"hangs: {hangs}")
    for result in results:
        if result["first_problem"]:
            print(f"rank {result['rank']}: {result['first_problem']}")
    if code != 0 and not (wrong or hangs):
        print(output[-4000:])
    return 0 if code == 0 and not wrong and not hangs else 1


def main(argv: list[str] | None = None) -> int:
    """Parses the arguments; runs the launcher side or, with --rank-program, one rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--transport", default="mpi", choices=("mpi", "gloo", "grpc"))
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep submitting rounds")
    parser.add_argument("--tensors", type=int, default=200, help="tensors per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--hang-after", type=float, default=60.0, help="seconds after which a collective counts as hung"
    )
    parser.add_argument(
        "--settings", nargs="*", default=[], help="commsched.init() settings, e.g. partition_bytes=64KiB"
    )
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    arguments, _ = parser.parse_known_args(argv)
    if arguments.rank_program:
        return run_rank(arguments)
    passthrough = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--rank-program"]
    return launch(arguments, passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
