"""The fake CUDA runtime of tests/fake_cuda/ checked through ctypes, without commsched: streams are
asynchronous, events order work across streams (and a missing wait reads stale data), and the library
survives exits and forks as the real runtime does. Its NCCL half: tests/test_fake_nccl.py."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fake_cuda
import numpy as np
import pytest
from fake_cuda import CUDA_ERROR_NOT_READY, address, launch_write

SLOW_US = 300_000  # a producer this late is certainly still running when the host looks


# ---- the CUDA runtime ----


def test_stream_work_runs_after_the_call_returns(fake: ctypes.CDLL, new_stream: Callable[[], int]) -> None:
    """A late producer is not done when launch returns; stream and event queries say 600 until it is, and
    synchronizing the stream or the event waits for it."""
    stream = new_stream()
    target, source = np.zeros(256, np.float32), np.arange(256, dtype=np.float32)
    launch_write(fake, stream, target, source, SLOW_US)
    event = fake_cuda.new_event(fake)
    assert fake.cudaEventRecord(event, stream) == 0
    assert fake.cudaStreamQuery(stream) == CUDA_ERROR_NOT_READY
    assert fake.cudaEventQuery(event) == CUDA_ERROR_NOT_READY
    assert not target.any()
    assert fake.cudaEventSynchronize(event) == 0
    assert np.array_equal(target, source) and fake.cudaEventQuery(event) == 0
    assert fake.cudaStreamSynchronize(stream) == 0 and fake.cudaStreamQuery(stream) == 0
    assert fake.cudaEventDestroy(event) == 0
    assert fake_cuda.calls(fake) == [
        "write 1024 on own",
        "record ev1 on own main device 0",
        "eventsync ev1",
        "sync own",
    ]


@pytest.mark.parametrize("wait", [True, False])
def test_an_event_wait_orders_a_consumer_after_a_late_producer(
    fake: ctypes.CDLL, new_stream: Callable[[], int], wait: bool
) -> None:
    """With cudaStreamWaitEvent the consumer's copy sees the producer's data; without it, the stale data:
    a missing wait shows up as wrong numbers."""
    producer, consumer = new_stream(), new_stream()
    data, fresh, seen = (
        np.full(64, -1.0, np.float32),
        np.arange(64, dtype=np.float32),
        np.zeros(64, np.float32),
    )
    launch_write(fake, producer, data, fresh, SLOW_US)
    ready = fake_cuda.new_event(fake)
    fake.cudaEventRecord(ready, producer)
    if wait:
        fake.cudaStreamWaitEvent(consumer, ready, 0)
    fake.cudaMemcpyAsync(address(seen), address(data), data.nbytes, 4, consumer)
    fake.cudaStreamSynchronize(consumer)
    assert np.array_equal(seen, fresh if wait else np.full(64, -1.0, np.float32))
    fake.cudaStreamSynchronize(producer)
    fake.cudaEventDestroy(ready)


def test_a_wait_looks_at_the_record_current_when_called(
    fake: ctypes.CDLL, new_stream: Callable[[], int]
) -> None:
    """An event never recorded counts as complete, and a record made after the wait does not hold it up."""
    producer, consumer = new_stream(), new_stream()
    event = fake_cuda.new_event(fake)
    fake.cudaStreamWaitEvent(consumer, event, 0)  # nothing recorded yet
    produced = np.zeros(4)  # written late, so it must outlive the test's synchronize
    launch_write(fake, producer, produced, np.ones(4), SLOW_US)
    fake.cudaEventRecord(event, producer)
    seen, data = np.zeros(4), np.full(4, 7.0)
    fake.cudaMemcpyAsync(address(seen), address(data), data.nbytes, 4, consumer)
    fake.cudaStreamSynchronize(consumer)
    assert np.array_equal(seen, data) and fake.cudaEventQuery(event) == CUDA_ERROR_NOT_READY
    fake.cudaStreamSynchronize(producer)
    fake.cudaEventDestroy(event)


def test_streams_the_fake_never_made_get_workers(fake: ctypes.CDLL) -> None:
    """A user's handle, the legacy default stream (0 and 1 are one stream) and the per-thread default
    stream (2, one per host thread) are asynchronous streams too."""
    target = np.zeros(8)
    launch_write(fake, 0x5EED, target, np.ones(8), SLOW_US)
    assert fake.cudaStreamQuery(0x5EED) == CUDA_ERROR_NOT_READY and fake.cudaStreamQuery(0xABC) == 0
    fake.cudaStreamSynchronize(0x5EED)
    assert target.all()
    legacy = np.zeros(8)
    launch_write(fake, 0, legacy, np.ones(8), SLOW_US)
    assert fake.cudaStreamQuery(1) == CUDA_ERROR_NOT_READY
    fake.cudaStreamSynchronize(1)
    assert fake.cudaStreamQuery(0) == 0 and legacy.all()
    other_thread_busy: list[int] = []

    def launch_on_own_default_stream() -> None:
        written = np.zeros(8)
        launch_write(fake, 2, written, np.ones(8), SLOW_US)
        other_thread_busy.append(fake.cudaStreamQuery(2))
        fake.cudaStreamSynchronize(2)
        assert written.all()

    thread = threading.Thread(target=launch_on_own_default_stream)
    thread.start()
    while not other_thread_busy:
        time.sleep(0.001)
    assert other_thread_busy == [CUDA_ERROR_NOT_READY] and fake.cudaStreamQuery(2) == 0  # not this thread's
    thread.join()
    assert "write 64 on 0x5eed" in fake_cuda.calls(fake)


def test_host_functions_and_the_per_operation_delay(fake: ctypes.CDLL, new_stream: Callable[[], int]) -> None:
    """cudaLaunchHostFunc runs on the worker when reached; fake_set_delay_us holds every operation back."""
    stream = new_stream()
    ran: list[int] = []
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: ran.append(threading.get_ident()))
    fake_cuda.set_delay_us(fake, 200_000)
    assert fake.cudaLaunchHostFunc(stream, ctypes.cast(callback, ctypes.c_void_p), None) == 0
    assert not ran and fake.cudaStreamQuery(stream) == CUDA_ERROR_NOT_READY
    fake.cudaStreamSynchronize(stream)
    assert len(ran) == 1 and ran[0] != threading.get_ident()


def test_memory_copies_and_free(fake: ctypes.CDLL) -> None:
    """cudaMalloc gives 64-byte aligned memory, cudaMemcpy copies at once, cudaFree waits for the streams."""
    pointer = ctypes.c_void_p()
    assert fake.cudaMalloc(ctypes.byref(pointer), 100) == 0 and pointer.value % 64 == 0
    source, back = np.arange(25, dtype=np.float32), np.zeros(25, np.float32)
    assert fake.cudaMemcpy(pointer, address(source), 100, 1) == 0
    assert fake.cudaMemcpy(address(back), pointer, 100, 2) == 0 and np.array_equal(back, source)
    late = np.zeros(25, np.float32)
    launch_write(fake, 0x5EED, late, source, SLOW_US)
    assert fake.cudaFree(pointer) == 0
    assert np.array_equal(late, source) and fake.cudaStreamQuery(0x5EED) == 0


def test_stream_destroy_drains_the_stream(fake: ctypes.CDLL) -> None:
    """Work queued before cudaStreamDestroy still runs; a handle the fake did not make cannot be destroyed."""
    stream = ctypes.c_void_p()
    fake.cudaStreamCreateWithFlags(ctypes.byref(stream), 0)
    target = np.zeros(4)
    launch_write(fake, stream, target, np.ones(4), SLOW_US)
    assert fake.cudaStreamDestroy(stream) == 0 and target.all()
    assert fake.cudaStreamDestroy(0x5EED) == 400


def test_devices_are_per_thread(fake: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """cudaSetDevice is per host thread; the count comes from FAKE_CUDA_DEVICES (default 2)."""
    count = ctypes.c_int()
    assert fake.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value == 2
    assert fake.cudaSetDevice(1) == 0 and fake.fake_current_device() == 1
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(fake.fake_current_device()))
    thread.start()
    thread.join()
    assert seen == [0]
    assert fake.cudaSetDevice(2) == 101 and fake.cudaGetErrorString(101) == b"invalid device ordinal"
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    assert fake.cudaSetDevice(2) == 0
    fake.cudaSetDevice(0)
    assert fake_cuda.calls(fake) == ["setdevice 1", "setdevice 2", "setdevice 2", "setdevice 0"]


def test_the_call_log_is_a_ring(fake: ctypes.CDLL) -> None:
    """A long run keeps the latest 32768 entries instead of overflowing."""
    for device in range(40_000):
        fake.cudaSetDevice(device % 2)
    log = fake_cuda.calls(fake)
    assert len(log) == 32768 and log[-1] == "setdevice 1" and log[0] == f"setdevice {(40_000 - 32768) % 2}"


def test_the_process_exits_with_workers_alive(fake_nccl: tuple[Path, ctypes.CDLL]) -> None:
    """A stream still sleeping at exit, or one whose library was dlclosed, does not hang or crash the exit."""
    program = (
        "import ctypes, sys, time, numpy as np, _ctypes; sys.path.insert(0, sys.argv[2]); import fake_cuda\n"
        "lib = fake_cuda.load(sys.argv[1]); a, b = np.zeros(4), np.ones(4)\n"
        "fake_cuda.launch_write(lib, 0x5EED, a, b, 100_000); fake_cuda.launch_write(lib, 0xF00, a, b, 60_000_000)\n"
        "_ctypes.dlclose(lib._handle); time.sleep(0.3)\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", program, str(fake_nccl[0]), str(Path(__file__).parent)],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 20


def test_a_forked_child_gets_fresh_stream_workers(fake_nccl: tuple[Path, ctypes.CDLL]) -> None:
    """After fork, the child's streams run (the parent's workers do not exist there) instead of hanging."""
    program = (
        "import os, sys, numpy as np; sys.path.insert(0, sys.argv[2]); import fake_cuda\n"
        "lib = fake_cuda.load(sys.argv[1]); a = np.zeros(4)\n"
        "fake_cuda.launch_write(lib, 0x5EED, a, np.ones(4), 1000); lib.cudaStreamSynchronize(0x5EED)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    b = np.zeros(4); fake_cuda.launch_write(lib, 0x5EED, b, np.full(4, 2.0), 1000)\n"
        "    lib.cudaStreamSynchronize(0x5EED); os._exit(0 if (b == 2).all() else 1)\n"
        "sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(fake_nccl[0]), str(Path(__file__).parent)],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


def test_fake_mpix_answers_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MPIX_Query_cuda_support answers FAKE_MPIX_CUDA, 1 when unset."""
    library = fake_cuda.build_mpix(tmp_path)
    if library is None:
        pytest.skip("needs a C compiler")
    query = ctypes.CDLL(str(library)).MPIX_Query_cuda_support
    monkeypatch.delenv("FAKE_MPIX_CUDA", raising=False)
    assert query() == 1
    monkeypatch.setenv("FAKE_MPIX_CUDA", "0")
    assert query() == 0


# ---- NCCL in one process ----
