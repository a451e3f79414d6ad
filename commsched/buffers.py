"""Turns user arrays into (address, element count, dtype) for the core, without copying."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

# numpy typestr / memoryview format -> commsched dtype, keyed by (kind, itemsize)
_KIND_SIZE_TO_DTYPE = {
    ("f", 2): "float16",
    ("f", 4): "float32",
    ("f", 8): "float64",
    ("i", 1): "int8",
    ("i", 4): "int32",
    ("i", 8): "int64",
    ("u", 1): "uint8",
}
_FORMAT_KIND = {"e": "f", "f": "f", "d": "f", "b": "i", "h": "i", "i": "i", "l": "i", "q": "i", "B": "u"}
_TORCH_DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.int32": "int32",
    "torch.int64": "int64",
    "torch.uint8": "uint8",
    "torch.int8": "int8",
}
SUPPORTED = "float16, bfloat16, float32, float64, int32, int64, uint8 or int8"


@dataclass(frozen=True)
class BufferView:
    """Raw view of a writable, contiguous array; `owner` keeps the memory alive."""

    address: int
    count: int
    dtype: str
    owner: Any


def _unsupported(what: str, name: str) -> TypeError:
    return TypeError(f"tensor '{name}': {what}; commsched needs a writable, C-contiguous {SUPPORTED} array")


def view(array: Any, name: str) -> BufferView:
    """Describes `array` for the core; raises TypeError naming the problem and the fix."""
    if hasattr(array, "__cuda_array_interface__") or getattr(array, "is_cuda", False):
        raise TypeError(
            f"tensor '{name}' lives on a GPU; this build handles CPU memory only (the NCCL transport is not built in)"
        )
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
        dtype = _KIND_SIZE_TO_DTYPE.get((typestr[1], int(typestr[2:])))
        if dtype is None:
            raise _unsupported(f"dtype {typestr!r} is not supported", name)
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
