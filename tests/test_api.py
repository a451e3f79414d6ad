"""Single-process tests of the Python API: settings, rank discovery, buffers, timeline, misuse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import commsched
from commsched import launch
from commsched.config import (
    SettingError,
    Settings,
    default_credit,
    parse_duration,
    parse_size,
    resolve,
    timeline_path_for,
)


@pytest.fixture
def runtime():
    """A loopback runtime, shut down after the test."""
    commsched.init(transport="loopback")
    yield
    commsched.shutdown()


def test_sizes_and_durations_take_units() -> None:
    """4MiB, 512KB, plain counts; 500ms, 2min."""
    assert parse_size("4MiB") == 4 * 1024**2
    assert parse_size("512KB") == 512_000
    assert parse_size("1048576") == 1048576
    assert parse_size("1.5 KiB") == 1536
    assert parse_duration("500ms") == pytest.approx(0.5)
    assert parse_duration("2min") == 120
    for bad in ("4 parsecs", "-1", "MiB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_environment_settings_are_validated_with_variable_and_form() -> None:
    """A bad COMMSCHED_* value names the variable and the accepted form."""
    with pytest.raises(SettingError, match=r"COMMSCHED_PARTITION_BYTES: '4 parsecs'.*e\.g\. 4MiB"):
        resolve({}, {"COMMSCHED_PARTITION_BYTES": "4 parsecs"})
    with pytest.raises(SettingError, match=r"COMMSCHED_POLICY: 'lifo'.*priority, fifo"):
        resolve({}, {"COMMSCHED_POLICY": "lifo"})
    with pytest.raises(SettingError, match="COMMSCHED_STALL_TIMEOUT"):
        resolve({}, {"COMMSCHED_STALL_TIMEOUT": "soon"})
    with pytest.raises(SettingError, match="COMMSCHED_CREDIT_BYTES must be above 0"):
        resolve({}, {"COMMSCHED_CREDIT_BYTES": "0"})
    with pytest.raises(SettingError, match=r"init\(log_level=\.\.\.\)"):
        resolve({"log_level": "chatty"}, {})
    with pytest.raises(SettingError, match="unknown setting"):
        resolve({"partition": 5}, {})
    with pytest.raises(SettingError, match=r"COMMSCHED_POLL_INTERVAL must be at most 10ms.*e\.g\. 20us"):
        resolve({}, {"COMMSCHED_POLL_INTERVAL": "2s"})
    with pytest.raises(SettingError, match=r"COMMSCHED_POLL_INTERVAL: 'often'.*e\.g\. 20us"):
        resolve({}, {"COMMSCHED_POLL_INTERVAL": "often"})
    assert resolve({}, {"COMMSCHED_POLL_INTERVAL": "20us"}).poll_interval == pytest.approx(20e-6)
    assert resolve({}, {"COMMSCHED_POLL_INTERVAL": "0"}).poll_interval == 0.0
    assert resolve({}, {}).poll_interval is None


def test_arguments_override_environment() -> None:
    """init() arguments beat COMMSCHED_* variables, which beat the defaults."""
    env = {"COMMSCHED_POLICY": "fifo", "COMMSCHED_FUSION_BYTES": "2MiB", "COMMSCHED_TIMELINE": "/tmp/x.json"}
    settings = resolve({"fusion_bytes": "64KiB"}, env)
    assert settings.policy == "fifo"
    assert settings.fusion_bytes == 65536
    assert settings.timeline == "/tmp/x.json"
    assert settings.partition_bytes == Settings().partition_bytes


def test_default_credit_is_one_partition_per_rank() -> None:
    """Unset, the credit is a partition per rank, 2 to 16 of them; a given credit always wins."""
    mib = 1024**2
    assert [Settings().credit_for(n) for n in (1, 2, 3, 8, 16, 1024)] == [
        8 * mib,
        8 * mib,
        12 * mib,
        32 * mib,
        64 * mib,
        64 * mib,
    ]
    assert resolve({"partition_bytes": "1MiB"}, {}).credit_for(4) == 4 * mib
    assert resolve({}, {"COMMSCHED_CREDIT_BYTES": "3MiB"}).credit_for(64) == 3 * mib
    assert default_credit(0, 4) == 4 * Settings().partition_bytes  # partitioning off
    with pytest.raises(SettingError, match="COMMSCHED_CREDIT_BYTES must be above 0"):
        resolve({}, {"COMMSCHED_CREDIT_BYTES": "0"})


def test_timeline_path_per_rank() -> None:
    """Rank 0 keeps the path; other ranks get a suffix unless the path has {rank}."""
    assert timeline_path_for("t.json", 0, 4) == "t.json"
    assert timeline_path_for("t.json", 2, 4) == "t.rank2.json"
    assert timeline_path_for("out/t-{rank}.json", 3, 4) == "out/t-3.json"
    assert timeline_path_for("", 1, 2) == ""


def test_rank_discovery_from_launchers() -> None:
    """mpiexec (hydra, Open MPI) and torchrun variables; a plain run is one rank."""
    hydra = launch.detect({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"})
    assert (hydra.launcher, hydra.rank, hydra.size, hydra.local_rank) == ("mpiexec", 2, 4, 0)
    ompi = launch.detect(
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    )
    assert (ompi.launcher, ompi.rank, ompi.size) == ("mpiexec", 1, 2)
    torchrun = launch.detect(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    )
    assert (torchrun.launcher, torchrun.rank, torchrun.size, torchrun.local_rank) == ("torchrun", 3, 4, 1)
    assert (torchrun.master_addr, torchrun.master_port) == ("10.0.0.1", 29500)
    assert launch.detect({}).launcher == "single"
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        launch.detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        launch.detect({"RANK": "0", "WORLD_SIZE": "two"})


def test_local_size_from_launchers() -> None:
    """torchrun's, Open MPI's and hydra's count of ranks on the host; all ranks when none says."""
    assert launch.local_size(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert launch.local_size(8, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert launch.local_size(8, {"MPI_LOCALNRANKS": "8"}) == 8
    assert launch.local_size(3, {}) == 3
    assert launch.local_size(2, {"LOCAL_WORLD_SIZE": "3"}) == 2  # torchrun's count, the job since shrunk
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=0: a host runs 1 rank or more"):
        launch.local_size(4, {"LOCAL_WORLD_SIZE": "0"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x'"):
        launch.local_size(4, {"LOCAL_WORLD_SIZE": "x"})


def test_single_rank_allreduce_and_broadcast(runtime: None) -> None:
    """One rank: sum and broadcast leave data as it is; average of one rank too."""
    data = np.arange(10, dtype=np.float64)
    assert commsched.allreduce(data, "a", op="average") is data
    assert np.array_equal(data, np.arange(10))
    ints = np.arange(5, dtype=np.int32)
    handle = commsched.broadcast_async(ints, root=0, name="b")
    assert np.array_equal(handle.wait(timeout=10), np.arange(5))
    assert handle.done()
    assert commsched.config()["transport"] == "loopback"
    # One rank has no link to partition for; the credit counts in default partitions.
    assert commsched.config()["partition_bytes"] == 0
    assert commsched.config()["credit_bytes"] == 2 * 4 * 1024**2
    assert commsched.size() == 1 and commsched.rank() == 0 and commsched.local_rank() == 0


def test_buffer_protocol_objects_work(runtime: None) -> None:
    """Any writable buffer-protocol array works, not just numpy."""
    import array

    values = array.array("d", [1.0, 2.0])
    commsched.allreduce(values, "buffer")
    assert list(values) == [1.0, 2.0]
    torch = pytest.importorskip("torch")
    tensor = torch.ones(3, dtype=torch.bfloat16)
    commsched.allreduce(tensor, "bf16", op="average")
    assert tensor.float().tolist() == [1.0, 1.0, 1.0]


def test_synchronous_calls_take_every_host_buffer(runtime: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-call path for host buffers reads each supported format right (a wrong dtype would change the bytes)."""
    import array

    def slow_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host buffer went through the Python view")

    monkeypatch.setattr(commsched.submission, "_enqueue", slow_path)

    for values in (
        bytearray(b"\x01\x02"),
        array.array("b", [-1, 2]),
        array.array("i", [-3, 4]),
        array.array("q", [2**40, -5]),
        np.array([1.5, -2.25], np.float16),
        np.array([[1, 2], [3, 4]], np.int64),
        memoryview(np.arange(4, dtype=np.float32)),
    ):
        before = bytes(memoryview(values))
        assert commsched.allreduce(values, f"sum.{type(values).__name__}") is values
        assert commsched.broadcast(values, 0, f"bcast.{type(values).__name__}") is values
        assert bytes(memoryview(values)) == before
    commsched.allreduce(np.ones(3), priority=2**31 - 1)  # unnamed, the largest priority
    assert commsched.stats()["completed_tensors"] == 15


def test_async_allreduce_takes_host_buffers_in_one_call(
    runtime: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """allreduce_async hands a named host buffer to the core without the Python view, and leaves
    torch tensors and numpy-integer priorities to the checked path."""
    import array

    def slow_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host buffer went through the Python view")

    monkeypatch.setattr(commsched.submission, "_enqueue", slow_path)
    for values in (
        bytearray(b"\x01\x02"),
        array.array("q", [2**40, -5]),
        np.array([[1, 2], [3, 4]], np.int64),
    ):
        before = bytes(memoryview(values))
        handle = commsched.allreduce_async(values, f"async.{type(values).__name__}", priority=-3)
        assert handle.wait(timeout=10) is values and handle.name == f"async.{type(values).__name__}"
        assert bytes(memoryview(values)) == before
    averaged = commsched.allreduce_async(np.full(3, 4.0), "async.average", op="average").wait(10)
    assert averaged.tolist() == [4.0, 4.0, 4.0]
    monkeypatch.undo()
    taken: list[str] = []
    checked = commsched.submission._enqueue

    def counting(array: object, name: str, *args: object, **kwargs: object) -> object:
        taken.append(name)
        return checked(array, name, *args, **kwargs)

    monkeypatch.setattr(commsched.submission, "_enqueue", counting)
    commsched.allreduce_async(np.ones(2), "numpy-priority", priority=np.int32(1)).wait(10)
    torch = pytest.importorskip("torch")
    commsched.allreduce_async(torch.ones(2), "torch-tensor").wait(10)
    assert taken == ["numpy-priority", "torch-tensor"]


@pytest.mark.parametrize("wait", [False, True], ids=["async", "sync"])
def test_misuse_gets_clear_errors(runtime: None, wait: bool) -> None:
    """Read-only, non-contiguous, unsupported dtype, bool average, bad root, bad op, bad priority."""
    allreduce = commsched.allreduce if wait else commsched.allreduce_async
    broadcast = commsched.broadcast if wait else commsched.broadcast_async
    readonly = np.ones(3)
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="'ro'.*read-only"):
        allreduce(readonly, "ro")
    with pytest.raises(TypeError, match="not C-contiguous"):
        allreduce(np.ones((4, 4))[:, 1], "strided")
    with pytest.raises(TypeError, match="not supported"):
        allreduce(np.ones(3, dtype=np.complex64), "complex")
    with pytest.raises(TypeError, match="not supported"):
        allreduce(np.ones(3, dtype=np.uint16), "uint16")
    with pytest.raises(TypeError, match="byte order"):
        allreduce(np.ones(3, dtype=">f4"), "big_endian")
    with pytest.raises(ValueError, match='op="average" is not defined for bool'):
        allreduce(np.ones(3, dtype=bool), "bools", op="average")
    with pytest.raises(ValueError, match="root 3 is not a rank"):
        broadcast(np.ones(3), root=3, name="root")
    with pytest.raises(ValueError, match="op of 'x'"):
        allreduce(np.ones(3), "x", op="maximum")
    with pytest.raises(TypeError, match="priority of 'p'"):
        allreduce(np.ones(3), "p", priority=2**31)
    with pytest.raises(TypeError, match="tensor name must be"):
        allreduce(np.ones(3), "")
    settings = commsched.config()
    commsched.init(policy="fifo")  # as Horovod's: a second init() while running changes nothing
    assert commsched.config() == settings


def test_calls_before_init_fail_clearly() -> None:
    """Using commsched before init() names the fix."""
    with pytest.raises(commsched.NotRunningError, match=r"needs commsched.init\(\) first"):
        commsched.allreduce_async(np.ones(2), "early")
    with pytest.raises(commsched.NotRunningError, match=r"needs commsched.init\(\) first"):
        commsched.allreduce(np.ones(2), "early")
    with pytest.raises(commsched.NotRunningError, match=r"needs commsched.init\(\) first"):
        commsched.config()


def test_timeline_is_a_chrome_trace(tmp_path: Path) -> None:
    """COMMSCHED_TIMELINE writes JSON with per-tensor phases, wire events and the credit counter."""
    path = tmp_path / "trace.json"
    commsched.init(transport="loopback", timeline=str(path), partition_bytes="1KiB")
    commsched.allreduce(np.ones(1000, np.float32), "big", priority=1)  # 4 chunks
    commsched.shutdown()
    events = json.loads(path.read_text())
    phases = {
        (e.get("name"), e["ph"]) for e in events if e.get("cat") == "tensor" and e["args"]["tensor"] == "big"
    }
    assert phases == {(p, ph) for p in ("negotiate", "queued", "on the wire") for ph in ("b", "e")}
    wire = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert sum('"big#' in json.dumps(e["args"]["chunks"]) for e in wire) == 4
    assert any(e["ph"] == "C" and e["name"] == "bytes in flight" for e in events)
    assert any(e["ph"] == "i" and e["name"] == "done big" for e in events)
    assert any(e["ph"] == "i" and e["name"] == "ready big" for e in events)
