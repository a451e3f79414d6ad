"""A fake libcudart + libnccl compiled on the host (sources in tests/fake_cuda/), for testing GPU code paths
without a GPU.

"Device" memory is host memory. Streams are asynchronous (a worker thread and a FIFO each), events mean
what they mean in CUDA, and NCCL collectives reduce across real processes (or threads) through POSIX
shared memory, so a missing wait or a wrong order shows up as wrong numbers. Every call is logged
(`calls()`); events are numbered from the last `fake_reset()` so a wait can be matched with its record;
calls made on another thread than the one that called `fake_set_main_thread()` are tagged "other".

Environment: FAKE_CUDA_DEVICES (device count, default 2), FAKE_CUDA_DELAY_US (sleep before every stream
operation, read at load; `set_delay_us` changes it later), FAKE_NCCL_VERSION (default 22105),
FAKE_NCCL_TIMEOUT_S (how long a rank waits for its peers, default 60), FAKE_NCCL_SLOT_BYTES and
FAKE_NCCL_CHANNEL_BYTES (shared-memory chunk sizes, defaults 4 MiB and 1 MiB), FAKE_MPIX_CUDA (what the
fake MPIX_Query_cuda_support answers, default 1).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

SOURCE_DIR = Path(__file__).resolve().parent / "fake_cuda"
LIBRARY_SOURCES = (
    "fake_cuda.c",
    "fake_cuda_memory.c",
    "fake_nccl.c",
    "fake_nccl_shared.c",
    "fake_nccl_reduce.c",
)

CUDA_ERROR_NOT_READY = 600
NCCL_REMOTE_ERROR = 6
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
# ncclDataType_t of each numpy dtype name; "bfloat16" is ml_dtypes' name.
NCCL_DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}


class NcclUniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRank."""

    _fields_ = [("internal", ctypes.c_char * 128)]


_vp, _int, _uint, _size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "fake_calls": (ctypes.c_char_p, []),
    "fake_reset": (None, []),
    "fake_set_main_thread": (None, []),
    "fake_current_device": (_int, []),
    "fake_set_delay_us": (None, [_uint]),
    "fake_launch_write": (_int, [_vp, _vp, _vp, _size, _uint]),
    "fake_fail_comm": (None, [_vp, _int]),
    "cudaGetDeviceCount": (_int, [ctypes.POINTER(_int)]),
    "cudaSetDevice": (_int, [_int]),
    "cudaGetDevice": (_int, [ctypes.POINTER(_int)]),
    "cudaStreamCreateWithFlags": (_int, [ctypes.POINTER(_vp), _uint]),
    "cudaStreamDestroy": (_int, [_vp]),
    "cudaStreamWaitEvent": (_int, [_vp, _vp, _uint]),
    "cudaStreamSynchronize": (_int, [_vp]),
    "cudaStreamQuery": (_int, [_vp]),
    "cudaMemcpyAsync": (_int, [_vp, _vp, _size, _int, _vp]),
    "cudaMemcpy": (_int, [_vp, _vp, _size, _int]),
    "cudaMalloc": (_int, [ctypes.POINTER(_vp), _size]),
    "cudaFree": (_int, [_vp]),
    "cudaEventCreateWithFlags": (_int, [ctypes.POINTER(_vp), _uint]),
    "cudaEventRecord": (_int, [_vp, _vp]),
    "cudaEventQuery": (_int, [_vp]),
    "cudaEventSynchronize": (_int, [_vp]),
    "cudaEventDestroy": (_int, [_vp]),
    "cudaGetErrorString": (ctypes.c_char_p, [_int]),
    "cudaLaunchHostFunc": (_int, [_vp, _vp, _vp]),
    "ncclGetVersion": (_int, [ctypes.POINTER(_int)]),
    "ncclGetUniqueId": (_int, [ctypes.POINTER(NcclUniqueId)]),
    "ncclCommInitRank": (_int, [ctypes.POINTER(_vp), _int, NcclUniqueId, _int]),
    "ncclCommDestroy": (_int, [_vp]),
    "ncclCommAbort": (_int, [_vp]),
    "ncclCommGetAsyncError": (_int, [_vp, ctypes.POINTER(_int)]),
    "ncclAllReduce": (_int, [_vp, _vp, _size, _int, _int, _vp, _vp]),
    "ncclBroadcast": (_int, [_vp, _vp, _size, _int, _int, _vp, _vp]),
    "ncclAllGather": (_int, [_vp, _vp, _size, _int, _vp, _vp]),
    "ncclReduceScatter": (_int, [_vp, _vp, _size, _int, _int, _vp, _vp]),
    "ncclReduce": (_int, [_vp, _vp, _size, _int, _int, _int, _vp, _vp]),
    "ncclRedOpCreatePreMulSum": (_int, [ctypes.POINTER(ctypes.c_int), _vp, _int, _int, _vp]),
    "ncclRedOpDestroy": (_int, [_int, _vp]),
    "ncclGroupStart": (_int, []),
    "ncclGroupEnd": (_int, []),
    "ncclSend": (_int, [_vp, _size, _int, _int, _vp, _vp]),
    "ncclRecv": (_int, [_vp, _size, _int, _int, _vp, _vp]),
    "ncclGetErrorString": (ctypes.c_char_p, [_int]),
}


def _compile(sources: list[Path], library: Path) -> Path | None:
    """cc -shared -fPIC -pthread; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    # nodelete: a dlclose must not unmap code that stream workers still run; no contraction, so the
    # float arithmetic is the one numpy references compute.
    flags = ["-O2", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
    linux = sys.platform.startswith("linux")
    extra = ["-Wl,-z,nodelete", "-lrt"] if linux else []
    subprocess.run([compiler, *flags, "-o", str(library), *map(str, sources), *extra], check=True)
    return library


def build(folder: Path) -> Path | None:
    """Compiles the fake CUDA runtime + NCCL into folder/libfake.so; None without a C compiler."""
    return _compile([SOURCE_DIR / name for name in LIBRARY_SOURCES], folder / "libfake.so")


def build_mpix(folder: Path) -> Path | None:
    """Compiles folder/libfakempix.so (MPIX_Query_cuda_support, for LD_PRELOAD); None without a C compiler."""
    return _compile([SOURCE_DIR / "fake_mpix.c"], folder / "libfakempix.so")


def declare(handle: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the C prototypes of the fake's entry points on handle (pointers stay 64-bit); returns it."""
    for name, (result, arguments) in _PROTOTYPES.items():
        function = getattr(handle, name)
        function.restype = result
        function.argtypes = arguments
    return handle


def load(library: Path) -> ctypes.CDLL:
    """The built library, loaded, with its prototypes declared."""
    return declare(ctypes.CDLL(str(library)))


def calls(handle: ctypes.CDLL) -> list[str]:
    """What the fake library was asked to do, in order."""
    handle.fake_calls.restype = ctypes.c_char_p
    return [c for c in handle.fake_calls().decode().split(";") if c]


def address(array: np.ndarray | FakeCudaArray) -> int:
    """Where the bytes of a numpy array or a FakeCudaArray start."""
    host = array.host if isinstance(array, FakeCudaArray) else array
    return host.ctypes.data


def set_delay_us(handle: ctypes.CDLL, microseconds: int) -> None:
    """Every stream operation queued from now on sleeps this long before it runs."""
    handle.fake_set_delay_us.argtypes = [ctypes.c_uint]
    handle.fake_set_delay_us(microseconds)


def launch_write(
    handle: ctypes.CDLL,
    stream: int | None,
    dst_array: np.ndarray | FakeCudaArray,
    src_array: np.ndarray | FakeCudaArray,
    delay_us: int,
) -> None:
    """Queues a producer "kernel" on stream: after delay_us, src_array's bytes (as they are now) land in
    dst_array, which must stay alive until then."""
    target = dst_array.host if isinstance(dst_array, FakeCudaArray) else dst_array
    source = src_array.host if isinstance(src_array, FakeCudaArray) else src_array
    if target.nbytes != source.nbytes:
        raise ValueError(f"launch_write: {source.nbytes} bytes do not fit a {target.nbytes}-byte target")
    function = handle.fake_launch_write
    function.restype, function.argtypes = _PROTOTYPES["fake_launch_write"]
    result = function(stream, address(target), address(source), source.nbytes, delay_us)
    if result != 0:
        raise RuntimeError(f"fake_launch_write failed with cudaError {result}")


def unique_id(handle: ctypes.CDLL) -> bytes:
    """A fresh ncclUniqueId's 128 bytes (name them to every rank of one communicator)."""
    function = handle.ncclGetUniqueId
    function.restype, function.argtypes = _PROTOTYPES["ncclGetUniqueId"]
    made = NcclUniqueId()
    result = function(ctypes.byref(made))
    if result != 0:
        raise RuntimeError(f"ncclGetUniqueId failed with ncclResult {result}")
    return ctypes.string_at(ctypes.addressof(made), 128)


def unique_id_from(raw: bytes) -> NcclUniqueId:
    """The ncclUniqueId holding raw (128 bytes from unique_id())."""
    if len(raw) != 128:
        raise ValueError(f"an ncclUniqueId is 128 bytes, got {len(raw)}")
    made = NcclUniqueId()
    ctypes.memmove(ctypes.addressof(made), raw, 128)
    return made


class FakeCudaArray:
    """Host memory (a numpy array) that presents itself as a CUDA array, __cuda_array_interface__ v3."""

    def __init__(self, host: np.ndarray, stream: int | None = 0xABC, device_id: int | None = None) -> None:
        self.host = host
        self.shape = host.shape  # as CuPy and torch arrays have: the output collectives read rows from it
        self.__cuda_array_interface__ = {
            "data": (host.ctypes.data, False),
            "shape": host.shape,
            "typestr": host.dtype.str,
            "strides": None,
            "version": 3,
            "stream": stream,
        }
        if device_id is not None:
            self.device = type("Device", (), {"id": device_id})()


def new_event(fake: ctypes.CDLL) -> int:
    """A cudaEvent made with cudaEventCreateWithFlags (disable timing)."""
    event = ctypes.c_void_p()
    assert fake.cudaEventCreateWithFlags(ctypes.byref(event), 2) == 0
    return event.value


def communicators(fake: ctypes.CDLL, nranks: int) -> list[int]:
    """One communicator per rank, all in this process (each init blocks until all joined, so threads)."""
    raw = unique_id(fake)
    comms = [ctypes.c_void_p() for _ in range(nranks)]
    results = [-1] * nranks

    def init(rank: int) -> None:
        results[rank] = fake.ncclCommInitRank(ctypes.byref(comms[rank]), nranks, unique_id_from(raw), rank)

    threads = [threading.Thread(target=init, args=(rank,)) for rank in range(nranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [0] * nranks
    return [comm.value for comm in comms]


def async_error(fake: ctypes.CDLL, comm: int) -> int:
    """ncclCommGetAsyncError's answer for `comm`."""
    error = ctypes.c_int(-1)
    assert fake.ncclCommGetAsyncError(comm, ctypes.byref(error)) == 0
    return error.value
