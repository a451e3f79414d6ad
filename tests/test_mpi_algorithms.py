"""The MPI transport's choice of MPICH's reduce-scatter algorithm (csrc/transport/mpi/mpi_algorithms.cc):
pairwise exchange on a job whose size is not a power of two, MPICH's own choice otherwise, and the
user's MPIR_CVAR_IREDUCE_SCATTER_INTRA_ALGORITHM always kept; reduce-scatters stay correct.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpirun import clean_rank_env, mpiexec, unglue

REPO = Path(__file__).resolve().parent.parent
VARIABLE = "MPIR_CVAR_IREDUCE_SCATTER_INTRA_ALGORITHM"

RANK_PROGRAM = """
import sys
from mpi4py import MPI
import numpy as np
import commsched
from commsched import _mpi

if not _mpi.library_version().startswith("MPICH"):
    print(f"SKIP not MPICH", flush=True)
    sys.exit(0)
before = _mpi.reduce_scatter_algorithm()
commsched.init(transport="mpi")
rank, size = commsched.rank(), commsched.size()
after = _mpi.reduce_scatter_algorithm()
assert (before, after) == (sys.argv[1], sys.argv[2]), (before, after)
# Sizes on both sides of MPICH's 512 KiB switch, one not divisible by the ranks (rows go unevenly).
for rows in (7, 1000, 300_001):
    data = np.arange(rows, dtype=np.float32) * (rank + 1)
    part = commsched.reducescatter(data, name=f"rows{rows}")
    bounds = np.array_split(np.arange(rows), size)[rank]
    expected = np.arange(rows, dtype=np.float32)[bounds] * (size * (size + 1) / 2)
    assert np.array_equal(part, expected), (rows, part[:4], expected[:4])
MPI.COMM_WORLD.barrier()
commsched.shutdown()
print(f"PASS rank {rank} {after}", flush=True)
"""


def run(ranks: int, before: str, after: str, **environment: str) -> None:
    """Runs the rank program on `ranks` ranks; every rank must pass (or all say MPICH is absent)."""
    command = [
        str(mpiexec()),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mpi4py",
        "-c",
        RANK_PROGRAM,
        before,
        after,
    ]
    env = clean_rank_env(REPO) | environment
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    output = unglue(result.stdout + result.stderr, "PASS ", "SKIP ")
    assert result.returncode == 0, output[-4000:]
    if "SKIP not MPICH" in output:
        pytest.skip("the MPI library is not MPICH")
    passed = sorted(line for line in output.splitlines() if line.startswith("PASS"))
    assert passed == [f"PASS rank {r} {after}" for r in range(ranks)], output[-4000:]


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_three_ranks_reduce_scatter_by_pairwise_exchange() -> None:
    """At 3 ranks MPICH's automatic choice becomes pairwise exchange, and results stay exact."""
    run(3, "auto", "sched_pairwise")


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_two_ranks_and_a_users_choice_are_left_alone() -> None:
    """A power-of-two job keeps MPICH's choice; so does a job whose user named an algorithm."""
    run(2, "auto", "auto")
    run(3, "sched_recursive_halving", "sched_recursive_halving", **{VARIABLE: "sched_recursive_halving"})
