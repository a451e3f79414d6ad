"""Process sets at 3 ranks over each transport, one launch per transport: every collective on
{0,1}, {1,2}, {0,2} and the global set against numpy, a set's collective completing while the rank
outside it waits elsewhere, non-members refused, remove and add again, DistributedOptimizer on a
set (tests/ranks/process_sets_suite.py); gRPC runs each set on a ring of its members."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from test_transports import TRANSPORTS, launch_command, rank_environment

SUITE = Path(__file__).resolve().parent / "ranks" / "process_sets_suite.py"
TENSORFLOW = importlib.util.find_spec("tensorflow") is not None
GLOO_NATIVE_BUILT = (
    importlib.util.find_spec("torch") is not None and importlib.util.find_spec("commsched._gloo") is not None
)


def _run(transport: str, tmp_path: Path, python_path: Path | None = None) -> str:
    signals = tmp_path / "signals"
    signals.mkdir()
    arguments = ["--transport", transport, "--signal-dir", str(signals)]
    if transport == "mpi" and TENSORFLOW:  # one launch checks commsched.tensorflow's eager road too
        arguments.append("--tensorflow")
    command = launch_command(transport, 3, SUITE, arguments)
    env = rank_environment()
    if python_path is not None:
        env["PYTHONPATH"] = f"{python_path}:{env['PYTHONPATH']}"
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@pytest.mark.parametrize("transport", ["mpi", "gloo", "grpc"])
def test_process_sets_over_transport(transport: str, tmp_path: Path) -> None:
    """Every check passes on every rank, over the native Gloo transport where it is built."""
    if not TRANSPORTS[transport]:
        pytest.skip(f"{transport} is not available here")
    output = _run(transport, tmp_path)
    path = (
        " (native)"
        if transport == "gloo" and GLOO_NATIVE_BUILT
        else " (python)"
        if transport == "gloo"
        else ""
    )
    for rank in range(3):
        assert f"rank {rank}: PROCESS SETS OK" in output and f"over {transport}{path}" in output, output


@pytest.mark.full  # the Python Gloo transport's sets; tests/test_gloo_native.py checks its fallback
def test_process_sets_over_python_gloo(tmp_path: Path) -> None:
    """The Python Gloo transport (commsched._gloo made unimportable) builds member-only groups too."""
    if not TRANSPORTS["gloo"]:
        pytest.skip("gloo is not available here")
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['commsched._gloo'] = None\n")
    output = _run("gloo", tmp_path, python_path=tmp_path)
    for rank in range(3):
        assert f"rank {rank}: PROCESS SETS OK" in output and "over gloo (python)" in output, output


def test_process_set_arguments_are_checked_on_one_rank() -> None:
    """Bad ranks, unregistered sets and a second set of every rank are refused naming the fix."""
    import numpy as np

    import commsched

    commsched.init(transport="loopback")
    try:
        with pytest.raises(ValueError, match="must be between 0 and 0"):
            commsched.add_process_set([1])
        with pytest.raises(ValueError, match="name a rank twice"):
            commsched.ProcessSet([0, 0])
        with pytest.raises(TypeError, match="list of ranks"):
            commsched.add_process_set(3)
        loose = commsched.ProcessSet([0])
        with pytest.raises(ValueError, match="not registered"):
            commsched.allreduce(np.ones(2), process_set=loose)
        with pytest.raises(ValueError, match="not registered"):
            loose.size()
        # As Horovod's: a set of every rank repeats hvd.global_process_set, so it is refused.
        with pytest.raises(ValueError, match="every rank: that is hvd.global_process_set"):
            commsched.add_process_set(loose)
        assert loose.process_set_id is None and commsched.get_process_sets() == {0: [0]}
        assert str(loose) == "ProcessSet(process_set_id=None, ranks=[0], mpi_comm=None)"
        np.testing.assert_array_equal(
            commsched.allreduce(np.ones(2), op="average", process_set=commsched.global_process_set), [1, 1]
        )
        assert not commsched.remove_process_set(commsched.global_process_set)
        assert not commsched.remove_process_set(loose)
    finally:
        commsched.shutdown()
