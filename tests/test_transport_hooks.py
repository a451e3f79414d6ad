"""The core touches buffer memory only through the transport's copy() and scale() hooks: a Python
transport that provides them through the trampoline sees every fusion copy and every average."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import pytest
from python_core import running_on  # tests/ is on sys.path (conftest.py)

import commsched

_NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


class _Done:
    def test(self) -> bool:
        return True


class _HookedTransport:
    """A lone rank (like loopback) whose copy/scale work on the host and are logged."""

    name, rank, size = "hooked", 0, 1
    poll_interval_us = 100
    # Like NCCL: the core must not touch the tensors itself, so none rides inline in a report.
    host_memory = False

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.scales: list[tuple[int, int, str, float]] = []
        self.starts: list[tuple[int, int]] = []
        # The core's agreement round waits at this gate until the test opens it, so tensors
        # submitted meanwhile are agreed together in the next round (and fused).
        self.in_round = threading.Event()
        self.gate = threading.Event()

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        self.in_round.set()
        self.gate.wait(timeout_s)
        return [report]

    def start(self, address: int, count: int, dtype: str, kind: str, root: int) -> _Done:
        self.starts.append((address, count))
        return _Done()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.copies.append((dst, src, nbytes))
        ctypes.memmove(dst, src, nbytes)

    def scale(self, address: int, count: int, dtype: str, divisor: float) -> None:
        self.scales.append((address, count, dtype, divisor))
        kind = _NUMPY[dtype]
        data = np.ctypeslib.as_array(
            (ctypes.c_char * (count * np.dtype(kind).itemsize)).from_address(address)
        )
        # Scale by 10, not by the divisor (1 on one rank), so the test sees that the hook's result is kept.
        view = data.view(kind)
        view /= 10


@pytest.fixture
def hooked() -> Any:
    """The core running on _HookedTransport, with fusion on; stopped after the test."""
    with running_on(
        _HookedTransport(),
        partition_bytes=1 << 20,
        credit_bytes=16 << 20,
        fusion_bytes=1 << 20,
        cycle_time_s=0.001,
    ) as transport:
        yield transport


def test_fusion_copies_go_through_the_copy_hook(hooked: _HookedTransport) -> None:
    """Fused tensors are copied into the fusion buffer and back by the transport, not by a host memcpy."""
    arrays = [np.full(16, i, np.float32) for i in range(4)]
    assert hooked.in_round.wait(30)  # the core is inside an agreement round: the next one sees all four
    handles = [commsched.allreduce_async(a, name=f"t{i}") for i, a in enumerate(arrays)]
    hooked.gate.set()
    for handle in handles:
        handle.wait(30)
    assert [count for _, count in hooked.starts] == [64], hooked.starts  # one fused launch
    fusion_buffer = hooked.starts[0][0]
    expected_in = sorted((fusion_buffer + 64 * i, a.ctypes.data, 64) for i, a in enumerate(arrays))
    expected_out = sorted((a.ctypes.data, fusion_buffer + 64 * i, 64) for i, a in enumerate(arrays))
    assert sorted(hooked.copies[:4]) == expected_in
    assert sorted(hooked.copies[4:]) == expected_out
    for i, array in enumerate(arrays):
        assert np.array_equal(array, np.full(16, i, np.float32))


def test_average_goes_through_the_scale_hook(hooked: _HookedTransport) -> None:
    """op="average" divides through the transport's scale(), with the number of ranks as divisor."""
    hooked.gate.set()
    data = np.full(32, 5.0, np.float32)
    commsched.allreduce(data, name="avg", op="average", timeout=30)
    assert hooked.scales == [(data.ctypes.data, 32, "float32", 1.0)]
    assert np.array_equal(data, np.full(32, 0.5, np.float32))
    summed = np.full(8, 5.0, np.float64)
    commsched.allreduce(summed, name="sum", timeout=30)
    assert len(hooked.scales) == 1 and np.array_equal(summed, np.full(8, 5.0))
