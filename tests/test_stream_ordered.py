"""Stream-ordered completion on the fake libnccl/libcudart of tests/fake_cuda: Handle.wait_stream()
returns once the collective is launched on commsched's stream and makes the consumer's stream wait
for it on the (fake) GPU, so the host goes on while the stream work is still queued."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
from fake_cuda import FakeCudaArray, calls, set_delay_us

import commsched

CONSUMER = 0x7777  # the stream the result is used on (any handle names a fake stream)


@pytest.fixture
def nccl_runtime(nccl_env: ctypes.CDLL):
    """commsched on the fake NCCL, shut down after the test, with no per-operation delay left behind."""
    yield nccl_env
    set_delay_us(nccl_env, 0)
    commsched.shutdown()


def _consumer_wait(log: list[str]) -> tuple[int, str]:
    """(index in the log, event) of the consumer stream's wait."""
    waits = [(i, c.split()[2]) for i, c in enumerate(log) if c.startswith(f"wait {CONSUMER:#x} ")]
    assert len(waits) == 1, log
    return waits[0]


def test_wait_stream_returns_before_the_gpu_finished(nccl_runtime: ctypes.CDLL) -> None:
    """Every stream operation sleeps 300 ms: wait_stream() comes back long before the allreduce ran, the
    consumer stream waits on the event recorded right after it, and once that stream is synchronised
    the result is there."""
    commsched.init(transport="nccl")
    data = FakeCudaArray(np.arange(1024, dtype=np.float32), stream=0x5EED)
    set_delay_us(nccl_runtime, 300_000)
    handle = commsched.allreduce_async(data, name="g")
    started = time.monotonic()
    assert handle.wait_stream(CONSUMER, timeout=30) is data
    assert time.monotonic() - started < 0.25
    assert not handle.done()  # the fake GPU has not run it yet
    log = calls(nccl_runtime)
    where, event = _consumer_wait(log)
    reduce = max(i for i, c in enumerate(log) if c.startswith("allreduce"))
    records = [i for i, c in enumerate(log) if c.startswith(f"record {event} on own")]
    assert records and reduce < records[-1] < where, log
    assert nccl_runtime.cudaStreamSynchronize(ctypes.c_void_p(CONSUMER)) == 0
    assert time.monotonic() - started > 0.6  # the consumer waited for the submit, reduce and record ops
    assert np.array_equal(data.host, np.arange(1024, dtype=np.float32))
    handle.wait(30)


def test_a_partitioned_tensor_is_waited_for_after_its_last_chunk(nccl_runtime: ctypes.CDLL) -> None:
    """Four chunks behind a one-chunk credit: wait_stream() returns only once the fourth is launched,
    and the consumer waits on the event after that one (the stream runs launches in order)."""
    commsched.init(transport="nccl", partition_bytes="4KiB", credit_bytes="4KiB")
    data = FakeCudaArray(np.arange(4096, dtype=np.float32), stream=0x5EED)
    set_delay_us(nccl_runtime, 20_000)
    handle = commsched.allreduce_async(data, name="big")
    handle.wait_stream(CONSUMER, timeout=30)
    log = calls(nccl_runtime)
    where, event = _consumer_wait(log)
    reduces = [i for i, c in enumerate(log) if c.startswith("allreduce")]
    assert len(reduces) == 4 and reduces[-1] < where, log
    last_record = max(i for i, c in enumerate(log[:where]) if c.startswith("record") and " on own " in c)
    assert log[last_record].split()[1] == event and last_record > reduces[-1], log
    handle.wait(30)
    assert commsched.stats()["launches"] == 4


def test_host_transports_wait_until_done(nccl_env: ctypes.CDLL) -> None:
    """Where the bytes live in host memory there is no stream to wait on: wait_stream() is wait()."""
    commsched.init(transport="loopback")
    try:
        data = np.arange(16, dtype=np.float32)
        handle = commsched.allreduce_async(data, name="host")
        assert handle.wait_stream(CONSUMER, timeout=30) is data
        assert handle.done()
    finally:
        commsched.shutdown()
