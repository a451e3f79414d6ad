#!/usr/bin/env python3
"""The rig's bandwidth check: times a real allreduce through a NetRig with mpi4py or torch Gloo
against what the link rate allows (`netrig.py --check`). Run as a script, it is the worker inside
each rank: `netrig_check.py mpi|gloo --size BYTES --repeats N`."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netrig

RESULT_TAG = "NETRIG_RESULT "


@dataclass
class CheckResult:
    """Outcome of one allreduce timing through the rig."""

    backend: str
    n_ranks: int
    rate: str
    nbytes: int
    expected_s: float
    measured_s: float
    samples_s: list[float]
    link_tx_bytes: int

    @property
    def ratio(self) -> float:
        """Measured over expected time; about 1 when the link is the bottleneck."""
        return self.measured_s / self.expected_s

    def summary(self) -> str:
        """One human-readable line."""
        return (
            f"{self.backend:5s} n={self.n_ranks} rate={self.rate} size={self.nbytes / 2**20:.1f}MiB "
            f"expected={self.expected_s:.3f}s measured={self.measured_s:.3f}s "
            f"ratio={self.ratio:.2f} rank0_tx={self.link_tx_bytes / 2**20:.1f}MiB"
        )


def _parse_result(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise netrig.RigError(f"worker printed no result; output was:\n{stdout}")


def run_check(
    rig: netrig.NetRig, nbytes: int, backend: str = "mpi", repeats: int = 3, timeout_s: float = 120
) -> CheckResult:
    """Time a real allreduce of nbytes through the rig with mpi4py or torch gloo."""
    worker = [sys.executable, os.path.abspath(__file__), backend]
    worker += ["--size", str(nbytes), "--repeats", str(repeats)]
    before = rig.link_bytes(0)[1]
    if backend == "mpi":
        proc = rig.spawn(rig.mpiexec_argv(worker), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            raise netrig.RigError(f"mpi check failed ({proc.returncode}):\n{out}\n{err}")
    elif backend == "gloo":
        procs = [
            rig.spawn(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for a in rig.torch_argvs(worker)
        ]
        outs = [p.communicate(timeout=timeout_s) for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise netrig.RigError(f"gloo check failed:\n{outs}")
        out = outs[0][0]
    else:
        raise ValueError(f"backend must be 'mpi' or 'gloo', got {backend!r}")
    samples = _parse_result(out)["samples_s"]
    return CheckResult(
        backend=backend,
        n_ranks=rig.n_ranks,
        rate=rig.rate,
        nbytes=nbytes,
        expected_s=netrig.expected_allreduce_seconds(nbytes, rig.n_ranks, rig.rate_bps),
        measured_s=statistics.median(samples),
        samples_s=samples,
        link_tx_bytes=rig.link_bytes(0)[1] - before,
    )


def _worker(backend: str, nbytes: int, repeats: int) -> None:
    """Runs inside a rank: time allreduces, rank 0 prints the slowest rank's times."""
    import numpy as np

    count = max(1, nbytes // 4)
    samples: list[float] = []
    if backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        send, recv = np.ones(count, np.float32), np.empty(count, np.float32)
        comm.Allreduce(send[:1024], recv[:1024])  # connection setup outside the timing
        for _ in range(repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(send, recv)
            slowest = np.array([time.perf_counter() - t0])
            comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
            samples.append(float(slowest[0]))
        rank = comm.rank
        ok = bool(recv[0] == comm.size)
    else:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        buf = torch.ones(count)
        dist.all_reduce(torch.ones(1024))
        for _ in range(repeats):
            buf.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            samples.append(float(dt.item()))
        rank = dist.get_rank()
        ok = bool(buf[0].item() == dist.get_world_size())
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: allreduce returned a wrong sum")
    if rank == 0:
        print(RESULT_TAG + json.dumps({"samples_s": samples}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """The worker's entry point inside a rank."""
    parser = argparse.ArgumentParser(description="One rank of the rig's allreduce check.")
    parser.add_argument("backend", choices=("mpi", "gloo"))
    parser.add_argument("--size", type=int, required=True, help="bytes per allreduce")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    _worker(args.backend, args.size, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
