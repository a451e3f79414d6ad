"""NCCL transport without a GPU: clean errors when NCCL/CUDA are missing, GPU-array parsing, and the
plumbing (loader, stream ordering, polling, the core's trampoline) against a fake libnccl/libcudart
compiled here. Real NCCL on a GPU is not exercised by these tests."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commsched.transports import nccl

FAKE_SOURCE = r"""
#include <stdio.h>
#include <string.h>
static char calls[4096];
static void note(const char* what) { strncat(calls, what, sizeof(calls) - strlen(calls) - 2); strcat(calls, ";"); }
const char* fake_calls(void) { return calls; }
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int* v) { *v = 99999; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { memset(id->internal, 7, 128); note("uniqueid"); return 0; }
int ncclCommInitRank(void** comm, int size, ncclUniqueId id, int rank) {
  *comm = (void*)calls; note(id.internal[5] == 7 && size == 1 && rank == 0 ? "init" : "init-bad-args"); return 0; }
int ncclCommDestroy(void* c) { note("destroy"); return 0; }
int ncclCommAbort(void* c) { note("abort"); return 0; }
int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* c, void* st) {
  char b[64]; snprintf(b, 64, "allreduce %zu type %d", n, t); note(b); return s == r ? 0 : 5; }
int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* c, void* st) {
  char b[64]; snprintf(b, 64, "broadcast %zu root %d", n, root); note(b); return 0; }
const char* ncclGetErrorString(int e) { return "fake nccl error"; }
int cudaGetDeviceCount(int* n) { *n = 1; return 0; }
int cudaSetDevice(int d) { note("setdevice"); return 0; }
static int stream_object, event_object;
int cudaStreamCreateWithFlags(void** s, unsigned f) { *s = &stream_object; return 0; }
int cudaStreamDestroy(void* s) { return 0; }
int cudaStreamWaitEvent(void* s, void* e, unsigned f) { note(s == &stream_object ? "wait-own" : "wait-other"); return 0; }
int cudaEventCreateWithFlags(void** e, unsigned f) { *e = &event_object; return 0; }
int cudaEventRecord(void* e, void* s) { note(s == &stream_object ? "record-own" : "record-framework"); return 0; }
int cudaEventQuery(void* e) { return 0; }
int cudaEventDestroy(void* e) { return 0; }
const char* cudaGetErrorString(int e) { return "fake cuda error"; }
"""


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared library with the NCCL and CUDA runtime symbols the transport uses, run on the host."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    folder = tmp_path_factory.mktemp("fake_nccl")
    (folder / "fake.c").write_text(FAKE_SOURCE)
    library = folder / "libfake.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / "fake.c")], check=True)
    return library


def calls(handle: ctypes.CDLL) -> list[str]:
    """What the fake library was asked to do, in order."""
    handle.fake_calls.restype = ctypes.c_char_p
    return [c for c in handle.fake_calls().decode().split(";") if c]


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
    work = comm.allreduce(data.data_ptr(), 1000, "float32", torch.cuda.current_stream().cuda_stream)
    while not work.test():
        pass
    assert torch.equal(data.cpu(), torch.arange(1000, dtype=torch.float32))


def test_fake_library_plumbing_through_the_core(fake_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Single rank through commsched.init(transport="nccl"): every collective is ordered after the
    framework stream, runs on commsched's stream and completes through the core's polling."""
    import commsched

    monkeypatch.setenv("COMMSCHED_NCCL_LIBRARY", str(fake_library))
    monkeypatch.setenv("COMMSCHED_CUDART_LIBRARY", str(fake_library))
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    handle = ctypes.CDLL(str(fake_library))  # keeps the fake loaded, and its log, after shutdown
    commsched.init(transport="nccl", fusion_bytes=0)
    try:
        # The fake's "device" memory is host memory, so host arrays stand in for GPU buffers here.
        data = np.arange(5000, dtype=np.float32)
        commsched.allreduce(data, name="grad", timeout=30)
        assert np.array_equal(data, np.arange(5000, dtype=np.float32))
        value = np.ones(10, np.int64)
        commsched.broadcast(value, root=0, name="weights", timeout=30)
        assert commsched.config()["transport"] == "nccl"
    finally:
        commsched.shutdown()
    log = calls(handle)
    assert log[:3] == ["uniqueid", "setdevice", "init"], log
    first = log.index("allreduce 5000 type 7")
    assert log[first - 2 : first + 2] == [
        "record-framework",
        "wait-own",
        "allreduce 5000 type 7",
        "record-own",
    ], log
    assert "broadcast 10 root 0" in log and log[-1] == "destroy", log


class _FakeCudaArray:
    def __init__(self, interface: dict[str, Any]) -> None:
        self.__cuda_array_interface__ = interface


def test_cuda_array_interface_and_dlpack_are_read() -> None:
    """Address, count and dtype come from __cuda_array_interface__ and DLPack; CPU DLPack is refused."""
    fake = _FakeCudaArray(
        {"data": (123456, False), "shape": (4, 5), "typestr": "<f2", "strides": None, "version": 3}
    )
    assert nccl.cuda_view(fake, "x") == (123456, 20, "float16", -1)
    strided = _FakeCudaArray(
        {"data": (64, False), "shape": (4, 5), "typestr": "<f4", "strides": (40, 8), "version": 3}
    )
    with pytest.raises(TypeError, match="not C-contiguous"):
        nccl.cuda_view(strided, "y")
    host = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert nccl.dlpack_describe(host.__dlpack__()) == (host.ctypes.data, 12, "int64", 1, 0)
    with pytest.raises(TypeError, match="device type 1, not CUDA"):
        nccl.cuda_view(host, "z")
