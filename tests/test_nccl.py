"""NCCL transport without a GPU: clean errors when NCCL/CUDA are missing, and the plumbing (loader,
stream ordering, polling, the core's trampoline) against the fake libnccl/libcudart of
tests/fake_cuda.py. Real NCCL on a GPU is exercised only by the test that skips without one."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from fake_cuda import FakeCudaArray, calls

from commsched.transports import nccl


def test_missing_libraries_give_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA the error lists what was tried and how to install NCCL."""
    monkeypatch.setenv("COMMSCHED_CUDART_LIBRARY", "/nonexistent/libcudart.so.12")
    monkeypatch.setattr(nccl, "_SYSTEM_CUDART", ["libcudart-not-here.so"])
    monkeypatch.setattr(nccl, "_nvidia_package_libraries", lambda package, pattern: [])
    with pytest.raises(
        RuntimeError, match=r"(?s)cannot load the CUDA runtime.*/nonexistent/libcudart.so.12.*pip install"
    ):
        nccl.load_api()


def test_candidates_put_the_override_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMSCHED_NCCL_LIBRARY wins over pip's nvidia packages and the system library."""
    found, cudart = nccl.library_candidates({"COMMSCHED_NCCL_LIBRARY": "/opt/x/libnccl.so.2"})
    assert found[0] == "/opt/x/libnccl.so.2" and found[-1] == "libnccl.so"
    assert "libcudart.so.12" in cudart


def test_nccl_on_the_real_gpu_or_skip() -> None:
    """With a GPU and NCCL present, a single-rank allreduce of a CUDA tensor equals itself."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the NCCL transport is only checked against the fake library")
    api = nccl.load_api()
    from commsched import _nccl

    comm = _nccl.Communicator(api, _nccl.unique_id(api), 0, 1, 0)
    data = torch.arange(1000, dtype=torch.float32, device="cuda")
    work = comm.allreduce(data.data_ptr(), 1000, "float32", stream=torch.cuda.current_stream().cuda_stream)
    while not work.test():
        pass
    assert torch.equal(data.cpu(), torch.arange(1000, dtype=torch.float32))


def test_commsched_on_the_real_gpu_or_skip() -> None:
    """With a GPU: a partitioned CUDA tensor written on a side stream goes through init(device="cuda")
    and comes back averaged (one rank: unchanged). Not run so far: no GPU was available."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: commsched's GPU path is only checked against the fake library")
    import commsched

    commsched.init(device="cuda", partition_bytes="64KiB")
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            grad = torch.arange(100_000, dtype=torch.float32, device="cuda") * 3
            handle = commsched.allreduce_async(grad, name="grad", op="average")  # ordered after `side`
        handle.wait(60)
        assert torch.equal(grad.cpu(), torch.arange(100_000, dtype=torch.float32) * 3)
        assert commsched.config()["transport"] == "nccl"
    finally:
        commsched.shutdown()


def test_fake_library_plumbing_through_the_core(nccl_env: ctypes.CDLL) -> None:
    """Single rank through commsched.init(transport="nccl"): each collective waits on the event recorded
    on the caller's stream at submit, runs on commsched's stream and completes through the core's polling."""
    import commsched

    commsched.init(transport="nccl")
    try:
        data = FakeCudaArray(np.arange(5000, dtype=np.float32))
        commsched.allreduce(data, name="grad", timeout=30)
        assert np.array_equal(data.host, np.arange(5000, dtype=np.float32))  # one rank
        value = FakeCudaArray(np.ones(10, np.int64))
        commsched.broadcast(value, root=0, name="weights", timeout=30)
        assert commsched.config()["transport"] == "nccl"
    finally:
        commsched.shutdown()
    log = calls(nccl_env)
    assert "init on device 0" in log, log
    first = next(i for i, c in enumerate(log) if c.startswith("allreduce 5000 type 7 op 0 "))
    # record at submit (main thread, the array's stream), wait on that same event, NCCL, completion event
    submit = log[first - 2]
    assert submit.startswith("record ev") and submit.endswith("on 0xabc main device 0"), log
    assert log[first - 1] == f"wait own {submit.split()[1]}", log
    assert log[first + 1].startswith("record ev") and " on own " in log[first + 1], log
    assert "broadcast 10 root 0" in log and log[-1] == "destroy", log
