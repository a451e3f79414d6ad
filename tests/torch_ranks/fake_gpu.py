"""Runs the torch plug-in's CUDA path without a GPU: parameters that report is_cuda=True, and torch
tensors handed to commsched as device memory, so they travel through its NCCL transport over the fake
libcudart/libnccl of tests/fake_cuda.py (host memory stands in for device memory; the fake's NCCL
reduces across real processes)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from commsched import buffers, device_output

real_device_result = device_output.device_result


class CudaParameter(torch.nn.Parameter):
    """A parameter that says it lives on a GPU: the plug-in must treat it as a CUDA one."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def claim_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """Replaces every parameter of `model` with a CudaParameter holding the same values; returns it."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = CudaParameter(param.detach().clone(), param.requires_grad)
    return model


def route_through(library: str) -> None:
    """Points commsched's NCCL and CUDA runtime at the fake `library` and presents torch tensors as device memory."""
    import os

    os.environ["COMMSCHED_NCCL_LIBRARY"] = os.environ["COMMSCHED_CUDART_LIBRARY"] = library
    buffers._gpu_view = device_view
    device_output.device_result = host_result


def host_result(memory: Any, elements: int, dtype: str, row_shape: tuple[int, ...], like: Any) -> Any:
    """commsched.device_output.device_result for this setting: an allgather's or reducescatter's output
    in the fake's "device" memory (host memory) copied into a CPU torch tensor, since torch would start
    CUDA on a __cuda_array_interface__."""
    if not isinstance(like, torch.Tensor):
        return real_device_result(memory, elements, dtype, row_shape, like)
    torch_dtype = getattr(torch, dtype)
    size = torch.empty(0, dtype=torch_dtype).element_size()
    raw = (ctypes.c_uint8 * (elements * size)).from_address(int(memory.address)) if elements else b""
    flat = (
        torch.frombuffer(bytearray(raw), dtype=torch_dtype) if elements else torch.empty(0, dtype=torch_dtype)
    )
    row = 1
    for extent in row_shape:
        row *= extent
    return flat.reshape((elements // row if row else 0, *row_shape))


def device_view(array: Any, name: str) -> buffers.BufferView | None:
    """commsched.buffers._gpu_view for this setting: a torch tensor is device memory (of the rank's own
    device: -1, unknown) ready on the legacy default stream; anything else is left to the usual parsing."""
    if not isinstance(array, torch.Tensor):
        return None
    assert array.is_contiguous(), f"'{name}' reached commsched non-contiguous"
    dtype = str(array.dtype).removeprefix("torch.")
    return buffers.BufferView(array.data_ptr(), array.numel(), dtype, array, -1, buffers.LEGACY_STREAM)
