"""GPU tensors through the core and the NCCL transport, checked against the fake libnccl/libcudart of
tests/fake_cuda.py (host memory stands in for device memory): the ordering event is recorded at
submit on the caller's stream, average runs as ncclAvg through the core's scale hook, copies go
through cudaMemcpyAsync on commsched's stream, fusion stays off, and auto picks NCCL for GPU tensors."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import pytest
from fake_cuda import FakeCudaArray, calls

import commsched
from commsched.config import SettingError, resolve
from commsched.transports import nccl


@pytest.fixture
def nccl_runtime(nccl_env: ctypes.CDLL):
    """commsched on the fake NCCL, shut down after the test; yields the fake's handle."""
    yield nccl_env
    commsched.shutdown()


def _comm() -> Any:
    """The running NCCL communicator (commsched._nccl.Communicator)."""
    return commsched._state.device_transport._comm


def test_event_is_recorded_at_submit_on_the_callers_stream(nccl_runtime: ctypes.CDLL) -> None:
    """One event per tensor, recorded on the submitting thread on the array's stream; every chunk of the
    partitioned tensor waits on that same event before NCCL runs on commsched's stream."""
    commsched.init(transport="nccl", partition_bytes="4KiB")
    data = FakeCudaArray(np.ones(4096, np.float32), stream=0x5EED)  # 16 KiB: four chunks
    commsched.allreduce(data, name="big", timeout=30)
    assert np.array_equal(data.host, np.full(4096, 2, np.float32))
    log = calls(nccl_runtime)
    records = [c for c in log if c.startswith("record") and "0x5eed" in c]
    assert records == ["record ev1 on 0x5eed main device 0"], log
    reduces = [i for i, c in enumerate(log) if c.startswith("allreduce")]
    assert [log[i] for i in reduces] == ["allreduce 1024 type 7 op 0 other"] * 4, log
    assert all(log[i - 1] == "wait own ev1" for i in reduces), log
    assert log.index("record ev1 on 0x5eed main device 0") < reduces[0]
    assert _comm().submitted_count == 0  # every chunk started: nothing left behind


def test_streams_of_the_array_protocols(nccl_runtime: ctypes.CDLL) -> None:
    """CUDA array interface stream None: no ordering needed, so no event; 2 (per-thread default
    stream) is recorded as given, on the submitting thread."""
    commsched.init(transport="nccl")
    commsched.allreduce(FakeCudaArray(np.ones(8, np.float32), stream=None), name="free", timeout=30)
    commsched.allreduce(FakeCudaArray(np.ones(8, np.float32), stream=2), name="per_thread", timeout=30)
    log = calls(nccl_runtime)
    first, second = [i for i, c in enumerate(log) if c.startswith("allreduce")]
    assert not log[first - 1].startswith("wait"), log
    assert log[second - 1] == "wait own ev2" and "record ev2 on 0x2 main device 0" in log, log


def test_average_runs_as_nccl_avg_through_the_scale_hook(
    nccl_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """op="average": NCCL averages (ncclAvg); the core's scale hook reaches the transport once per chunk
    and leaves the data alone (the fake's sum would double it, a host division by one would not undo that)."""
    hooked: list[tuple[int, int, str, float]] = []
    original = nccl.NcclTransport.scale

    def scale(self: nccl.NcclTransport, address: int, count: int, dtype: str, divisor: float) -> None:
        hooked.append((address, count, dtype, divisor))
        original(self, address, count, dtype, divisor)

    monkeypatch.setattr(nccl.NcclTransport, "scale", scale)
    commsched.init(transport="nccl", partition_bytes="4KiB")
    data = FakeCudaArray(np.arange(2048, dtype=np.float32))  # two chunks
    commsched.allreduce(data, name="avg", op="average", timeout=30)
    assert np.array_equal(data.host, np.arange(2048, dtype=np.float32))
    assert [c for c in calls(nccl_runtime) if c.startswith("allreduce")] == [
        "allreduce 1024 type 7 op 4 other"
    ] * 2
    base = data.host.ctypes.data
    assert sorted(hooked) == [(base, 1024, "float32", 1.0), (base + 4096, 1024, "float32", 1.0)]


def test_old_nccl_refuses_average_with_a_clear_error(
    nccl_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ncclAvg (NCCL < 2.10) op="average" is refused at submit, naming the tensor and the fix;
    sums still run and the name is free again."""
    monkeypatch.setenv("FAKE_NCCL_VERSION", "2803")
    commsched.init(transport="nccl")
    data = FakeCudaArray(np.ones(16, np.float32))
    with pytest.raises(ValueError, match=r"tensor 'g'.*NCCL 2\.10 or newer.*NCCL 2\.8\.3.*op=\"sum\""):
        commsched.allreduce(data, name="g", op="average", timeout=30)
    commsched.allreduce(data, name="g", timeout=30)
    assert np.array_equal(data.host, np.full(16, 2, np.float32))


def test_a_refused_submission_is_forgotten(nccl_runtime: ctypes.CDLL) -> None:
    """When the core refuses a tensor after the transport recorded its event, the record is dropped."""
    commsched.init(transport="nccl")
    with pytest.raises(ValueError, match="floating dtype"):
        commsched.allreduce(FakeCudaArray(np.ones(4, np.int32)), name="ints", op="average")
    assert _comm().submitted_count == 0


def test_fusion_is_off_for_device_tensors(
    nccl_runtime: ctypes.CDLL, caplog: pytest.LogCaptureFixture
) -> None:
    """Small GPU tensors are never fused (the core's fusion buffer is host memory), even when asked."""
    with caplog.at_level(logging.WARNING, logger="commsched"):
        commsched.init(transport="nccl", fusion_bytes="1MiB")
    assert "COMMSCHED_FUSION_BYTES is ignored" in caplog.text
    assert commsched.config()["fusion_bytes"] == 0
    commsched.reconfigure(fusion_bytes="1MiB")
    arrays = [FakeCudaArray(np.ones(32, np.float32)) for _ in range(6)]
    handles = [commsched.allreduce_async(a, name=f"small{i}") for i, a in enumerate(arrays)]
    for handle in handles:
        handle.wait(30)
    assert commsched.stats()["fused_launches"] == 0
    assert commsched.config()["fusion_bytes"] == 0
    assert not [c for c in calls(nccl_runtime) if c.startswith("memcpy")]


def test_copy_and_scale_hooks_of_the_communicator(nccl_env: ctypes.CDLL) -> None:
    """copy(): after the source's submit event, cudaMemcpyAsync on commsched's stream, then a synchronize.
    A host fusion buffer is refused by the collectives; scale() refuses data NCCL did not average."""
    from commsched import _nccl

    api = nccl.load_api()
    comm = _nccl.Communicator(api, _nccl.unique_id(api), 0, 1, 0)
    source = np.arange(64, dtype=np.float32)
    target = np.zeros(64, np.float32)
    comm.submitted(source.ctypes.data, source.nbytes, False, 0xABC)
    nccl_env.fake_reset()
    comm.copy(target.ctypes.data, source.ctypes.data + 16, 64)
    assert np.array_equal(target[:16], source[4:20])
    assert calls(nccl_env) == ["wait own ev1", "memcpy 64 kind 4 on own", "sync own"]
    with pytest.raises(RuntimeError, match=r"in no tensor submitted.*COMMSCHED_FUSION_BYTES=0"):
        comm.allreduce(target.ctypes.data, 64, "float32")
    with pytest.raises(RuntimeError, match="NCCL did not average"):
        comm.scale(source.ctypes.data, 64, "float32", 1.0)


def test_calls_keep_the_callers_current_device(nccl_env: ctypes.CDLL) -> None:
    """CUDA's current device is per thread: the communicator works on its own device and puts the
    caller's back (here the caller is on device 1, the communicator on device 0)."""
    from commsched import _nccl

    nccl_env.cudaSetDevice(1)
    api = nccl.load_api()
    comm = _nccl.Communicator(api, _nccl.unique_id(api), 0, 1, 0)
    data = np.ones(4, np.float32)
    comm.submitted(data.ctypes.data, data.nbytes, False, 0xABC)
    assert nccl_env.fake_current_device() == 1
    log = calls(nccl_env)
    assert "init on device 0" in log and "record ev1 on 0xabc main device 0" in log, log
    nccl_env.fake_reset()
    del comm  # destroyed on its own device, then the caller's is back
    assert calls(nccl_env) == ["setdevice 0", "destroy", "setdevice 1"]
    assert nccl_env.fake_current_device() == 1
    nccl_env.cudaSetDevice(0)


def test_mixing_host_and_device_tensors_fails_clearly(nccl_env: ctypes.CDLL) -> None:
    """A host array under NCCL, or a GPU array under a host transport, is refused naming the tensor and the fix."""
    commsched.init(transport="nccl")
    try:
        with pytest.raises(TypeError, match=r"tensor 'cpu_grad' is in host memory.*move it to the GPU"):
            commsched.allreduce(np.ones(4, np.float32), name="cpu_grad")
        with pytest.raises(ValueError, match=r"tensor 'elsewhere' is on cuda:1.*cuda:0"):
            commsched.allreduce(FakeCudaArray(np.ones(4, np.float32), device_id=1), name="elsewhere")
    finally:
        commsched.shutdown()
    commsched.init(transport="loopback")
    try:
        with pytest.raises(TypeError, match=r"tensor 'gpu_grad' lives on a GPU.*init\(device='cuda'\)"):
            commsched.allreduce(FakeCudaArray(np.ones(4, np.float32)), name="gpu_grad")
    finally:
        commsched.shutdown()


def test_device_cuda_makes_auto_choose_nccl(
    nccl_runtime: ctypes.CDLL, caplog: pytest.LogCaptureFixture
) -> None:
    """init(device="cuda") with COMMSCHED_TRANSPORT=auto picks NCCL and says so at info level."""
    with caplog.at_level(logging.INFO, logger="commsched"):
        commsched.init(device="cuda", log_level="info")
    assert "COMMSCHED_TRANSPORT=auto chose nccl (the buffers live on a GPU" in caplog.text
    assert commsched.config()["transport"] == "nccl"


def test_first_gpu_tensor_makes_auto_choose_nccl(
    nccl_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With a GPU visible and device/transport left to auto, the first submitted tensor decides: on a GPU,
    NCCL. Until then rank, size and config answer without starting a transport."""
    monkeypatch.setattr(commsched, "_gpu_visible", lambda: True)
    with caplog.at_level(logging.INFO, logger="commsched"):
        commsched.init(log_level="info")
        assert commsched.is_initialized()
        assert (commsched.rank(), commsched.size(), commsched.local_rank()) == (0, 1, 0)
        assert commsched.config()["transport"].startswith("auto")
        assert commsched.stats() == {}
        assert not [c for c in calls(nccl_runtime) if c.startswith("init")]
        data = FakeCudaArray(np.ones(8, np.float32))
        commsched.allreduce(data, name="first", timeout=30)
    assert "COMMSCHED_TRANSPORT=auto chose nccl" in caplog.text
    assert commsched.config()["transport"] == "nccl"
    assert np.array_equal(data.host, np.full(8, 2, np.float32))


def test_first_host_tensor_makes_auto_choose_a_host_transport(
    nccl_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host tensor first: a host transport, and a later GPU tensor is refused with the fix."""
    monkeypatch.setattr(commsched, "_gpu_visible", lambda: True)
    commsched.init()
    commsched.allreduce(np.ones(4, np.float32), name="host_first", timeout=30)
    assert commsched.config()["transport"] == "loopback"
    with pytest.raises(TypeError, match=r"tensor 'later' lives on a GPU.*device='cuda'"):
        commsched.allreduce(FakeCudaArray(np.ones(4, np.float32)), name="later")


def test_device_and_transport_must_agree() -> None:
    """device="cuda" needs NCCL (or auto); NCCL needs GPU tensors."""
    with pytest.raises(SettingError, match="COMMSCHED_DEVICE=cuda needs COMMSCHED_TRANSPORT=nccl or auto"):
        resolve({"device": "cuda", "transport": "gloo"}, {})
    with pytest.raises(SettingError, match="COMMSCHED_TRANSPORT=nccl moves GPU memory only"):
        resolve({}, {"COMMSCHED_DEVICE": "cpu", "COMMSCHED_TRANSPORT": "nccl"})
    with pytest.raises(SettingError, match=r"COMMSCHED_DEVICE: 'tpu'.*auto, cpu, cuda"):
        resolve({}, {"COMMSCHED_DEVICE": "tpu"})
