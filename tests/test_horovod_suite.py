"""scripts/horovod_suite.py: Horovod-style test files run against commsched through module renames only.

The 2-rank test runs tests/horovod_style/checks_through_renames.py (our own checks, written as
Horovod's tests are) under mpiexec through the runner, and reads the runner's per-test verdicts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import horovod_suite
from mpirun import clean_rank_env, mpiexec

pytest.importorskip("torch")
CHECKS = REPO / "tests" / "horovod_style" / "checks_through_renames.py"


def test_verdict_counts_a_test_once_over_all_ranks() -> None:
    """Any failing rank, or a rank with no outcome, fails a test; skipped needs every rank to skip."""
    assert horovod_suite.verdict(["passed", "passed"], 2) == "passed"
    assert horovod_suite.verdict(["passed", "failed"], 2) == "failed"
    assert horovod_suite.verdict(["passed"], 2) == "failed"
    assert horovod_suite.verdict(["skipped", "skipped"], 2) == "skipped"
    assert horovod_suite.verdict(["skipped", "passed"], 2) == "passed"


def test_outcomes_name_the_test_a_rank_never_finished(tmp_path: Path) -> None:
    """A rank log that ends on "running" (a hang, or a rank stopped) fails that test."""
    (tmp_path / "rank0.log").write_text("running a::t1\npassed a::t1\nrunning a::t2\npassed a::t2\n")
    (tmp_path / "rank1.log").write_text("running a::t1\npassed a::t1\nrunning a::t2\n")
    found, unfinished = horovod_suite.outcomes(tmp_path)
    assert found == {"a::t1": ["passed", "passed"], "a::t2": ["passed", "failed"]}
    assert unfinished == ["rank1: a::t2"]


def test_renames_give_the_commsched_modules_and_refuse_unknown_ones() -> None:
    """horovod.torch is commsched.torch itself; a horovod module without a counterpart names the table."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import horovod_suite; horovod_suite.install_renames()\n"
        "import commsched.torch, commsched.threads, horovod.torch as hvd\n"
        "from horovod.runner.util.threads import in_thread\n"
        "assert hvd is commsched.torch and in_thread is commsched.threads.in_thread\n"
        "try:\n    import horovod.spark\nexcept ImportError as e:\n    print('refused:', e)\n"
        "try:\n    hvd.start_timeline('/tmp/never.json')\nexcept ValueError as e:\n    print('before init:', e)\n"
    )
    env = clean_rank_env(REPO)
    result = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "scripts")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: horovod.spark has no commsched counterpart" in result.stdout
    assert "before init: start_timeline() needs commsched started" in result.stdout


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_horovod_style_checks_pass_on_two_ranks(tmp_path: Path) -> None:
    """Collectives, start/stop_timeline, nccl_built, the optimizer warning and in_thread, at 2 ranks."""
    env = clean_rank_env(REPO)
    argv = [sys.executable, str(REPO / "scripts" / "horovod_suite.py"), "--ranks", "2", "--timeout", "240"]
    argv += ["--report-dir", str(tmp_path), str(CHECKS)]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=300)
    summary = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped", result.stdout)
    failures = "".join(p.read_text() for p in tmp_path.glob("rank*.failures"))
    assert summary, result.stdout[-3000:] + result.stderr[-3000:]
    assert summary.groups() == ("5", "0", "0"), result.stdout[-3000:] + failures[-6000:]
    assert result.returncode == 0
