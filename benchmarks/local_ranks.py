"""Starts the ranks of a benchmark variant on this host, torchrun-style, and reads rank 0's result.

A benchmark's worker prints one line, its result tag followed by JSON, on rank 0; every rank is
one process of the benchmark's own script with the variables torch.distributed and commsched
read (MASTER_ADDR/PORT, RANK, WORLD_SIZE, ...), one thread each so the ranks do not crowd the host.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(argv: list[str], ranks: int, timeout: float, tag: str, what: str) -> dict[str, Any]:
    """Runs `argv` as `ranks` local processes and returns the JSON rank 0 printed after `tag`.

    `what` names the run in the error raised when a rank fails or rank 0 prints no result.
    """
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            # The checkout's commsched, also when the benchmark runs from another folder.
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return collect(procs, timeout, tag, what)


def run_on_rig(
    rig: Any, argv: list[str], env: dict[str, str], port: int, timeout: float, tag: str, what: str
) -> dict[str, Any]:
    """Runs `argv` as one process per rank of a benchmarks/netrig.py rig (torchrun-style variables
    for `port`, plus `env`) and returns the JSON rank 0 printed after `tag`."""
    procs = [
        rig.spawn(
            rig.command_for(i, argv, {**rig.torch_env(i, port), **env}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(rig.n_ranks)
    ]
    return collect(procs, timeout, tag, what)


def collect(procs: list[subprocess.Popen[str]], timeout: float, tag: str, what: str) -> dict[str, Any]:
    """Waits for the ranks' processes and returns the JSON rank 0 printed after `tag`; raises naming `what`."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # a rank past the timeout must not outlive the benchmark
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{what} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    for line in outputs[0].splitlines():
        if line.startswith(tag):
            return dict(json.loads(line[len(tag) :]))
    raise RuntimeError(f"{what}: rank 0 printed no result:\n{outputs[0][-3000:]}")
