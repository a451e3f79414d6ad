"""The collectives beyond allreduce (ops, scale factors, int16/bool, allgather, reducescatter,
alltoall, object forms, barrier, grouped allreduce): every one over every transport at 2 and 3
ranks against numpy (tests/ranks/collectives_suite.py), and their argument checks on one rank."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_transports import TRANSPORTS, launch_command, rank_environment

import commsched

SUITE = Path(__file__).resolve().parent / "ranks" / "collectives_suite.py"
GLOO_NATIVE_BUILT = (
    importlib.util.find_spec("torch") is not None and importlib.util.find_spec("commsched._gloo") is not None
)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_collectives_over_transport(transport: str, ranks: int) -> None:
    """Every collective, dtype and op, sync (inline road) and async (wire road), matches numpy on every rank."""
    if not TRANSPORTS[transport]:
        pytest.skip(f"{transport} is not available here")
    command = launch_command(transport, ranks, SUITE, ["--transport", transport])
    done = subprocess.run(
        command, check=False, env=rank_environment(), capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(ranks):
        assert f"rank {rank}: COLLECTIVES OK" in output and f"over {transport}" in output, output
    if transport == "gloo" and GLOO_NATIVE_BUILT:
        # Where commsched._gloo is built, every collective runs on it: nothing falls back to Python.
        assert output.count("over gloo (native, ") == ranks, output


def test_collectives_with_a_pause_between_tests_of_collectives_in_flight() -> None:
    """With COMMSCHED_POLL_INTERVAL (the pause across hosts) MPI still completes every collective correctly:
    the core sleeps between tests, so data moves only in the tests it does make."""
    if not TRANSPORTS["mpi"]:
        pytest.skip("mpi is not available here")
    command = launch_command("mpi", 3, SUITE, ["--transport", "mpi"])
    done = subprocess.run(
        command,
        check=False,
        env={**rank_environment(), "COMMSCHED_POLL_INTERVAL": "300us", "COMMSCHED_LOG_LEVEL": "info"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert all(f"rank {rank}: COLLECTIVES OK" in output for rank in range(3)), output
    assert output.count("pausing 300 us between tests of collectives in flight") >= 3, output


def test_results_on_one_rank_keep_shape_and_type(one_rank: None) -> None:
    """Allgather, reducescatter and alltoall return new arrays of the input's row shape (torch in, torch out)."""
    torch = pytest.importorskip("torch")
    array = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    gathered = commsched.allgather(array)
    assert gathered.shape == (3, 2, 2) and gathered.dtype == np.int16 and np.array_equal(gathered, array)
    assert gathered.ctypes.data != array.ctypes.data  # a new array, the input untouched
    halves = commsched.reducescatter(
        torch.ones(4, 3, dtype=torch.bfloat16), op=commsched.Average, postscale_factor=2
    )
    assert isinstance(halves, torch.Tensor) and halves.dtype == torch.bfloat16 and torch.all(halves == 2)
    output, received = commsched.alltoall(np.ones((2, 5), bool))
    assert output.dtype == bool and output.shape == (2, 5) and received == [2]
    assert commsched.allgather(np.float64(1.5) * np.ones(())).shape == (1,)  # a 0-d array is one row


def test_ops_and_arguments_are_checked(one_rank: None) -> None:
    """Ops in any case and as constants; what is not defined is refused naming the fix."""
    values = np.array([3, -1, 2], np.int32)
    assert commsched.allreduce(values, op="MIN") is values
    assert commsched.allreduce(np.array([-7], np.int64), op=commsched.Average)[0] == -7
    with pytest.raises(ValueError, match='op="sum" is not defined for bool'):
        commsched.allreduce(np.ones(2, bool), op="sum")
    with pytest.raises(ValueError, match='reducescatter takes op="sum" or "average"'):
        commsched.reducescatter(np.ones(2), op="max")
    with pytest.raises(ValueError, match="splits add up to 3 rows, but the array has 2"):
        commsched.alltoall(np.ones((2, 1)), splits=[3])
    with pytest.raises(ValueError, match="splits name 2 ranks, but there are 1"):
        commsched.alltoall(np.ones((2, 1)), splits=[1, 1])
    with pytest.raises(ValueError, match="apply to reductions only"):
        commsched.submission._enqueue(np.ones(2), "b", "broadcast", "sum", 0, 0, prescale=2.0)
    with pytest.raises(TypeError, match="prescale_factor of 'p' must be a number"):
        commsched.allreduce(np.ones(2), "p", prescale_factor="2")
    commsched.barrier()
    assert commsched.broadcast_object({"a": 1}) == {"a": 1}
    assert commsched.allgather_object(3) == [3]
    assert commsched.stats()["inline_tensors"] >= 1


def test_helpers_say_what_is_built_and_where(one_rank: None) -> None:
    """Horovod's helpers: sizes of this host and of the hosts, and what commsched was built with."""
    assert commsched.local_size() >= 1 and commsched.cross_size() >= 1 and commsched.cross_rank() == 0
    assert commsched.nccl_built() and isinstance(commsched.mpi_built(), bool)
    assert not commsched.mpi_enabled()


def test_host_buffers_reduce_scatter_and_gather_in_one_core_call(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named host buffers skip the Python view (one core call); what it cannot take goes the full way, same results."""
    torch = pytest.importorskip("torch")
    taken: list[bool] = []
    core_call = commsched._core.output_buffer_async

    def counted(*arguments: object) -> object:
        submitted = core_call(*arguments)
        taken.append(submitted is not None)
        return submitted

    monkeypatch.setattr(commsched._core, "output_buffer_async", counted)
    rows = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    for kind in ("allgather", "reducescatter"):
        run = getattr(commsched, f"{kind}_async")
        # Taken in one call: numpy of any row shape, a 0-d array, a bytearray, a CPU tensor.
        gathered = run(rows, name=f"{kind}.rows").wait()
        assert gathered.shape == (3, 2, 2) and gathered.dtype == np.int16 and np.array_equal(gathered, rows)
        assert gathered.ctypes.data != rows.ctypes.data
        assert run(np.array(2.5), name=f"{kind}.scalar").wait().tolist() == [2.5]
        assert bytes(run(bytearray(b"ab"), name=f"{kind}.bytes").wait()) == b"ab"
        tensor = run(torch.arange(6.0).reshape(3, 2), name=f"{kind}.tensor").wait()
        assert isinstance(tensor, torch.Tensor) and torch.equal(tensor, torch.arange(6.0).reshape(3, 2))
        assert taken == [True] * 4, taken
        taken.clear()
        # The full path: no buffer protocol, unnamed, a numpy priority; it names what it refuses.
        bf16 = run(torch.ones(2, 3, dtype=torch.bfloat16), name=f"{kind}.bf16").wait()
        assert bf16.dtype == torch.bfloat16 and torch.all(bf16 == 1)
        assert np.array_equal(run(np.arange(3.0)).wait(), np.arange(3.0))
        assert np.array_equal(
            run(np.arange(3.0), name=f"{kind}.p", priority=np.int64(2)).wait(), np.arange(3.0)
        )
        frozen = np.arange(4.0)
        frozen.flags.writeable = False
        with pytest.raises(TypeError, match=f"tensor '{kind}.frozen': the array is read-only"):
            run(frozen, name=f"{kind}.frozen")
        with pytest.raises(TypeError, match=f"tensor '{kind}.strided'.*contiguous"):
            run(np.arange(8.0)[::2], name=f"{kind}.strided")
        assert taken == [False, False], taken  # the core hands back only the read-only and strided arrays
        taken.clear()
    averaged = commsched.reducescatter_async(np.full(4, 6, np.int32), op="average", name="avg").wait()
    assert averaged.dtype == np.int32 and averaged.tolist() == [6] * 4 and taken == [True]
    with pytest.raises(ValueError, match='reducescatter takes op="sum" or "average"'):
        commsched.reducescatter_async(np.ones(2), op="max", name="max")
    with pytest.raises(ValueError, match='op="sum" is not defined for bool'):
        commsched.reducescatter_async(np.ones(2, bool), name="bools")
    with pytest.raises(TypeError, match="tensor name must be a non-empty string"):
        commsched.allgather_async(np.ones(2), name="")
