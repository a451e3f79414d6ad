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


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """`python -m commsched.launch -n N script.py ...`: N local ranks, torchrun-style variables and a
    fresh COMMSCHED_JOB_TOKEN (unless one is set), so gRPC peers accept only this job."""
    import argparse
    import secrets
    import subprocess
    import sys
    import time

    parser = argparse.ArgumentParser(prog="python -m commsched.launch", description=main.__doc__)
    parser.add_argument("-n", "--nproc", type=int, required=True, help="ranks to start on this host")
    parser.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument("-m", dest="module", action="store_true", help="run the program as a module")
    parser.add_argument("program")
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    base = dict(os.environ)
    base.setdefault("COMMSCHED_JOB_TOKEN", secrets.token_hex(16))
    base.update(
        MASTER_ADDR=base.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(args.master_port or _free_port()),
        WORLD_SIZE=str(args.nproc),
    )
    command = [sys.executable] + (["-m"] if args.module else []) + [args.program] + args.arguments
    children = [
        subprocess.Popen(command, env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)))
        for rank in range(args.nproc)
    ]
    # One rank failing leaves the others waiting on it until their stall timeout; they report it
    # themselves, so the launcher only waits and returns the first failure.
    status = 0
    while children:
        for child in list(children):
            code = child.poll()
            if code is not None:
                children.remove(child)
                status = status or code
        time.sleep(0.05)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
