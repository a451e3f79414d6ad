"""The native Gloo transport's ring reduce-scatter and all-gather (csrc/transport/gloo/gloo_ring.cc):
exact for every dtype and op with uneven parts, on every rank and on a process set, at 2 and 3 ranks;
small collectives stay on Gloo's own; a peer leaving mid-ring fails the others with a named error;
a bad COMMSCHED_GLOO_RING is refused by name."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "ranks" / "gloo_ring.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("commsched._gloo") is None,
    reason="commsched._gloo was not built here",
)


def run(ranks: int, *arguments: str) -> str:
    """Runs the rank program on `ranks` local ranks; returns its output, failing the test on a bad exit."""
    done = subprocess.run(
        local_launch(ranks, str(PROGRAM), *arguments),
        env=clean_rank_env(ROOT),
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_collectives_are_exact(ranks: int) -> None:
    """Every rank checks every result against numpy and that the ring (and, when small, Gloo) carried it."""
    output = run(ranks)
    for rank in range(ranks):
        assert f"rank {rank}: RING OK" in output, output


def test_a_peer_leaving_mid_ring_fails_the_collective_with_a_named_error() -> None:
    """Rank 1 exits while a 64 MiB reduce-scatter runs: rank 0's fails with an error, within the timeout."""
    output = run(2, "--peer-exits")
    assert "rank 0: failed as expected" in output, output


def test_a_bad_ring_setting_is_refused_naming_the_variable(tmp_path: Path) -> None:
    """COMMSCHED_GLOO_RING=yes fails init() with the variable and the values it takes."""
    program = tmp_path / "init.py"
    program.write_text("import commsched\ncommsched.init(transport='gloo')\n")
    env = {**clean_rank_env(ROOT), "COMMSCHED_GLOO_RING": "yes"}
    done = subprocess.run(
        local_launch(1, str(program)), env=env, check=False, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "COMMSCHED_GLOO_RING=yes: give 1" in output, output
