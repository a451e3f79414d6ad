"""A peer stopped (SIGSTOP, not exited) in the middle of a 64 MiB reduce-scatter or all-gather over the
native Gloo transport: the survivor's wait fails naming the stopped rank and the tensor within
COMMSCHED_STALL_SHUTDOWN, and its shutdown() returns at once instead of waiting on a Gloo receive that
never completes, on the ring collectives and on Gloo's own; on the Python Gloo transport the survivor
also exits with its own status when the stopped rank is killed while its interpreter finalizes."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "ranks" / "gloo_stopped_peer.py"
STALL_S = 2.0  # COMMSCHED_STALL_TIMEOUT and COMMSCHED_STALL_SHUTDOWN in the rank program

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("commsched._gloo") is None,
    reason="commsched._gloo was not built here",
)


@pytest.mark.parametrize(
    ("kind", "ring", "path"),
    [("reducescatter", "1", "native"), ("allgather", "0", "native"), ("reducescatter", "1", "python")],
)
def test_survivor_names_the_stopped_rank_and_shuts_down(
    kind: str, ring: str, path: str, tmp_path: Path
) -> None:
    """Rank 1 stops mid-collective: rank 0's wait names rank 1 and 'cut', and shutdown() takes under 2 s."""
    env = {**clean_rank_env(ROOT), "COMMSCHED_GLOO_RING": ring}
    extra: list[str] = []
    if path == "python":
        (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['commsched._gloo'] = None\n")
        env = {**clean_rank_env(tmp_path, ROOT), "COMMSCHED_GLOO_RING": ring}
        # The stuck collective then fails while rank 0 finalizes: a Python callback Gloo's thread
        # still had to run then ended the process in std::terminate instead of with status 3.
        extra = ["--kill-at-exit", "--stop-in-transport"]
    try:
        done = subprocess.run(
            local_launch(2, str(PROGRAM), "--kind", kind, "--pid-dir", str(tmp_path), *extra),
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        # Whatever happened to rank 0, the stopped rank must not outlive the test.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int((tmp_path / "pid.1").read_text()), signal.SIGKILL)
    output = done.stdout + done.stderr
    failed = re.search(r"rank 0: failed after ([\d.]+)s: (.*)", output)
    assert failed, output
    assert float(failed.group(1)) < 4 * STALL_S, output
    assert "'cut'" in failed.group(2) and "rank 1" in failed.group(2), output
    returned = re.search(r"rank 0: shutdown returned after ([\d.]+)s", output)
    assert returned and float(returned.group(1)) < 2.0, output
    assert f"over {path}" in output, output
    # Its exit after that is clean too: no Gloo thread left to throw once the stopped rank is gone.
    assert "rank 0: exiting" in output and "terminate called" not in output, output
