"""The Python Gloo transport (commsched._gloo made unimportable) when a rank stops with a 128 MiB
allreduce in flight: SIGSTOPped, the other rank exits within COMMSCHED_STALL_SHUTDOWN + 10 s of the
fault naming it; by commsched.shutdown(), both ranks' waits end at once naming the shutdown. At 2
ranks under commsched-run; nothing of the job may be left behind."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch, unglue  # tests/ is on sys.path (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "fault_ranks" / "inflight_rank.py"
RANKS = 2
STALL_TIMEOUT_S = 1
STALL_SHUTDOWN_S = 3
SURVIVOR_BOUND_S = STALL_SHUTDOWN_S + 10
JOB_LIMIT_S = 60


def _alive(pid: int) -> bool:
    """True while `pid` runs (or is stopped); a zombie has exited."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _run(fault: str, directory: Path) -> tuple[str, dict[int, float], int]:
    """Runs the job; returns its output, when each rank exited (time.time()) and the launcher's status."""
    (directory / "sitecustomize.py").write_text("import sys\nsys.modules['commsched._gloo'] = None\n")
    environment = clean_rank_env(directory, ROOT)
    environment.update(
        {
            "COMMSCHED_TRANSPORT": "gloo",
            "COMMSCHED_STALL_TIMEOUT": str(STALL_TIMEOUT_S),
            "COMMSCHED_STALL_SHUTDOWN": str(STALL_SHUTDOWN_S),
        }
    )
    output_path = directory / "output.txt"
    exited: dict[int, float] = {}
    with open(output_path, "w") as output:
        command = local_launch(RANKS, str(SCRIPT), "--fault", fault, "--out", str(directory))
        # The stopped rank is the launcher's to end once rank 0 reported: soon, to keep the test short.
        command[command.index("-n") : command.index("-n")] = ["--grace", "1"]
        process = subprocess.Popen(
            command,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + JOB_LIMIT_S
        pids: dict[int, int] = {}
        try:
            while time.monotonic() < deadline and (process.poll() is None or len(exited) < len(pids)):
                for rank in range(RANKS):
                    path = directory / f"pid.{rank}"
                    if rank not in pids and path.exists() and path.read_text():
                        pids[rank] = int(path.read_text())
                    if rank in pids and rank not in exited and not _alive(pids[rank]):
                        exited[rank] = time.time()
                time.sleep(0.02)
        finally:
            left = [pid for pid in pids.values() if _alive(pid)]
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
    output_text = unglue(output_path.read_text(errors="replace"), "FAULT-SEEN ", "PATH ")
    assert not left, f"ranks left behind (killed now): {left}\n{output_text}"
    return output_text, exited, process.returncode


@pytest.fixture
def python_gloo() -> None:
    """Skips without PyTorch (the Python Gloo transport runs on torch.distributed)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch")


def _fault_time(directory: Path, output: str) -> float:
    path = directory / "fault.time"
    assert path.exists(), f"rank 1 never reached the fault:\n{output[-4000:]}"
    return float(path.read_text())


def _assert_python_path(output: str) -> None:
    for rank in range(RANKS):
        assert f"PATH rank {rank}: python (" in output, output[-4000:]


def test_a_rank_stopped_mid_allreduce_is_named_in_time(tmp_path: Path, python_gloo: None) -> None:
    """Rank 1 SIGSTOPs with a 128 MiB allreduce on the wire: rank 0 exits in time naming rank 1."""
    output, exited, status = _run("stop", tmp_path)
    _assert_python_path(output)
    fault_at = _fault_time(tmp_path, output)
    assert 0 in exited, output
    seconds = exited[0] - fault_at
    print(f"python gloo, stop in flight: rank 0 exited {seconds:.1f}s after the fault")
    assert seconds <= SURVIVOR_BOUND_S, f"rank 0 exited {seconds:.1f}s after the fault:\n{output}"
    seen = [line for line in output.splitlines() if line.startswith("FAULT-SEEN rank 0:")]
    assert seen and "rank 1" in seen[0] and "'large'" in seen[0], output
    assert status != 0, output
    assert "terminate called" not in output, output


def test_shutdown_mid_allreduce_ends_every_wait_at_once(tmp_path: Path, python_gloo: None) -> None:
    """Rank 1 calls commsched.shutdown() with a 128 MiB allreduce submitted: both ranks' waits end
    within a few seconds, with NotRunningError naming rank 1's shutdown, or both with the result
    where the allreduce was already launched."""
    output, exited, status = _run("shutdown", tmp_path)
    _assert_python_path(output)
    fault_at = _fault_time(tmp_path, output)
    assert sorted(exited) == [0, 1], output
    seconds = max(exited.values()) - fault_at
    print(f"python gloo, shutdown in flight: both ranks exited {seconds:.1f}s after it")
    assert seconds <= STALL_SHUTDOWN_S + 2, (
        f"the last rank exited {seconds:.1f}s after the shutdown:\n{output}"
    )
    # On a loaded host the allreduce may already be launched on both ranks when rank 1 shuts
    # down; its shutdown then lets it finish, and both waits succeed. Either way, all ranks agree.
    done = [rank for rank in range(RANKS) if f"RANK-DONE {rank}" in output]
    if done == list(range(RANKS)):
        assert "FAULT-SEEN" not in output, output
        return
    for rank in range(RANKS):
        seen = [line for line in output.splitlines() if line.startswith(f"FAULT-SEEN rank {rank}:")]
        assert seen, output
        assert "NotRunningError" in seen[0] and "shutdown() was called on rank 1" in seen[0], seen[0]
        assert "'large'" in seen[0], seen[0]
    assert status != 0, output
    assert "terminate called" not in output, output
