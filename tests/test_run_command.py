"""commsched-run takes a command as horovodrun does (`-np 2 python train.py`), besides a script."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# One write per line: the ranks share the launcher's output, and print() of several arguments
# writes them one by one to an unbuffered stream, so two ranks' words could interleave.
PROGRAM = "import os, sys; sys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {sys.argv[1:]}\\n\")\n"


def _launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "commsched.run", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_command_runs_as_it_is_on_every_rank(tmp_path: Path) -> None:
    """`-np 2 <python> prog.py a b` starts the interpreter itself on both ranks, with the arguments; before,
    the interpreter's binary was read as a Python script and both ranks failed with a SyntaxError."""
    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    done = _launch("-np", "2", sys.executable, str(program), "a", "b")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 ['a', 'b']" in done.stdout, done.stdout


def test_an_executable_script_with_a_shebang_runs_itself(tmp_path: Path) -> None:
    """A file with a #! line and the executable bit is a command; without .py it is not this Python's."""
    program = tmp_path / "job"
    program.write_text('#!/bin/sh\necho "shell rank $RANK $1"\n')
    program.chmod(0o755)
    done = _launch("-n", "2", str(program), "x")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shell rank 0 x" in done.stdout and "shell rank 1 x" in done.stdout, done.stdout


def test_a_name_that_is_neither_file_nor_command_is_named() -> None:
    """A missing command is named once, before any rank starts, with the forms the launcher takes."""
    done = _launch("-n", "2", "no-such-command-here")
    assert done.returncode == 2
    assert "no-such-command-here: no such file or command" in done.stderr, done.stderr


def test_a_stopped_rank_is_ended_without_waiting_out_the_grace(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) and rank 0 then fails: the stopped rank cannot exit by itself, so
    the launcher sends SIGTERM and SIGCONT at once instead of after --grace, and the job ends."""
    program = tmp_path / "prog.py"
    program.write_text(
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    time.sleep(60)\n"
        "time.sleep(1)\n"
        "sys.exit(3)\n"
    )
    started = time.monotonic()
    done = _launch("-n", "2", "--grace", "30", str(program))
    took = time.monotonic() - started
    assert done.returncode == 3, done.stdout + done.stderr
    assert "rank 1 stopped (SIGSTOP) after the failure: SIGTERM and SIGCONT" in done.stderr, done.stderr
    assert took < 20, f"{took:.1f}s: the launcher waited out the 30 s grace"
