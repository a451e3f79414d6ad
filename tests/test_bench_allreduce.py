"""`commsched-bench allreduce` on 2 MPI ranks: the table, its JSON and its arithmetic."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"
if not MPIEXEC.exists():
    MPIEXEC = Path(shutil.which("mpiexec") or "/nonexistent")


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_allreduce_table_on_two_ranks(tmp_path):
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
