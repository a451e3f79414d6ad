"""benchmarks/gpu_check.py --fake: two ranks under mpiexec on the fake CUDA/NCCL library. Every
correctness row must pass with a library whose sums cross processes, and a wrong sum (one rank's
inputs changed after the reference was fixed) must fail its rows and the run's exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import clean_rank_env, mpiexec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check_worker as worker

needs_mpi = pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
# 12 dtype/op pairs, partitioned, fused, two dtypes at each of two stream places, and the
# further reductions and new-array collectives (allgather, reducescatter, alltoall)
ROWS = 74


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--fake", "--out", str(out), *args]
    done = subprocess.run(
        command, cwd=ROOT, env=clean_rank_env(ROOT), capture_output=True, text=True, timeout=170, check=False
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


@needs_mpi
def test_fake_run_passes_every_row(tmp_path: Path) -> None:
    """The fake's NCCL reduces across the two ranks: every correctness row passes and the run exits 0."""
    done, result = _run(tmp_path)
    rows = result["correctness"]
    assert len(rows) == ROWS and all(r["ranks"] == 2 for r in rows), rows
    failed = [r for r in rows if not r["passed"]]
    assert not failed, json.dumps(failed, indent=1)
    assert result["gpu_tests"]["passed"] and result["sweep"] and not result["training"]["ran"]
    assert done.returncode == 0, done.stdout[-3000:]


@needs_mpi
def test_a_wrong_sum_fails_its_rows_and_the_run(tmp_path: Path) -> None:
    """Rank 1 adds one to its inputs after the reference is fixed: every row reports wrong values and the
    exit status is non-zero."""
    done, result = _run(tmp_path, "--skip-tests", "--corrupt-rank", "1")
    rows = result["correctness"]
    assert len(rows) == ROWS, rows
    assert all(not r["passed"] and " wrong" in r["detail"] for r in rows), json.dumps(rows, indent=1)
    assert not result["passed"] and done.returncode == 1
    assert "FAIL" in done.stdout and "overall: FAIL" in done.stdout


def test_compare_finds_one_wrong_element_and_tolerates_only_rounding() -> None:
    """compare() is exact for sums and power-of-two averages, within rounding for other averages."""
    want = worker.expected("float32", "sum", 50, 2, salt=1)
    got = want.copy()
    assert worker.compare(got, want, "float32", "sum", 2) == ""
    got[17] += 1
    assert worker.compare(got, want, "float32", "sum", 2).startswith("1 of 50 wrong; [17]")
    third = worker.expected("bfloat16", "average", 50, 3, salt=2)
    rounded = third * (1 + 2.0**-9)
    assert worker.compare(rounded, third, "bfloat16", "average", 3) == ""
    assert worker.compare(third + 0.25, third, "bfloat16", "average", 3) != ""


def test_merge_fails_a_row_when_any_rank_failed() -> None:
    """A check passes only where every rank passed; the detail names the failing rank."""
    good = {"check": "allreduce", "passed": True, "detail": ""}
    bad = {"check": "allreduce", "passed": False, "detail": "3 of 9 wrong"}
    merged = worker.merge([[good, good], [good, bad]])
    assert merged[0]["passed"] and not merged[1]["passed"]
    assert merged[1]["detail"] == "rank 1: 3 of 9 wrong"
