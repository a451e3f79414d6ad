"""benchmarks/commit_call.py: one short run at one rank (the figures are in docs/measurements.md)
writes its row with rank 0's commit() times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "commit_call.py"


def test_a_run_reports_commit_times(tmp_path: Path) -> None:
    out = tmp_path / "commit_call.json"
    argv = [sys.executable, str(SCRIPT), "--layers", "3", "--ranks", "1", "--runs", "1", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(row["ranks"], row["parameters"]) for row in rows] == [(1, 6)]
    for row in rows:
        (run,) = row["runs"]
        assert run["wall_ms"] > 0 and run["cpu_ms"] > 0 and run["capture_cpu_ms"] > 0, row
    assert "commit() ms" in done.stdout
