"""scripts/horovod_suite.py: Horovod-style test files run against commsched through module renames only.

One rank's launches check the runner itself: a collection error is reported as an error, a test
past --timeout fails by name, and --reference (here a stand-in venv that runs the same python
without renames) lists the tests that pass there and not through the renames.

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
    argv += ["--one-launch"]  # one launch for the five checks: per-test launches are checked below
    argv += ["--report-dir", str(tmp_path), str(CHECKS)]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=300)
    summary = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped", result.stdout)
    failures = "".join(p.read_text() for p in tmp_path.glob("rank*.failures"))
    assert summary, result.stdout[-3000:] + result.stderr[-3000:]
    assert summary.groups() == ("5", "0", "0"), result.stdout[-3000:] + failures[-6000:]
    assert result.returncode == 0


SUITE = REPO / "scripts" / "horovod_suite.py"
PROBE = """
import sys, time

def renamed():
    return any(type(finder).__name__ == "_RenameFinder" for finder in sys.meta_path)

def test_passes():
    assert sum(range(4)) == 6

def test_hangs_through_renames():
    if renamed():
        time.sleep(120)

def test_only_without_renames():
    assert not renamed()
"""


def test_collection_error_is_an_error_not_zero_tests(tmp_path: Path) -> None:
    """A test file that cannot be imported gives exit status 2 and pytest's message, never 0/0/0."""
    broken = tmp_path / "test_broken.py"
    broken.write_text("import horovod.spark\n\ndef test_never():\n    pass\n")
    argv = [sys.executable, str(SUITE), "--report-dir", str(tmp_path / "reports"), str(broken)]
    result = subprocess.run(
        argv, check=False, capture_output=True, text=True, env=clean_rank_env(REPO), timeout=120
    )
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ERROR commsched: pytest collected no tests" in result.stdout, result.stdout[-3000:]
    assert "horovod.spark has no commsched counterpart" in result.stdout, result.stdout[-3000:]
    assert "0 passed" not in result.stdout


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_per_test_launches_timeout_by_name_and_reference_gap(tmp_path: Path) -> None:
    """Each test runs alone; a hang fails as a timeout by name; --reference lists what passes only there."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    venv = tmp_path / "reference"
    (venv / "bin").mkdir(parents=True)
    for name, target in [("python", sys.executable), ("mpiexec", mpiexec())]:
        wrapper = venv / "bin" / name  # a script, not a link: each finds its own files from its real path
        wrapper.write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
        wrapper.chmod(0o755)
    argv = [sys.executable, str(SUITE), "--ranks", "1", "--timeout", "8", "--stack-dump", "0"]
    argv += ["--report-dir", str(tmp_path / "reports"), "--reference", str(venv), str(probe)]
    env = clean_rank_env(REPO)
    result = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=120)
    out = result.stdout
    assert result.returncode == 1, out[-3000:] + result.stderr[-3000:]
    assert "commsched: 1 ranks (mpiexec): 1 passed, 2 failed, 0 skipped" in out, out[-3000:]
    assert "horovod: 1 ranks (mpiexec): 3 passed, 0 failed, 0 skipped" in out, out[-3000:]
    hang = re.search(r"commsched: FAILED +\S+::test_hangs_through_renames +\(timeout", out)
    assert hang, out[-3000:]
    gap = sorted(re.findall(r"^HOROVOD-ONLY \S+::(\w+)", out, re.MULTILINE))
    assert gap == ["test_hangs_through_renames", "test_only_without_renames"], out[-3000:]
    assert "2 tests pass on Horovod and not on commsched" in out
