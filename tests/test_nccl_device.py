"""GPU tensors through the core and the native NCCL transport on one rank, checked against the fake
libnccl/libcudart of tests/fake_cuda (host memory stands in for device memory, stream work runs on
worker threads): the ordering event is recorded at submit on the caller's stream, average runs as
ncclAvg, fusion copies run on commsched's stream, and auto picks NCCL for GPU tensors. Exact results
across real ranks are in tests/test_device_ranks.py."""

from __future__ import annotations

import ctypes
import logging
import time

import numpy as np
import pytest
from fake_cuda import FakeCudaArray, calls, launch_write

import commsched
from commsched.config import SettingError, resolve


@pytest.fixture
def nccl_runtime(nccl_env: ctypes.CDLL):
    """commsched on the fake NCCL, shut down after the test; yields the fake's handle."""
    yield nccl_env
    commsched.shutdown()


def test_event_is_recorded_at_submit_on_the_callers_stream(nccl_runtime: ctypes.CDLL) -> None:
    """One event per tensor, recorded on the submitting thread on the array's stream; every chunk of the
    partitioned tensor waits on that same event before NCCL runs on commsched's stream, launched from
    the core (no Python on that path)."""
    commsched.init(transport="nccl", partition_bytes="4KiB")
    data = FakeCudaArray(np.arange(4096, dtype=np.float32), stream=0x5EED)  # 16 KiB: four chunks
    commsched.allreduce(data, name="big", timeout=30)
    assert np.array_equal(data.host, np.arange(4096, dtype=np.float32))  # one rank: the sum is the tensor
    log = calls(nccl_runtime)
    records = [c for c in log if c.startswith("record") and "0x5eed" in c]
    assert len(records) == 1 and records[0].endswith("on 0x5eed main device 0"), log
    event = records[0].split()[1]
    reduces = [i for i, c in enumerate(log) if c.startswith("allreduce")]
    # Launched by the core, from its own thread or from the waiting caller that drives it.
    assert [log[i].rsplit(" ", 1)[0] for i in reduces] == ["allreduce 1024 type 7 op 0"] * 4, log
    assert all(log[i - 1] == f"wait own {event}" for i in reduces), log
    assert log.index(records[0]) < reduces[0]
    assert commsched.stats()["launches"] == 4


def test_streams_of_the_array_protocols(nccl_runtime: ctypes.CDLL) -> None:
    """CUDA array interface stream None: no ordering needed, so no event; 2 (per-thread default
    stream) is recorded as given, on the submitting thread."""
    commsched.init(transport="nccl", fusion_bytes=0)
    commsched.allreduce(FakeCudaArray(np.ones(8, np.float32), stream=None), name="free", timeout=30)
    commsched.allreduce(FakeCudaArray(np.ones(8, np.float32), stream=2), name="per_thread", timeout=30)
    log = calls(nccl_runtime)
    first, second = [i for i, c in enumerate(log) if c.startswith("allreduce")]
    assert not log[first - 1].startswith("wait"), log
    per_thread = [c for c in log if c.startswith("record") and " on 0x2 main " in c]
    assert len(per_thread) == 1 and log[second - 1] == f"wait own {per_thread[0].split()[1]}", log


def test_average_runs_as_nccl_avg(nccl_runtime: ctypes.CDLL) -> None:
    """op="average": NCCL averages (ncclAvg) inside the collective, chunk by chunk; the core never
    touches the device memory on the host (the transport refuses host copies and divisions)."""
    commsched.init(transport="nccl", partition_bytes="4KiB")
    data = FakeCudaArray(np.arange(2048, dtype=np.float32))  # two chunks
    commsched.allreduce(data, name="avg", op="average", timeout=30)
    assert np.array_equal(data.host, np.arange(2048, dtype=np.float32))
    reduces = [c.rsplit(" ", 1)[0] for c in calls(nccl_runtime) if c.startswith("allreduce")]
    assert reduces == ["allreduce 1024 type 7 op 4"] * 2


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
    assert np.array_equal(data.host, np.ones(16, np.float32))


def test_a_refused_submission_leaves_nothing_behind(nccl_runtime: ctypes.CDLL) -> None:
    """A tensor the core refuses after the transport recorded its event (a name in flight) is forgotten:
    the same memory under a free name reduces normally."""
    commsched.init(transport="nccl")
    data = FakeCudaArray(np.ones(4, np.float32))
    with pytest.raises(ValueError, match='nccl transport does not implement op="average" of integers'):
        commsched.allreduce(FakeCudaArray(np.ones(4, np.int32)), name="ints", op="average")
    nccl_runtime.fake_set_delay_us(200_000)  # keeps "held" in flight while the duplicate is refused
    held = commsched.allreduce_async(data, name="held")
    with pytest.raises(ValueError, match="already in flight"):
        commsched.allreduce_async(FakeCudaArray(np.ones(4, np.float32)), name="held")
    nccl_runtime.fake_set_delay_us(0)
    held.wait(30)
    commsched.allreduce(data, name="again", timeout=30)
    assert np.array_equal(data.host, np.ones(4, np.float32))


def test_small_device_tensors_are_fused_on_the_device(nccl_runtime: ctypes.CDLL) -> None:
    """Fusion is on for GPU tensors: small ones are copied into a device buffer on commsched's stream
    (after their producers), reduced by one NCCL launch, and copied back, all without a host sync.

    A first tensor, too big to fuse, whose producer writes 300 ms late holds the credit, so the
    small ones queue behind it and go out together, whatever the host's timing."""
    commsched.init(transport="nccl", fusion_bytes="4KiB", credit_bytes="4KiB")
    assert commsched.config()["fusion_bytes"] == 4096
    blocker = FakeCudaArray(np.zeros(16384, np.float32), stream=0x5EED)
    launch_write(nccl_runtime, 0x5EED, blocker, np.ones(16384, np.float32), 300_000)
    first = commsched.allreduce_async(blocker, name="blocker", priority=0)
    arrays = [FakeCudaArray(np.full(32, i, np.float32), stream=0xABC) for i in range(6)]
    handles = [commsched.allreduce_async(a, name=f"small{i}", priority=1 + i) for i, a in enumerate(arrays)]
    for handle in [first, *handles]:
        handle.wait(30)
    assert np.array_equal(blocker.host, np.ones(16384, np.float32))
    for i, array in enumerate(arrays):
        assert np.array_equal(array.host, np.full(32, i, np.float32))
    stats = commsched.stats()
    assert stats["fused_launches"] == 1 and stats["launches"] == 2, stats
    log = calls(nccl_runtime)
    assert sum(c.startswith("allreduce") for c in log) == 2, log
    assert sum(c.startswith("memcpy 128 kind 4") and " on own" in c for c in log) == 12, log  # 6 in, 6 out
    assert sum(c.startswith("malloc") for c in log) == 1, log  # the fusion buffer, allocated once
    assert not [c for c in log if c.startswith("sync")], log  # no host synchronisation on the way


def test_calls_keep_the_callers_current_device(nccl_env: ctypes.CDLL) -> None:
    """CUDA's current device is per thread: the communicator works on its own device and puts the
    caller's back (here the caller is on device 1, the communicator on device 0)."""
    from commsched import _nccl
    from commsched.transports import nccl

    nccl_env.cudaSetDevice(1)
    api = nccl.load_api()
    comm = _nccl.Communicator(api, _nccl.unique_id(api), 0, 1, 0)
    data = np.ones(4, np.float32)
    work = comm.allreduce(data.ctypes.data, 4, "float32", stream=0xABC)
    assert nccl_env.fake_current_device() == 1
    while not work.test():
        pass
    log = calls(nccl_env)
    assert "init on device 0" in log and any(c.endswith("on 0xabc main device 0") for c in log), log
    nccl_env.fake_reset()
    del work, comm  # destroyed on its own device, then the caller's is back
    assert calls(nccl_env)[0] == "setdevice 0" and "destroy" in calls(nccl_env), calls(nccl_env)
    assert nccl_env.fake_current_device() == 1
    nccl_env.cudaSetDevice(0)


def test_mixing_host_and_device_tensors_fails_clearly(nccl_env: ctypes.CDLL) -> None:
    """A host array under NCCL, or a GPU array under a host transport, is refused naming the tensor and the fix."""
    commsched.init(transport="nccl")
    try:
        with pytest.raises(TypeError, match=r"tensor 'cpu_grad' is in host memory.*move it to the GPU"):
            commsched.allreduce(np.ones(4, np.float32), name="cpu_grad")
        with pytest.raises(ValueError, match=r"tensor 'elsewhere': it is on cuda:1.*cuda:0"):
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
    assert np.array_equal(data.host, np.ones(8, np.float32))


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


def test_device_index_chooses_the_gpu(nccl_runtime: ctypes.CDLL) -> None:
    """init(device="cuda:1") puts the communicator on GPU 1 whatever the local rank; a tensor there is taken."""
    commsched.init(device="cuda:1")
    data = FakeCudaArray(np.ones(8, np.float32), device_id=1)
    commsched.allreduce(data, name="on_one", timeout=30)
    assert "init on device 1" in calls(nccl_runtime)
    with pytest.raises(SettingError, match=r"COMMSCHED_DEVICE: 'gpu1'.*cuda:N"):
        resolve({}, {"COMMSCHED_DEVICE": "gpu1"})


def test_device_and_transport_must_agree() -> None:
    """device="cuda" needs NCCL, auto or a CUDA-aware MPI; NCCL needs GPU tensors."""
    with pytest.raises(
        SettingError, match="COMMSCHED_DEVICE=cuda needs COMMSCHED_TRANSPORT=nccl, auto, or mpi"
    ):
        resolve({"device": "cuda", "transport": "gloo"}, {})
    with pytest.raises(SettingError, match="COMMSCHED_TRANSPORT=nccl moves GPU memory only"):
        resolve({}, {"COMMSCHED_DEVICE": "cpu", "COMMSCHED_TRANSPORT": "nccl"})
    with pytest.raises(SettingError, match=r"COMMSCHED_DEVICE: 'tpu'.*auto, cpu, cuda"):
        resolve({}, {"COMMSCHED_DEVICE": "tpu"})


def test_blocking_allreduce_of_a_gpu_array_goes_to_the_core_in_one_call(
    nccl_runtime: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """commsched.allreduce of a named GPU array needs no Python handle (the per-collective host cost a
    small NCCL allreduce pays); a timeout names the tensor, the collective still completes and frees
    its name, and arguments that need checking still get the full path's errors."""
    from commsched import submission

    commsched.init(transport="nccl")
    data = FakeCudaArray(np.arange(8, dtype=np.float32), stream=0x5EED)

    def no_handle(*args: object, **kwargs: object) -> None:
        raise AssertionError("a plain GPU allreduce built a Python handle")

    with monkeypatch.context() as patched:
        patched.setattr(submission, "_enqueue", no_handle)
        assert commsched.allreduce(data, name="fast", op="average", timeout=30) is data
    assert np.array_equal(data.host, np.arange(8, dtype=np.float32))
    assert any(c.startswith("record") and "0x5eed" in c for c in calls(nccl_runtime))

    nccl_runtime.fake_set_delay_us(300_000)
    with pytest.raises(TimeoutError, match="'slow' did not finish within 0.05s"):
        commsched.allreduce(data, name="slow", timeout=0.05)
    nccl_runtime.fake_set_delay_us(0)
    for _ in range(100):  # the collective goes on without the caller and frees its name when done
        try:
            commsched.allreduce(data, name="slow", timeout=30)
            break
        except ValueError as error:
            assert "already in flight" in str(error)
            time.sleep(0.05)
    else:
        raise AssertionError("'slow' never completed after its caller timed out")
    assert np.array_equal(data.host, np.arange(8, dtype=np.float32))

    with pytest.raises(ValueError, match="timeout is nan"):
        commsched.allreduce(data, name="nan", timeout=float("nan"))
    with pytest.raises(ValueError, match="op of 'bad' must be one of"):
        commsched.allreduce(data, name="bad", op="median")
