"""Horovod's join() for ranks that run out of data early: uneven epochs over every transport at 2 and
3 ranks (tests/ranks/join_suite.py, checked against numpy and a one-process SGD), TensorFlow eager,
and its refusals on one rank."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_transports import TRANSPORTS, launch_command, rank_environment

import commsched

SUITE = Path(__file__).resolve().parent / "ranks" / "join_suite.py"
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TF = importlib.util.find_spec("tensorflow") is not None
REPEATS = {("mpi", 2), ("grpc", 2), ("gloo", 3)}  # cells only the full matrix runs


def _run(transport: str, ranks: int, arguments: list[str]) -> str:
    command = launch_command(transport, ranks, SUITE, ["--transport", transport, *arguments])
    done = subprocess.run(
        command, check=False, env=rank_environment(), capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


# Each transport once in the default run: 3 ranks (a joined rank between two others) and Gloo at 2.
JOIN_CELLS = [
    pytest.param(transport, ranks, marks=[pytest.mark.full] if (transport, ranks) in REPEATS else [])
    for transport in sorted(TRANSPORTS)
    for ranks in (2, 3)
]


@pytest.mark.parametrize(("transport", "ranks"), JOIN_CELLS)
def test_uneven_epochs_end_in_join(transport: str, ranks: int) -> None:
    """Allreduce (inline and on the wire) with joined ranks, broadcast and allgather refused meanwhile,
    join's answer on every rank, an even epoch after it, DistributedOptimizer training on uneven batches, shutdown while joined."""
    if not TRANSPORTS[transport]:
        pytest.skip(f"{transport} is not available here")
    output = _run(transport, ranks, ["--torch"] if HAVE_TORCH else [])
    for rank in range(ranks):
        assert f"rank {rank}: JOIN OK inline_bytes=4096" in output, output[-6000:]
        assert f"rank {rank}: JOIN OK inline_bytes=0" in output, output[-6000:]
        assert f"rank {rank}: SHUTDOWN WHILE JOINED OK" in output, output[-6000:]
        assert f"rank {rank}: ALL JOIN OK over {transport}" in output, output[-6000:]
        if HAVE_TORCH:
            assert f"rank {rank}: TORCH JOIN OK" in output, output[-6000:]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_join_takes_part_in_process_sets(transport: str) -> None:
    """Sets {0,1}, {1,2}, {0,1,2}; rank 0 joins: allreduces on its sets get its zeros, the kinds that
    cannot take zeros fail at once naming rank 0, a barrier completes; nothing waits for the stall limit."""
    if not TRANSPORTS[transport]:
        pytest.skip(f"{transport} is not available here")
    output = _run(transport, 3, ["--sets"])
    for rank in range(3):
        assert f"rank {rank}: JOIN IN SETS OK" in output, output[-6000:]


@pytest.mark.skipif(not HAVE_TF or not TRANSPORTS["grpc"], reason="needs tensorflow and grpcio")
def test_tensorflow_eager_join() -> None:
    """commsched.tensorflow: the ranks still stepping reduce with the joined rank's zeros; join() agrees."""
    output = _run("grpc", 2, ["--tensorflow-only"])
    for rank in range(2):
        assert f"rank {rank}: TENSORFLOW JOIN OK" in output, output[-6000:]


def test_join_on_one_rank_returns_at_once_and_training_goes_on(one_rank: None) -> None:
    """A single rank is every rank: join() returns 0 and the next allreduce is its own data."""
    assert commsched.join() == 0
    assert commsched.join() == 0
    np.testing.assert_array_equal(commsched.allreduce(np.arange(3.0)), np.arange(3.0))


def test_join_before_init_names_the_fix() -> None:
    """join() without a running commsched says to call init()."""
    with pytest.raises(commsched.CommschedError, match=r"commsched.init\(\)"):
        commsched.join()
