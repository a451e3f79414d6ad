"""Results of allgather, reducescatter and alltoall on GPU memory: the core's output buffer, exposed
through __cuda_array_interface__ (and as a torch tensor for torch inputs) without a copy. The
handle completes only once the GPU finished the collective, so any stream may read it."""

from __future__ import annotations

from typing import Any

_TYPESTR = {
    "float16": "<f2",
    "bfloat16": "<V2",  # no typestr for bfloat16: torch views the bytes as bfloat16 below
    "float32": "<f4",
    "float64": "<f8",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "|u1",
    "int8": "|i1",
    "bool": "|b1",
}


class DeviceArray:
    """A collective's result in device memory; keeps the memory alive while anything views it."""

    def __init__(self, memory: Any, shape: tuple[int, ...], dtype: str) -> None:
        self.memory = memory
        self.shape = shape
        self.dtype = dtype
        self.address = int(memory.address)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3; no stream: the data is final when the handle completes."""
        return {
            "shape": self.shape,
            "typestr": _TYPESTR[self.dtype],
            "data": (self.address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def device_result(memory: Any, elements: int, dtype: str, row_shape: tuple[int, ...], like: Any) -> Any:
    """The result as a DeviceArray, or as a torch tensor on `like`'s device when `like` is one."""
    row = 1
    for extent in row_shape:
        row *= extent
    rows = elements // row if row else 0
    array = DeviceArray(memory, (rows, *row_shape), dtype)
    if type(like).__module__.startswith("torch") and hasattr(like, "data_ptr"):
        import torch

        if dtype == "bfloat16":
            array = DeviceArray(memory, (rows, *row_shape), "int16")
            return torch.as_tensor(array, device=like.device).view(torch.bfloat16)
        return torch.as_tensor(array, device=like.device)
    return array
