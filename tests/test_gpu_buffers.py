"""commsched.buffers on GPU arrays, without a GPU: fake objects exposing __cuda_array_interface__ or
__dlpack__/__dlpack_device__ must give a BufferView with the device and the stream to order after."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fake_cuda import FakeCudaArray

from commsched import buffers


class _Interface:
    """An object with nothing but a __cuda_array_interface__."""

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__cuda_array_interface__ = interface


class _DLPackProducer:
    """Host memory claiming to be on a DLPack device; remembers the stream it was asked for."""

    def __init__(self, host: np.ndarray, device: tuple[int, int], takes_stream: bool = True) -> None:
        self.host = host
        self.device = device
        self.takes_stream = takes_stream
        self.asked: list[Any] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **kwargs: Any) -> Any:
        if kwargs and not self.takes_stream:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'stream'")
        self.asked.append(kwargs.get("stream", "none given"))
        return self.host.__dlpack__()


def test_cuda_array_interface_gives_address_count_dtype_device_and_stream() -> None:
    """Version 3: the stream on which the bytes are ready comes through; CuPy-style .device.id too."""
    host = np.zeros((4, 5), np.float16)
    view = buffers.view(FakeCudaArray(host, stream=0x1234, device_id=3), "x")
    assert (view.address, view.count, view.dtype, view.device, view.stream) == (
        host.ctypes.data,
        20,
        "float16",
        3,
        0x1234,
    )
    assert view.on_gpu and view.nbytes == 40


def test_cuda_array_interface_streams_and_devices() -> None:
    """No "stream" key (before version 3): the legacy default stream; None: no ordering; no device: -1."""
    base = {"data": (4096, False), "shape": (8,), "typestr": "<f4", "strides": None}
    v2 = buffers.view(_Interface({**base, "version": 2}), "v2")
    assert (v2.stream, v2.device) == (buffers.LEGACY_STREAM, -1)
    free = buffers.view(_Interface({**base, "version": 3, "stream": None}), "free")
    assert free.stream is None and free.on_gpu
    with pytest.raises(TypeError, match="tensor 'zero'.*stream 0 is disallowed"):
        buffers.view(_Interface({**base, "version": 3, "stream": 0}), "zero")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strides": (40, 8), "shape": (4, 5)}, "not C-contiguous"),
        ({"data": (64, True)}, "read-only"),
        ({"mask": object()}, "masked"),
        ({"typestr": "<c8"}, "typestr '<c8' is not supported"),
    ],
)
def test_bad_cuda_arrays_are_refused_with_the_reason(change: dict[str, Any], message: str) -> None:
    """Strided, read-only, masked and unsupported arrays name the tensor and the problem."""
    interface = {
        "data": (64, False),
        "shape": (20,),
        "typestr": "<f4",
        "strides": None,
        "version": 3,
        **change,
    }
    with pytest.raises(TypeError, match=f"tensor 'bad'.*{message}"):
        buffers.view(_Interface(interface), "bad")


def test_c_contiguous_strides_are_accepted() -> None:
    """Explicit strides that are C order (and extents of one) are fine."""
    interface = {
        "data": (64, False),
        "shape": (4, 1, 5),
        "typestr": "<i8",
        "strides": (40, 8, 8),
        "version": 3,
    }
    assert buffers.view(_Interface(interface), "ok").count == 20


def test_dlpack_on_cuda_asks_for_the_legacy_stream() -> None:
    """A DLPack producer on kDLCUDA is read from its capsule after being asked for stream=1."""
    host = np.arange(12, dtype=np.int64).reshape(3, 4)
    producer = _DLPackProducer(host, (2, 1))
    view = buffers.view(producer, "d")
    assert (view.address, view.count, view.dtype, view.device, view.stream) == (
        host.ctypes.data,
        12,
        "int64",
        1,
        buffers.LEGACY_STREAM,
    )
    assert producer.asked == [1]
    managed = _DLPackProducer(host, (13, 0), takes_stream=False)  # kDLCUDAManaged, an older producer
    assert buffers.view(managed, "m").device == 0 and managed.asked == ["none given"]


def test_dlpack_on_other_devices() -> None:
    """CPU DLPack stays host memory; a non-CUDA accelerator is refused."""
    host = np.ones(6, np.float32)
    assert buffers.view(host, "cpu").device is None  # numpy has __dlpack_device__ == (1, 0)
    with pytest.raises(TypeError, match="tensor 'rocm'.*DLPack device type 10"):
        buffers.view(_DLPackProducer(host, (10, 0)), "rocm")
    strided = _DLPackProducer(np.ones((4, 4), np.float32)[:, ::2], (2, 0))
    with pytest.raises(TypeError, match="tensor 's'.*not C-contiguous"):
        buffers.view(strided, "s")


def test_host_arrays_have_no_device() -> None:
    """numpy, buffer-protocol objects and CPU torch tensors keep device None."""
    assert buffers.view(np.zeros(3), "n").device is None
    assert buffers.view(bytearray(8), "b").stream is None
    torch = pytest.importorskip("torch")
    assert buffers.view(torch.zeros(3), "t").device is None


class _TorchLikeCudaTensor:
    """What commsched.buffers reads of a CUDA torch.Tensor, over host memory."""

    is_cuda = True

    def __init__(self, host: np.ndarray, device: int) -> None:
        self.host, self.device_index = host, device
        self.dtype = "torch.float32"

    def data_ptr(self) -> int:
        return int(self.host.ctypes.data)

    def numel(self) -> int:
        return int(self.host.size)

    def is_contiguous(self) -> bool:
        return True

    def get_device(self) -> int:
        return self.device_index


def test_torch_cuda_tensor_orders_after_torchs_current_stream_on_its_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The raw current stream of the tensor's own device, read without building a Stream object; builds
    without that call fall back to torch.cuda.current_stream(device).cuda_stream."""
    torch = pytest.importorskip("torch")
    asked: list[int] = []

    def raw(device: int) -> int:
        asked.append(device)
        return 0xABC0 + device

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw, raising=False)
    host = np.arange(6, dtype=np.float32)
    view = buffers.view(_TorchLikeCudaTensor(host, device=2), "x")
    assert (view.address, view.count, view.dtype, view.device, view.stream) == (
        host.ctypes.data,
        6,
        "float32",
        2,
        0xABC2,
    )
    assert asked == [2]

    class _Stream:
        def __init__(self, device: int) -> None:
            self.cuda_stream = 0xDEF0 + device

    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    assert buffers.view(_TorchLikeCudaTensor(host, device=1), "x").stream == 0xDEF1
