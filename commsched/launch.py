"""Rank discovery: who launched us (mpiexec, torchrun, or nobody) and where we stand."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process through its environment."""

    launcher: str  # "mpiexec", "torchrun" or "single"
    rank: int
    size: int
    local_rank: int
    master_addr: str = ""
    master_port: int = 0


_MPI_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH hydra
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
)


def _integer(environ: dict[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"{name} is not set; torchrun-style launches need RANK and WORLD_SIZE")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


_LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "PMIX_LOCAL_SIZE",
)


def local_size(size: int, environ: dict[str, str] | None = None) -> int:
    """The ranks on this host as the launcher counts them; all `size` ranks when it does not say."""
    env = dict(os.environ) if environ is None else environ
    for name in _LOCAL_SIZE_VARIABLES:
        if env.get(name):
            value = _integer(env, name)
            if value < 1:
                raise ValueError(f"{name}={value}: a host runs 1 rank or more; fix or unset it")
            # More than the job's size is a launcher's count from before an elastic job shrank.
            return min(value, max(size, 1))
    return max(size, 1)


def detect(environ: dict[str, str] | None = None) -> LaunchInfo:
    """Reads the launcher's variables; a plain `python` run is a single rank."""
    env = dict(os.environ) if environ is None else environ
    for rank_var, size_var, local_var in _MPI_VARIABLES:
        if rank_var in env and (size_var in env or rank_var == "PMIX_RANK"):
            return LaunchInfo(
                "mpiexec",
                _integer(env, rank_var),
                _integer(env, size_var, 0),  # 0: ask MPI (PMIx does not always export a size)
                _integer(env, local_var, 0),
            )
    if "RANK" in env or "WORLD_SIZE" in env:
        rank = _integer(env, "RANK")
        size = _integer(env, "WORLD_SIZE")
        if not 0 <= rank < size:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={size}; RANK must be in [0, WORLD_SIZE)")
        return LaunchInfo(
            "torchrun",
            rank,
            size,
            _integer(env, "LOCAL_RANK", rank),
            env.get("MASTER_ADDR", ""),
            _integer(env, "MASTER_PORT", 0),
        )
    return LaunchInfo("single", 0, 1, 0)
