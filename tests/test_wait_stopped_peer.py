"""`Handle.wait(timeout)` keeps its timeout while a peer is stopped (SIGSTOP): the agreement round the
waiting thread drives is left open at the deadline instead of blocking until COMMSCHED_STALL_SHUTDOWN,
and the next driver finishes it once the peer runs again, so the collective still completes exactly.
A shutdown() beside a stopped rank stops without it after COMMSCHED_STALL_TIMEOUT (10 s at most).
Over MPI's exchange and over the TCP control channel (native Gloo)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch, mpiexec

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "ranks" / "wait_stopped_peer.py"


def _launch(transport: str, *args: str) -> list[str]:
    """Argv for the rank program on 2 ranks over `transport`."""
    if transport == "mpi":
        launcher = mpiexec()
        if launcher is None or importlib.util.find_spec("commsched._mpi") is None:
            pytest.skip("commsched._mpi or mpiexec is not here")
        return [launcher, "-n", "2", sys.executable, str(PROGRAM), "--transport", "mpi", *args]
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("commsched._gloo") is None:
        pytest.skip("commsched._gloo was not built here")
    return local_launch(2, str(PROGRAM), "--transport", "gloo", *args)


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_timed_waits_return_on_time_and_the_round_resumes(transport: str) -> None:
    """Each timed wait raises within 0.5 s of its timeout; after SIGCONT both ranks get 1 + 2 = 3."""
    done = subprocess.run(
        _launch(transport), env=clean_rank_env(ROOT), capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    waits = re.findall(r"rank 0: wait\(([\d.]+)\) raised TimeoutError after ([\d.]+)s", output)
    assert len(waits) == 2, output
    for timeout, took in waits:
        assert float(took) < float(timeout) + 0.5, output
    assert "rank 0: sum 3" in output and "rank 1: sum 3" in output, output
    assert re.search(
        r"an agreement round has waited [\d.]+s, past COMMSCHED_STALL_TIMEOUT, for rank 1 ", output
    ), output
    assert done.returncode == 0, output


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_shutdown_beside_a_stopped_rank_returns_after_the_stall_timeout(transport: str) -> None:
    """shutdown() with rank 1 stopped returns after about COMMSCHED_STALL_TIMEOUT (2 s), not the 40 s limit."""
    done = subprocess.run(
        _launch(transport, "--shutdown"),
        env=clean_rank_env(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    returned = re.search(r"rank 0: shutdown returned after ([\d.]+)s", output)
    assert returned, output
    assert 1.5 < float(returned.group(1)) < 6.0, output
    assert "did not all answer within 2s" in output, output
