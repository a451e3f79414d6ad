"""commsched.init() under mpiexec when the program told mpi4py not to start MPI
(`mpi4py.rc.initialize = False`, as Horovod's process-set tests do): commsched starts MPI itself
with MPI_THREAD_MULTIPLE, as Horovod does, instead of calling MPI before MPI_Init; 2 ranks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpirun import clean_rank_env, mpiexec, unglue

REPO = Path(__file__).resolve().parent.parent

RANK_PROGRAM = """
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
import numpy as np
import commsched
assert not MPI.Is_initialized(), "mpi4py started MPI although told not to"
commsched.init(transport="mpi")
level = MPI.Query_thread()
assert level == MPI.THREAD_MULTIPLE, f"thread level {level}"
total = commsched.allreduce(np.full(4, commsched.rank() + 1.0))
assert total.tolist() == [3.0] * 4, total
MPI.COMM_WORLD.barrier()
commsched.shutdown()
print(f"PASS late-init rank {MPI.COMM_WORLD.Get_rank()}", flush=True)
"""


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_init_starts_mpi_when_mpi4py_did_not() -> None:
    """Both ranks start MPI through commsched.init(), allreduce, and exit cleanly."""
    command = [str(mpiexec()), "-n", "2", sys.executable, "-c", RANK_PROGRAM]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env=clean_rank_env(REPO), check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    passed = [line for line in unglue(result.stdout, "PASS ").splitlines() if line.startswith("PASS")]
    assert sorted(passed) == [
        "PASS late-init rank 0",
        "PASS late-init rank 1",
    ], output[-4000:]
