"""benchmarks/soak.py at 2 ranks for a few seconds: the random mix with process sets, join rounds and
checkpoints passes, every kind is exercised, and each kind's flag turns it off."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_transports import TRANSPORTS, rank_environment

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
TRANSPORT = next((t for t in ("mpi", "gloo", "grpc") if TRANSPORTS[t]), None)
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _soak(*arguments: str) -> str:
    command = [sys.executable, str(SOAK), "--ranks", "2", "--transport", str(TRANSPORT), "--minutes", "0.05"]
    command += ["--tensors", "20", "--hang-after", "20", *arguments]
    done = subprocess.run(
        command, check=False, env=rank_environment(), capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "wrong results: 0" in output and "hangs: 0" in output, output
    return output


def _number(pattern: str, output: str) -> int:
    found = re.search(pattern, output)
    assert found, f"{pattern!r} not in {output}"
    return int(found.group(1))


@pytest.mark.skipif(TRANSPORT is None, reason="needs MPI, torch (Gloo) or grpcio")
def test_soak_with_process_sets_join_and_checkpoints() -> None:
    output = _soak("--join-chance", "0.5", "--checkpoint-chance", "0.5")
    assert _number(r"on process sets \(\[0\] \[1\]\): (\d+)", output) > 0
    assert _number(r"while a rank had joined: (\d+)", output) > 0
    assert _number(r"join rounds: (\d+)", output) > 0
    assert _number(r"allgathers refused naming the joined rank: (\d+)", output) > 0
    if HAVE_TORCH:
        assert _number(r"checkpoints: (\d+) saved", output) > 0
        assert _number(r"(\d+) versions loaded bit-exact", output) > 0
    else:
        assert "checkpoints: off (torch is not importable)" in output


@pytest.mark.skipif(TRANSPORT is None, reason="needs MPI, torch (Gloo) or grpcio")
def test_soak_flags_turn_the_new_kinds_off() -> None:
    output = _soak("--no-process-sets", "--join-chance", "0", "--checkpoint-chance", "0")
    assert "on process sets (off): 0" in output
    assert "join rounds: off" in output
    assert "checkpoints: off" in output
    assert _number(r"on every rank: (\d+)", output) > 0
