"""Turns user arrays into (address, element count, dtype, device) for the core, without copying.

Host memory: numpy and anything with the buffer protocol, CPU torch tensors. Device memory:
torch CUDA tensors, any __cuda_array_interface__ object (CuPy, Numba) and DLPack producers on a
CUDA device; their views carry the CUDA device and the stream on which the bytes are ready.
"""

from __future__ import annotations

import ctypes
import numbers
import sys
from dataclasses import dataclass
from typing import Any

# numpy typestr / memoryview format -> commsched dtype, keyed by (kind, itemsize)
_KIND_SIZE_TO_DTYPE = {
    ("f", 2): "float16",
    ("f", 4): "float32",
    ("f", 8): "float64",
    ("i", 1): "int8",
    ("i", 2): "int16",
    ("i", 4): "int32",
    ("i", 8): "int64",
    ("u", 1): "uint8",
    ("b", 1): "bool",
}
_FORMAT_KIND = {
    "e": "f",
    "f": "f",
    "d": "f",
    "b": "i",
    "h": "i",
    "i": "i",
    "l": "i",
    "q": "i",
    "B": "u",
    "?": "b",
}
_TORCH_DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.int32": "int32",
    "torch.int64": "int64",
    "torch.uint8": "uint8",
    "torch.int8": "int8",
    "torch.int16": "int16",
    "torch.bool": "bool",
}
# __cuda_array_interface__ typestr -> commsched dtype ("<V2" is how ml_dtypes' bfloat16 shows up)
_TYPESTR_DTYPES = {
    "<f2": "float16",
    "<f4": "float32",
    "<f8": "float64",
    "<i4": "int32",
    "<i8": "int64",
    "|u1": "uint8",
    "|i1": "int8",
    "<i2": "int16",
    "|b1": "bool",
    "<V2": "bfloat16",
}
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
    (0, 16): "int16",
    (6, 8): "bool",
}
DTYPE_SIZES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "bool": 1,
}
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
# CUDA's legacy default stream (cudaStreamLegacy): what DLPack's stream=1 and a pre-v3
# __cuda_array_interface__ mean, and what PyTorch and CuPy use unless told otherwise.
LEGACY_STREAM = 1
SUPPORTED = "float16, bfloat16, float32, float64, int16, int32, int64, uint8, int8 or bool"


@dataclass(frozen=True)
class BufferView:
    """Raw view of a writable, contiguous array; `owner` keeps the memory alive.

    `device` is None for host memory, else the CUDA device id (-1: the array did not say which).
    `stream` is the CUDA stream on which the bytes are ready when submitted (the caller's current
    stream); None for host memory, or when the producer says no ordering is needed.
    """

    address: int
    count: int
    dtype: str
    owner: Any
    device: int | None = None
    stream: int | None = None

    @property
    def nbytes(self) -> int:
        """Size of the viewed memory in bytes."""
        return self.count * DTYPE_SIZES[self.dtype]

    @property
    def on_gpu(self) -> bool:
        """True for CUDA device memory."""
        return self.device is not None


def _unsupported(what: str, name: str) -> TypeError:
    return TypeError(f"tensor '{name}': {what}; commsched needs a writable, C-contiguous {SUPPORTED} array")


def _immutable_scalar(array: Any) -> bool:
    """True for a Python number or a numpy scalar (numpy.float64(2.5)): values, not memory to write."""
    numpy = sys.modules.get("numpy")
    return isinstance(array, numbers.Number) or (numpy is not None and isinstance(array, numpy.generic))


def view(array: Any, name: str) -> BufferView:
    """Describes `array` for the core; raises TypeError naming the problem and the fix."""
    if _immutable_scalar(array):
        raise TypeError(
            f"tensor '{name}': a {type(array).__module__}.{type(array).__name__} scalar is immutable, so it "
            "cannot be reduced in place; pass a 1-element or 0-d array instead, e.g. numpy.array(value) or "
            "torch.tensor(value)"
        )
    gpu = _gpu_view(array, name)
    if gpu is not None:
        return gpu
    if hasattr(array, "data_ptr") and hasattr(
        array, "is_contiguous"
    ):  # a torch.Tensor, without importing torch
        dtype = _TORCH_DTYPES.get(str(array.dtype))
        if dtype is None:
            raise _unsupported(f"dtype {array.dtype} is not supported", name)
        if not array.is_contiguous():
            raise _unsupported("the tensor is not contiguous (call .contiguous() first)", name)
        return BufferView(array.data_ptr(), array.numel(), dtype, array)
    interface = getattr(array, "__array_interface__", None)
    if interface is not None:
        address, readonly = interface["data"]
        if readonly:
            raise _unsupported("the array is read-only", name)
        if (
            interface.get("strides") is not None
            and not getattr(array, "flags", {"C_CONTIGUOUS": False})["C_CONTIGUOUS"]
        ):
            raise _unsupported("the array is not C-contiguous (use numpy.ascontiguousarray)", name)
        typestr = interface["typestr"]
        if typestr[0] not in "<|=":
            raise _unsupported(f"byte order {typestr!r} is not native", name)
        item_size = typestr[2:]
        dtype = _KIND_SIZE_TO_DTYPE.get((typestr[1], int(item_size))) if item_size.isdigit() else None
        if dtype is None:
            raise _unsupported(
                f"dtype {getattr(array, 'dtype', typestr)} ({typestr!r}) is not supported", name
            )
        count = 1
        for extent in interface["shape"]:
            count *= extent
        return BufferView(address, count, dtype, array)
    try:
        memory = memoryview(array)
    except TypeError:
        raise _unsupported(f"{type(array).__name__} is not an array (no buffer protocol)", name) from None
    if memory.readonly:
        raise _unsupported("the buffer is read-only", name)
    if not memory.c_contiguous:
        raise _unsupported("the buffer is not C-contiguous", name)
    format_char = memory.format.lstrip("@=<")
    dtype = _KIND_SIZE_TO_DTYPE.get((_FORMAT_KIND.get(format_char, "?"), memory.itemsize))
    if dtype is None:
        raise _unsupported(f"buffer format {memory.format!r} is not supported", name)
    if memory.nbytes == 0:
        return BufferView(0, 0, dtype, array)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory.cast("B")))
    return BufferView(address, memory.nbytes // memory.itemsize, dtype, (array, memory))


def torch_current_stream(device: int) -> int:
    """The raw cudaStream_t of torch's current stream on CUDA device `device`.

    torch.cuda.current_stream() builds a Python Stream object on every call, once per collective
    here; the raw handle, which torch's compiled code reads per kernel launch, builds nothing. Builds
    without that call take the object's handle.
    """
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _gpu_view(array: Any, name: str) -> BufferView | None:
    """The view of a CUDA array (torch, __cuda_array_interface__, DLPack), or None for host memory."""
    if getattr(array, "is_cuda", False) and hasattr(array, "data_ptr"):
        dtype = _TORCH_DTYPES.get(str(array.dtype))
        if dtype is None:
            raise _unsupported(f"dtype {array.dtype} is not supported", name)
        if not array.is_contiguous():
            raise _unsupported("the tensor is not contiguous (call .contiguous() first)", name)
        # The gradient was written on the caller's current stream; the collective must wait for it.
        device = int(array.get_device())
        return BufferView(
            int(array.data_ptr()), int(array.numel()), dtype, array, device, torch_current_stream(device)
        )
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        return _cuda_interface_view(array, interface, name)
    device_of = getattr(array, "__dlpack_device__", None)
    if device_of is None:
        return None
    device_type, device_id = device_of()
    if device_type in (_KDL_CPU, _KDL_CUDA_HOST):
        return None
    if device_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise _unsupported(f"DLPack device type {device_type} is neither the CPU nor a CUDA device", name)
    try:
        # stream=1 asks the producer to make the bytes ready on the legacy default stream.
        capsule = array.__dlpack__(stream=1)
    except TypeError:
        capsule = array.__dlpack__()  # producers predating the stream argument
    address, count, dtype = dlpack_describe(capsule, name)
    return BufferView(address, count, dtype, (array, capsule), int(device_id), LEGACY_STREAM)


def _cuda_interface_view(array: Any, interface: dict[str, Any], name: str) -> BufferView:
    """The view described by a __cuda_array_interface__ (version 2 or 3) dict."""
    address, readonly = interface["data"]
    if readonly:
        raise _unsupported("the CUDA array is read-only", name)
    if interface.get("mask") is not None:
        raise _unsupported("masked CUDA arrays are not supported", name)
    typestr = interface["typestr"]
    dtype = _TYPESTR_DTYPES.get(typestr)
    if dtype is None:
        raise _unsupported(f"CUDA array typestr {typestr!r} is not supported", name)
    count = 1
    for extent in interface["shape"]:
        count *= extent
    if interface.get("strides") is not None:
        expected = DTYPE_SIZES[dtype]
        for extent, stride in zip(reversed(interface["shape"]), reversed(interface["strides"])):
            if extent != 1 and stride != expected:
                raise _unsupported("the CUDA array is not C-contiguous", name)
            expected *= extent
    # Version 3: "stream" is where the bytes are ready (None: no ordering needed; 1 and 2 are
    # CUDA's legacy and per-thread default streams). Before version 3 there was no such key and
    # producers meant the legacy default stream.
    stream = interface.get("stream", LEGACY_STREAM)
    if stream == 0:
        raise _unsupported("__cuda_array_interface__ stream 0 is disallowed by the protocol", name)
    # The interface carries no device; CuPy-style arrays have .device.id, otherwise -1: unknown.
    device = getattr(getattr(array, "device", None), "id", -1)
    return BufferView(
        int(address or 0),
        count,
        dtype,
        array,
        device if isinstance(device, int) else -1,
        None if stream is None else int(stream),
    )


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


def dlpack_describe(capsule: Any, name: str = "?") -> tuple[int, int, str]:
    """(address, element count, dtype) of an unconsumed DLPack capsule.

    DLManagedTensor starts with its DLTensor, so the capsule pointer reads as one; the capsule is
    not consumed, and its owner keeps the memory alive.
    """
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = _DLTensor.from_address(get_pointer(capsule, b"dltensor"))
    dtype = _DLPACK_DTYPES.get((tensor.code, tensor.bits)) if tensor.lanes == 1 else None
    if dtype is None:
        raise _unsupported(
            f"DLPack dtype code {tensor.code}, {tensor.bits} bits, {tensor.lanes} lanes is not supported",
            name,
        )
    count, expected_stride = 1, 1
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    for extent in shape:
        count *= extent
    if tensor.strides and count:
        for axis in reversed(range(tensor.ndim)):
            if shape[axis] != 1 and tensor.strides[axis] != expected_stride:
                raise _unsupported("the DLPack tensor is not C-contiguous", name)
            expected_stride *= shape[axis]
    return int(tensor.data or 0) + int(tensor.byte_offset), count, dtype
