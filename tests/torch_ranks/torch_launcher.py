"""Starts a rank script under mpiexec or torchrun for the torch plug-in tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mpirun import clean_rank_env, mpiexec  # tests/ is on sys.path (conftest.py)

from commsched.run import free_port

HERE = Path(__file__).resolve().parent


def _clean_env() -> dict[str, str]:
    return clean_rank_env(HERE)


def launch(
    launcher: str, ranks: int, script: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Runs tests/torch_ranks/<script> on `ranks` ranks; returns the finished process (stdout+stderr)."""
    path = str(HERE / script)
    if launcher == "mpiexec":
        argv = [mpiexec() or "mpiexec", "-n", str(ranks), sys.executable, "-m", "mpi4py", path, *args]
    else:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            path,
            *args,
        ]
    return subprocess.run(
        argv,
        check=False,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def have_mpiexec() -> bool:
    """True when mpiexec and mpi4py are installed."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec() is not None
