"""Launches rank programs under mpiexec for the tests; an exception on any rank ends the job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

RANKS_DIR = Path(__file__).resolve().parent / "ranks"


def mpiexec() -> str | None:
    """The mpiexec beside this Python (pip's mpich), or one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


FULL_VARIABLE = "COMMSCHED_TEST_FULL"


def full_matrix() -> bool:
    """True when COMMSCHED_TEST_FULL=1 asks for every cell of the matrices, not only those of CI's run."""
    return os.environ.get(FULL_VARIABLE, "") == "1"


# Launcher and commsched variables of a surrounding job must not leak into the ranks a test starts.
_LAUNCH_VARIABLES = (
    "COMMSCHED_",
    "PMI_",
    "PMIX_",
    "OMPI_",
    "MPI_LOCALRANKID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_",
)


def clean_rank_env(*python_path: Path) -> dict[str, str]:
    """This process's environment without launcher variables, one thread per rank, `python_path` first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARIABLES)}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, python_path), env.get("PYTHONPATH", "")]))
    return env


def run_ranks(
    ranks: int, script: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs tests/ranks/<script> on `ranks` ranks; `python -m mpi4py` aborts all ranks on an exception."""
    launcher = mpiexec()
    assert launcher, "mpiexec not found: pip install mpich mpi4py"
    command = [launcher, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(RANKS_DIR / script), *args]
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=timeout, env=environment
    )


def local_launch(ranks: int, program: str, *args: str, master_port: int = 0) -> list[str]:
    """Argv that starts `program` on `ranks` local ranks with commsched's launcher (`commsched.run`)."""
    argv = [sys.executable, "-W", "ignore", "-m", "commsched.run", "-n", str(ranks)]
    if master_port:
        argv += ["--master-port", str(master_port)]
    return [*argv, program, *args]


def unglue(output: str, *markers: str) -> str:
    """Puts each marker (e.g. "PASS ") at the start of a line: mpiexec may glue two ranks' lines together."""
    # commsched's own log lines go to stderr, which some launchers merge into the same stream.
    for marker in (*markers, "[commsched rank "):
        output = output.replace(marker, "\n" + marker)
    return output
