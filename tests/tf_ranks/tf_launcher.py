"""Starts a rank script of the TensorFlow plug-in tests under mpiexec."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from mpirun import clean_rank_env, mpiexec, unglue  # tests/ is on sys.path (conftest.py)

HERE = Path(__file__).resolve().parent


def _clean_env() -> dict[str, str]:
    env = clean_rank_env(HERE)
    if "COMMSCHED_TF_OPS_DIR" in os.environ:  # the one setting the ranks must share with the caller
        env["COMMSCHED_TF_OPS_DIR"] = os.environ["COMMSCHED_TF_OPS_DIR"]
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def have_mpiexec() -> bool:
    """True when mpiexec and mpi4py are installed."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec() is not None


def launch(ranks: int, script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Runs tests/tf_ranks/<script> on `ranks` ranks; `-m mpi4py` makes an exception abort every rank."""
    argv = [mpiexec() or "mpiexec", "-n", str(ranks), sys.executable, "-m", "mpi4py"]
    argv += [str(HERE / script), *args]
    return subprocess.run(
        argv,
        check=False,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def verdicts(result: subprocess.CompletedProcess[str]) -> tuple[list[str], list[str]]:
    """The labels of the PASS lines and the FAIL lines in a run's output."""
    # TensorFlow's Python warnings (retracing) share the merged stream and were once glued to a PASS.
    output = unglue(result.stdout, "PASS ", "FAIL ", "WARNING:tensorflow:")
    return re.findall(r"PASS (\S+)", output), re.findall(r"FAIL (.*)", output)
