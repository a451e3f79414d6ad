"""`commsched-bench allreduce` on 2 MPI ranks and on 2 gRPC ranks: the table, its JSON and its arithmetic."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commsched.bench import allreduce
from commsched.bench.tcp_baseline import TcpRing

MPIEXEC = Path(sys.executable).parent / "mpiexec"
if not MPIEXEC.exists():
    MPIEXEC = Path(shutil.which("mpiexec") or "/nonexistent")


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_allreduce_table_on_two_ranks(tmp_path):
    pytest.importorskip("mpi4py")
    out = tmp_path / "allreduce.json"
    argv = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "commsched.bench.cli", "allreduce"]
    argv += ["-b", "4", "-e", "64KiB", "-f", "64", "-n", "3", "-w", "1", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "busbw" in proc.stdout and "raw us" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and data["transport"] == "mpi"
    rows = data["results"]
    assert [row["size"] for row in rows] == [4, 256, 16384]
    for row in rows:
        assert row["count"] == row["size"] // 4
        # algbw = size / time, and busbw = algbw * 2(n-1)/n = algbw on 2 ranks.
        assert row["algbw"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9, rel=1e-6)
        assert row["busbw"] == pytest.approx(row["algbw"])
        assert row["raw_busbw"] == pytest.approx(row["size"] / (row["raw_time_us"] * 1e-6) / 1e9, rel=1e-6)
        assert row["time_ratio"] == pytest.approx(row["time_us"] / row["raw_time_us"])


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_allreduce_json_to_stdout_is_only_json():
    """--json - leaves stdout to the JSON; the header and the table go to stderr."""
    pytest.importorskip("mpi4py")
    argv = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "commsched.bench.cli", "allreduce"]
    argv += ["-b", "4", "-e", "256", "-f", "64", "-n", "2", "-w", "1", "--repeats", "1", "--json", "-"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert [row["size"] for row in data["results"]] == [4, 256]
    assert "# commsched allreduce on 2 ranks over mpi" in proc.stderr and "busbw" in proc.stderr


def test_grpc_allreduce_table_against_the_ring_without_the_core(tmp_path):
    pytest.importorskip("grpc")
    out = tmp_path / "allreduce.json"
    argv = [sys.executable, "-m", "commsched.run", "-n", "2", "-m", "commsched.bench.cli", "allreduce"]
    argv += ["--transport", "grpc", "-b", "4", "-e", "64KiB", "-f", "16", "-n", "3", "-w", "1"]
    argv += ["--repeats", "1", "--json", str(out)]
    # A hang at shutdown (a transport left open) ends in the timeout.
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    # Each size's result was checked on both paths before timing (a wrong sum exits non-zero).
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(raw: commsched gRPC ring without the core)" in proc.stdout.splitlines()[0]
    assert "raw us" in proc.stdout and "busbw/raw" in proc.stdout
    assert "; tcp: TCP socket ring;" in proc.stdout.splitlines()[0] and "busbw/tcp" in proc.stdout
    # A stream that ended without goodbye logs "grpc: ..." at error level.
    assert "grpc:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and data["transport"] == "grpc"
    assert data["raw"] == "commsched gRPC ring without the core"
    rows = data["results"]
    assert [row["size"] for row in rows] == [4, 64, 1024, 16384]
    for row in rows:
        assert row["raw_time_us"] > 0 and row["time_us"] > 0
        assert row["raw_busbw"] > 0 and row["busbw"] > 0
        assert row["busbw_ratio"] == pytest.approx(row["busbw"] / row["raw_busbw"])
        assert row["time_ratio"] == pytest.approx(row["time_us"] / row["raw_time_us"])
        # The TCP baseline's sum was checked too; its busbw is computed like the others'.
        assert row["tcp_busbw"] == pytest.approx(row["size"] / (row["tcp_time_us"] * 1e-6) / 1e9, rel=1e-6)
        assert row["tcp_ratio"] == pytest.approx(row["busbw"] / row["tcp_busbw"])
        assert row["raw_tcp_ratio"] == pytest.approx(row["raw_busbw"] / row["tcp_busbw"])
    assert data["tcp"] == "TCP socket ring"


def _tcp_rings(size: int) -> list[Any]:
    """`size` TcpRings on loopback, wired the way TcpRing.connect wires them across processes."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(size)]
    rights = [socket.create_connection(listeners[(r + 1) % size].getsockname()) for r in range(size)]
    lefts = [listener.accept()[0] for listener in listeners]
    for listener in listeners:
        listener.close()
    return [TcpRing(r, size, (rights[r], lefts[r]), timeout_s=10) for r in range(size)]


@pytest.mark.parametrize(("size", "count"), [(2, 1), (2, 1_000_003), (3, 10), (3, 300_001)])
def test_tcp_baseline_ring_sums_like_numpy(size: int, count: int) -> None:
    """The baseline's ring (threads standing in for processes) ends with numpy's sum on every rank."""
    rings = _tcp_rings(size)
    rng = np.random.default_rng(count)
    inputs = [rng.integers(-8, 8, count).astype(np.float32) for _ in range(size)]
    buffers = [part.copy() for part in inputs]
    errors: list[BaseException] = []

    def reduce(rank: int) -> None:
        try:
            rings[rank].allreduce(buffers[rank])
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for ring in rings:
        ring.close()
    assert not errors, errors
    expected = np.sum(np.stack(inputs), axis=0)
    for buffer in buffers:
        assert np.array_equal(buffer, expected)


def test_tcp_baseline_names_a_silent_neighbour() -> None:
    """A ring whose neighbour never sends stops with an error, not a hang."""
    rings = _tcp_rings(2)
    rings[0].timeout_s = 0.5
    try:
        with pytest.raises(SystemExit, match="rank 0: the TCP baseline moved nothing for 0s"):
            rings[0].allreduce(np.ones(1_000_000, np.float32))
    finally:
        for ring in rings:
            ring.close()


def test_sum_check_catches_a_missing_rank_or_segment():
    parts = [np.empty(10, np.float32) for _ in range(2)]
    for rank, part in enumerate(parts):
        allreduce.fill(part, rank)
    total = parts[0] + parts[1]
    assert allreduce.check_sum(total, 2)
    assert not allreduce.check_sum(parts[0] * 2, 2)  # one rank's values doubled: no exchange happened
    half = total.copy()
    half[5:] = parts[0][5:]  # the second segment never arrived
    assert not allreduce.check_sum(half, 2)


@pytest.mark.parametrize(
    ("transport", "environ", "launcher"),
    [
        ("mpi", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "mpiexec -n 2"),
        ("grpc", {"PMI_RANK": "0", "PMI_SIZE": "2"}, "python -m commsched.run -n 2"),
        ("gloo", {"PMI_RANK": "0", "PMI_SIZE": "2"}, "torchrun"),
    ],
)
def test_a_launcher_that_cannot_start_the_transport_names_the_command(transport, environ, launcher):
    with pytest.raises(SystemExit, match=f"--transport {transport}: this process .*; run: {launcher}"):
        allreduce.check_launch(transport, environ)


def test_launchers_that_fit_pass_the_check():
    allreduce.check_launch("grpc", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    allreduce.check_launch("grpc", {"PMI_RANK": "0", "PMI_SIZE": "2", "COMMSCHED_GRPC_PEERS": "h:1,h:2"})
    allreduce.check_launch("mpi", {"PMI_RANK": "0", "PMI_SIZE": "2"})
    allreduce.check_launch("mpi", {})  # a single rank
