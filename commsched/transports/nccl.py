"""NCCL transport for CUDA buffers, driven through the core's trampoline.

Agreement reports go over a host transport (Gloo, gRPC or MPI, whichever the launch allows);
data goes through NCCL on commsched's own CUDA stream (commsched._nccl). NCCL and the CUDA
runtime are found at run time: COMMSCHED_NCCL_LIBRARY / COMMSCHED_CUDART_LIBRARY, then pip's
nvidia-nccl-cu* / nvidia-cuda-runtime-cu* packages, then the system's libraries.

Not yet verified on a GPU (no GPU was available while it was written); see csrc/transport/nccl/README.md.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from commsched.launch import LaunchInfo

log = logging.getLogger("commsched")

_SYSTEM_NCCL = ["libnccl.so.2", "libnccl.so"]
_SYSTEM_CUDART = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
# DLPack type codes (kDLInt, kDLUInt, kDLFloat, kDLBfloat) and bits -> commsched dtype
_DLPACK_DTYPES = {
    (0, 8): "int8",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bfloat16",
}
_TYPESTR_DTYPES = {
    "<f2": "float16",
    "<f4": "float32",
    "<f8": "float64",
    "<i4": "int32",
    "<i8": "int64",
    "|u1": "uint8",
    "|i1": "int8",
    "<V2": "bfloat16",
}
_KDL_CUDA = 2


def _nvidia_package_libraries(package: str, pattern: str) -> list[str]:
    """Shared libraries shipped by pip's nvidia-* wheels (nvidia/<package>/lib/<pattern>)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for root in spec.submodule_search_locations:
        found.extend(sorted(str(p) for p in (Path(root) / package / "lib").glob(pattern)))
    return found


def library_candidates(environ: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(NCCL paths, CUDA runtime paths) in the order they are tried."""
    env = dict(os.environ) if environ is None else environ
    nccl = [env["COMMSCHED_NCCL_LIBRARY"]] if env.get("COMMSCHED_NCCL_LIBRARY") else []
    cudart = [env["COMMSCHED_CUDART_LIBRARY"]] if env.get("COMMSCHED_CUDART_LIBRARY") else []
    nccl += _nvidia_package_libraries("nccl", "libnccl.so*") + _SYSTEM_NCCL
    cudart += _nvidia_package_libraries("cuda_runtime", "libcudart.so*") + _SYSTEM_CUDART
    return nccl, cudart


def load_api() -> Any:
    """Loads NCCL and the CUDA runtime; RuntimeError says what was tried and how to install them."""
    try:
        from commsched import _nccl
    except ImportError as error:
        raise RuntimeError(
            f"commsched was built without its NCCL extension ({error}); reinstall commsched"
        ) from None
    try:
        return _nccl.load(*library_candidates())
    except RuntimeError as error:
        raise RuntimeError(
            f"COMMSCHED_TRANSPORT=nccl: {error}\nInstall NCCL and the CUDA runtime (pip install "
            "nvidia-nccl-cu12 nvidia-cuda-runtime-cu12) or point COMMSCHED_NCCL_LIBRARY and "
            "COMMSCHED_CUDART_LIBRARY at them"
        ) from None


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def dlpack_describe(capsule: Any) -> tuple[int, int, str, int, int]:
    """(address, element count, dtype, DLPack device type, device id) of an unconsumed DLPack capsule.

    DLManagedTensor starts with its DLTensor, so the capsule pointer reads as one; the capsule is
    not consumed, and its owner keeps the memory alive.
    """
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = _DLTensor.from_address(get_pointer(capsule, b"dltensor"))
    dtype = _DLPACK_DTYPES.get((tensor.code, tensor.bits)) if tensor.lanes == 1 else None
    if dtype is None:
        raise TypeError(
            f"DLPack dtype code {tensor.code}, {tensor.bits} bits, {tensor.lanes} lanes is not supported"
        )
    count, expected_stride = 1, 1
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    for extent in shape:
        count *= extent
    if tensor.strides and count:
        for axis in reversed(range(tensor.ndim)):
            if shape[axis] != 1 and tensor.strides[axis] != expected_stride:
                raise TypeError("the DLPack tensor is not C-contiguous")
            expected_stride *= shape[axis]
    return int(tensor.data or 0) + int(tensor.byte_offset), count, dtype, tensor.device_type, tensor.device_id


def cuda_view(array: Any, name: str) -> tuple[int, int, str, int]:
    """(device address, element count, dtype, device id) of a CUDA array: a PyTorch CUDA tensor, any
    __cuda_array_interface__ object (CuPy, Numba) or a DLPack producer on a CUDA device."""
    if getattr(array, "is_cuda", False) and hasattr(array, "data_ptr"):
        from commsched.buffers import _TORCH_DTYPES

        dtype = _TORCH_DTYPES.get(str(array.dtype))
        if dtype is None or not array.is_contiguous():
            raise TypeError(
                f"tensor '{name}': needs a contiguous tensor of a supported dtype, not {array.dtype}"
            )
        return int(array.data_ptr()), int(array.numel()), dtype, int(array.device.index or 0)
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        address, readonly = interface["data"]
        if readonly:
            raise TypeError(f"tensor '{name}': the CUDA array is read-only")
        dtype = _TYPESTR_DTYPES.get(interface["typestr"])
        if dtype is None:
            raise TypeError(f"tensor '{name}': CUDA array typestr {interface['typestr']!r} is not supported")
        count = 1
        for extent in interface["shape"]:
            count *= extent
        if interface.get("strides") is not None:
            expected = int(interface["typestr"][2:])
            for extent, stride in zip(reversed(interface["shape"]), reversed(interface["strides"])):
                if extent != 1 and stride != expected:
                    raise TypeError(f"tensor '{name}': the CUDA array is not C-contiguous")
                expected *= extent
        # The interface carries no device id; -1 means "the current device", which NCCL then checks.
        return int(address or 0), count, dtype, -1
    if hasattr(array, "__dlpack_device__"):
        device_type, device_id = array.__dlpack_device__()
        if device_type != _KDL_CUDA:
            raise TypeError(f"tensor '{name}' is a DLPack array on device type {device_type}, not CUDA")
        address, count, dtype, _, _ = dlpack_describe(array.__dlpack__())
        return address, count, dtype, int(device_id)
    raise TypeError(f"tensor '{name}' is not a CUDA array (no is_cuda, __cuda_array_interface__ or DLPack)")


class NcclTransport:
    """Agreement over a host transport, data over NCCL on commsched's own stream."""

    name = "nccl"
    poll_interval_us = 50  # test() is one cudaEventQuery: cheap, but keep the GIL mostly free

    def __init__(self, control: Any, api: Any, device: int, framework_stream: Any = None) -> None:
        from commsched import _nccl

        self.rank, self.size = control.rank, control.size
        self._control = control
        # 0 is CUDA's legacy default stream, which PyTorch and CuPy use unless told otherwise;
        # a callable returning another stream handle can be passed instead.
        self._framework_stream = framework_stream or (lambda: 0)
        # The unique id travels over the core's bootstrap: the host transport's exchange.
        mine = _nccl.unique_id(api) if self.rank == 0 else b""
        unique_id = control.exchange(mine, 300.0)[0]
        self._comm = _nccl.Communicator(api, unique_id, self.rank, self.size, device)

    @classmethod
    def from_launch(cls, launch: LaunchInfo, comm: Any, process_group: Any, settings: Any) -> NcclTransport:
        """Builds the host transport the launch allows (MPI under mpiexec, else Gloo or gRPC) and NCCL on it."""
        api = load_api()
        from commsched import _nccl

        if _nccl.device_count(api) == 0:
            raise RuntimeError("COMMSCHED_TRANSPORT=nccl: NCCL loaded, but CUDA sees no GPU on this host")
        from commsched import transports

        if launch.size == 1 and comm is None and process_group is None:
            control: Any = _SingleControl()
        elif launch.launcher == "mpiexec" or comm is not None:
            control = _MpiControl(comm)
        elif process_group is not None or importlib.util.find_spec("torch") is not None:
            control = transports.build("gloo", launch, comm, process_group, settings)[1]
        else:
            control = transports.build("grpc", launch, comm, process_group, settings)[1]
        log.info("nccl transport: agreement over %s, NCCL from %s", control.name, library_candidates()[0][0])
        return cls(control, api, launch.local_rank)

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Agreement reports go over the host transport."""
        return list(self._control.exchange(report, timeout_s))

    def start(self, address: int, count: int, dtype: str, kind: str, root: int) -> Any:
        """Queues an NCCL allreduce (sum) or broadcast on commsched's stream, after the framework's stream.

        The core calls this from its own thread, where PyTorch's current stream is the default one;
        ordering after the stream that produced the gradient needs an event recorded at enqueue time
        (see csrc/transport/nccl/README.md).
        """
        stream = int(self._framework_stream())
        if kind == "allreduce":
            return self._comm.allreduce(address, count, dtype, stream)
        return self._comm.broadcast(address, count, dtype, root, stream)


class _SingleControl:
    """A lone rank agrees with itself."""

    name, rank, size = "single", 0, 1

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Returns this rank's own report."""
        return [report]


class _MpiControl:
    """Agreement over mpi4py with raw byte buffers (lengths, then Allgatherv), never pickle."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Allgathers one byte string per rank (MPI has no timeout; a dead rank ends the job)."""
        import numpy as np

        lengths = np.zeros(self.size, np.int64)
        self._comm.Allgather(np.array([len(report)], np.int64), lengths)
        gathered = np.empty(int(lengths.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        mine = np.frombuffer(report, np.uint8) if report else np.empty(0, np.uint8)
        self._comm.Allgatherv(mine, [gathered, lengths, offsets, self._mpi.BYTE])
        return [gathered[o : o + n].tobytes() for o, n in zip(offsets, lengths)]
