"""The fake CUDA runtime + NCCL of tests/fake_cuda/ checked through ctypes, without commsched: streams are
asynchronous, events order work across streams (and a missing wait reads stale data), collectives across
real processes match numpy bit for bit, and NCCL's failure modes (late peer, abort) behave as NCCL's do."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fake_cuda
import numpy as np
import pytest
from fake_cuda import CUDA_ERROR_NOT_READY, NCCL_REMOTE_ERROR, address, launch_write

RANK_SCRIPT = Path(__file__).resolve().parent / "ranks" / "fake_nccl_collectives.py"
FLOAT32 = fake_cuda.NCCL_DTYPES["float32"]
SLOW_US = 300_000  # a producer this late is certainly still running when the host looks


@pytest.fixture
def fake(fake_nccl: tuple[Path, ctypes.CDLL]) -> Iterator[ctypes.CDLL]:
    """The session's fake library with prototypes declared, an empty log and no per-operation delay; later
    tests find this thread back on device 0."""
    handle = fake_cuda.declare(fake_nccl[1])
    handle.fake_reset()
    handle.fake_set_main_thread()
    fake_cuda.set_delay_us(handle, 0)
    yield handle
    fake_cuda.set_delay_us(handle, 0)
    handle.cudaSetDevice(0)


@pytest.fixture
def new_stream(fake: ctypes.CDLL) -> Iterator[Callable[[], int]]:
    """Makes streams with cudaStreamCreateWithFlags and destroys them after the test (other tests expect
    their first stream to be logged as "own")."""
    made: list[int] = []

    def make() -> int:
        stream = ctypes.c_void_p()
        assert fake.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
        made.append(stream.value)
        return stream.value

    yield make
    for stream in made:
        assert fake.cudaStreamDestroy(stream) == 0


def _event(fake: ctypes.CDLL) -> int:
    event = ctypes.c_void_p()
    assert fake.cudaEventCreateWithFlags(ctypes.byref(event), 2) == 0
    return event.value


def _comms(fake: ctypes.CDLL, nranks: int) -> list[int]:
    """One communicator per rank, all in this process (each init blocks until all joined, so threads)."""
    raw = fake_cuda.unique_id(fake)
    comms = [ctypes.c_void_p() for _ in range(nranks)]
    results = [-1] * nranks

    def init(rank: int) -> None:
        results[rank] = fake.ncclCommInitRank(
            ctypes.byref(comms[rank]), nranks, fake_cuda.unique_id_from(raw), rank
        )

    threads = [threading.Thread(target=init, args=(rank,)) for rank in range(nranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [0] * nranks
    return [comm.value for comm in comms]


def _async_error(fake: ctypes.CDLL, comm: int) -> int:
    error = ctypes.c_int(-1)
    assert fake.ncclCommGetAsyncError(comm, ctypes.byref(error)) == 0
    return error.value


# ---- the CUDA runtime ----


def test_stream_work_runs_after_the_call_returns(fake: ctypes.CDLL, new_stream: Callable[[], int]) -> None:
    """A late producer is not done when launch returns; stream and event queries say 600 until it is, and
    synchronizing the stream or the event waits for it."""
    stream = new_stream()
    target, source = np.zeros(256, np.float32), np.arange(256, dtype=np.float32)
    launch_write(fake, stream, target, source, SLOW_US)
    event = _event(fake)
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
    ready = _event(fake)
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
    event = _event(fake)
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


def test_a_one_rank_communicator_is_the_identity(fake: ctypes.CDLL, new_stream: Callable[[], int]) -> None:
    """Size 1: sum, average, gathers and scatters give the input back; a send to self meets its receive."""
    (comm,) = _comms(fake, 1)
    stream = new_stream()
    data, out, echo = (
        np.arange(1000, dtype=np.float32),
        np.zeros(1000, np.float32),
        np.zeros(1000, np.float32),
    )
    fake.ncclAllReduce(address(data), address(data), 1000, FLOAT32, 0, comm, stream)
    fake.ncclAllReduce(address(data), address(out), 1000, FLOAT32, 4, comm, stream)
    fake.ncclGroupStart()
    fake.ncclSend(address(data), 1000, FLOAT32, 0, comm, stream)
    fake.ncclRecv(address(echo), 1000, FLOAT32, 0, comm, stream)
    fake.ncclGroupEnd()
    fake.cudaStreamSynchronize(stream)
    expected = np.arange(1000, dtype=np.float32)
    assert np.array_equal(data, expected) and np.array_equal(out, expected) and np.array_equal(echo, expected)
    assert fake.ncclCommDestroy(comm) == 0
    log = fake_cuda.calls(fake)
    assert log[:2] == ["uniqueid", "init on device 0"] and log[-1] == "destroy", log


@pytest.mark.parametrize("wait", [True, False])
def test_a_collective_without_its_wait_reduces_stale_data(
    fake: ctypes.CDLL, new_stream: Callable[[], int], wait: bool
) -> None:
    """A gradient written late on the compute stream: the allreduce on the communicator's stream sees it only
    when ordered after it by an event."""
    (comm,) = _comms(fake, 1)
    compute, nccl = new_stream(), new_stream()
    gradient, result = np.zeros(512, np.float32), np.zeros(512, np.float32)
    launch_write(fake, compute, gradient, np.full(512, 3, np.float32), SLOW_US)
    ready = _event(fake)
    fake.cudaEventRecord(ready, compute)
    if wait:
        fake.cudaStreamWaitEvent(nccl, ready, 0)
    fake.ncclAllReduce(address(gradient), address(result), 512, FLOAT32, 0, comm, nccl)
    fake.cudaStreamSynchronize(nccl)
    assert np.array_equal(result, np.full(512, 3 if wait else 0, np.float32))
    fake.cudaStreamSynchronize(compute)
    fake.cudaEventDestroy(ready)
    fake.ncclCommDestroy(comm)


def test_a_peer_that_never_arrives_sets_a_remote_error_and_abort_unblocks(
    fake: ctypes.CDLL, new_stream: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 never joins the allreduce: after FAKE_NCCL_TIMEOUT_S rank 0's async error is ncclRemoteError and
    the collective still hangs, like a kernel waiting on a peer; ncclCommAbort ends it without a result."""
    monkeypatch.setenv("FAKE_NCCL_TIMEOUT_S", "0.3")
    lonely, absent = _comms(fake, 2)
    stream = new_stream()
    data = np.ones(100, np.float32)
    assert fake.ncclAllReduce(address(data), address(data), 100, FLOAT32, 0, lonely, stream) == 0
    deadline = time.monotonic() + 20
    while _async_error(fake, lonely) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _async_error(fake, lonely) == NCCL_REMOTE_ERROR
    time.sleep(0.1)
    assert fake.cudaStreamQuery(stream) == CUDA_ERROR_NOT_READY
    assert fake.ncclCommAbort(lonely) == 0
    assert fake.cudaStreamSynchronize(stream) == 0 and np.array_equal(data, np.ones(100, np.float32))
    assert fake.ncclCommDestroy(absent) == 0
    assert fake.ncclGetErrorString(NCCL_REMOTE_ERROR) == b"remote process exited or there was a network error"


def test_a_peer_that_aborts_fails_the_waiting_rank_at_once(
    fake: ctypes.CDLL, new_stream: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default 60 s timeout, a peer's ncclCommAbort still makes the waiting rank's error
    ncclRemoteError promptly."""
    monkeypatch.delenv("FAKE_NCCL_TIMEOUT_S", raising=False)
    waiting, leaving = _comms(fake, 2)
    stream = new_stream()
    data = np.ones(10, np.float32)
    fake.ncclBroadcast(address(data), address(data), 10, FLOAT32, 1, waiting, stream)
    fake.ncclCommAbort(leaving)
    deadline = time.monotonic() + 10
    while _async_error(fake, waiting) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _async_error(fake, waiting) == NCCL_REMOTE_ERROR
    fake.ncclCommAbort(waiting)
    assert fake.cudaStreamSynchronize(stream) == 0


def test_init_times_out_without_all_ranks_and_leaves_no_segment(
    fake: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only one rank of two: ncclCommInitRank gives ncclSystemError after the timeout and removes the segment."""
    monkeypatch.setenv("FAKE_NCCL_TIMEOUT_S", "0.2")
    raw = fake_cuda.unique_id(fake)
    comm = ctypes.c_void_p()
    assert fake.ncclCommInitRank(ctypes.byref(comm), 2, fake_cuda.unique_id_from(raw), 0) == 2
    name = raw[16:].split(b"\0")[0].decode()
    assert name.startswith("/fakenccl-") and not Path("/dev/shm" + name).exists()
    assert fake.ncclCommInitRank(ctypes.byref(comm), 2, fake_cuda.unique_id_from(raw), 2) == 4
    assert fake_cuda.calls(fake)[-1] == "init-bad-args"


def test_an_injected_async_error_is_reported(fake: ctypes.CDLL) -> None:
    """fake_fail_comm sets what ncclCommGetAsyncError reports."""
    (comm,) = _comms(fake, 1)
    assert _async_error(fake, comm) == 0
    fake.fake_fail_comm(comm, 3)
    assert _async_error(fake, comm) == 3
    fake.ncclCommDestroy(comm)


def test_version_from_the_environment(fake: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """ncclGetVersion answers FAKE_NCCL_VERSION, 22105 (2.21.5) by default."""
    version = ctypes.c_int()
    monkeypatch.delenv("FAKE_NCCL_VERSION", raising=False)
    assert fake.ncclGetVersion(ctypes.byref(version)) == 0 and version.value == 22105
    monkeypatch.setenv("FAKE_NCCL_VERSION", "2803")
    fake.ncclGetVersion(ctypes.byref(version))
    assert version.value == 2803


# ---- NCCL across processes ----


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def _reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """numpy's reduction in rank order, in the arrays' own type; average divides the sum, integers
    truncating toward zero."""
    if op in ("max", "min"):
        return functools.reduce(np.maximum if op == "max" else np.minimum, arrays)
    total = functools.reduce(np.multiply if op == "prod" else np.add, arrays)
    if op != "avg":
        return total
    ranks = len(arrays)
    if total.dtype.kind not in "iu":
        return total / total.dtype.type(ranks)
    quotient = total // total.dtype.type(ranks)
    inexact_negative = (total % total.dtype.type(ranks) != 0) & (total < 0)
    return quotient + inexact_negative.astype(total.dtype)


def _expected(case: str, inputs: list[np.ndarray], rank: int, count: int) -> np.ndarray:
    """What rank should hold after the collective named by case, from every rank's input."""
    kind, _, detail = case.split("__")
    ranks = len(inputs)
    if kind in ("allreduce", "allreduce_inplace"):
        return _reduce(inputs, detail)
    if kind == "reducescatter":
        return _reduce([sent[rank * count : (rank + 1) * count] for sent in inputs], detail)
    if kind == "broadcast":
        return inputs[int(detail)]
    if kind == "allgather":
        return np.concatenate(inputs)
    assert kind == "alltoall", case
    return np.concatenate([inputs[source][rank * count : (rank + 1) * count] for source in range(ranks)])


@pytest.mark.parametrize("nranks", [2, 3])
def test_collectives_across_processes_match_numpy(
    fake: ctypes.CDLL,
    fake_nccl: tuple[Path, ctypes.CDLL],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nranks: int,
) -> None:
    """Every collective, dtype and op on 2 and 3 processes, chunked through small slots and rings, equals the
    numpy reference on every rank bit for bit (in place and out of place)."""
    names = [name for name in fake_cuda.NCCL_DTYPES if name != "bfloat16"]
    try:
        import ml_dtypes  # noqa: F401

        names.append("bfloat16")
    except ImportError:
        pass  # bfloat16 is checked where ml_dtypes (a TensorFlow dependency) is installed
    count = 301  # with the slots below: several chunks, the last one partial
    monkeypatch.setenv("FAKE_NCCL_SLOT_BYTES", "1000")
    monkeypatch.setenv("FAKE_NCCL_CHANNEL_BYTES", "333")
    raw = fake_cuda.unique_id(fake)
    env = {**os.environ, "FAKE_NCCL_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(RANK_SCRIPT),
                str(fake_nccl[0]),
                raw.hex(),
                str(nranks),
                str(rank),
                str(tmp_path),
                str(count),
                *names,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(nranks)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    assert [process.returncode for process in ranks] == [0] * nranks, outputs
    saved = [np.load(tmp_path / f"rank{rank}.npz") for rank in range(nranks)]
    cases = sorted(key[: -len("__in")] for key in saved[0].files if key.endswith("__in"))
    assert len(cases) == len(names) * (3 * 5 + len({0, nranks - 1}) + 2)
    for case in cases:
        dtype = _dtype(case.split("__")[1])
        inputs = [ranks_saved[f"{case}__in"].view(dtype) for ranks_saved in saved]
        for rank in range(nranks):
            expected = _expected(case, inputs, rank, count).astype(dtype)
            got = saved[rank][f"{case}__out"]
            assert np.array_equal(got, expected.view(got.dtype)), (
                case,
                rank,
                got.view(dtype)[:8],
                expected[:8],
            )


# ---- PreMulSum and rooted reduces (in one process, one stream per rank) ----


def _premul(fake: ctypes.CDLL, comm: int, scalar: np.ndarray) -> int:
    op = ctypes.c_int(-1)
    dtype = fake_cuda.NCCL_DTYPES[scalar.dtype.name]
    assert fake.ncclRedOpCreatePreMulSum(ctypes.byref(op), address(scalar), dtype, 1, comm) == 0
    return op.value


def test_premulsum_multiplies_every_input_before_the_sum(
    fake: ctypes.CDLL, new_stream: Callable[[], int]
) -> None:
    """sum(factor * input) on every rank, the factor read when the op is made (destroyed right after the
    launch, as NCCL allows); a plain sum, a destroyed op or an op of another type is told apart."""
    comms = _comms(fake, 2)
    streams = [new_stream(), new_stream()]
    int32 = fake_cuda.NCCL_DTYPES["int32"]
    inputs = [np.arange(100, dtype=np.int32) + 7 * rank for rank in range(2)]
    outputs = [np.zeros(100, np.int32) for _ in range(2)]
    for rank, comm in enumerate(comms):
        scalar = np.array([3], np.int32)
        op = _premul(fake, comm, scalar)
        scalar[0] = 1000  # host-immediate: already read
        assert (
            fake.ncclAllReduce(
                address(inputs[rank]), address(outputs[rank]), 100, int32, op, comm, streams[rank]
            )
            == 0
        )
        assert fake.ncclRedOpDestroy(op, comm) == 0
        assert (
            fake.ncclAllReduce(
                address(inputs[rank]), address(outputs[rank]), 100, int32, op, comm, streams[rank]
            )
            != 0
        )
        assert fake.ncclRedOpDestroy(op, comm) != 0
    for stream in streams:
        fake.cudaStreamSynchronize(stream)
    plain_sum = inputs[0] + inputs[1]
    for output in outputs:
        assert np.array_equal(output, 3 * plain_sum) and not np.array_equal(output, plain_sum)
    wrong_type = _premul(fake, comms[0], np.array([2.0], np.float32))
    assert (
        fake.ncclAllReduce(
            address(inputs[0]), address(outputs[0]), 100, int32, wrong_type, comms[0], streams[0]
        )
        != 0
    )
    assert (
        fake.ncclBroadcast(address(inputs[0]), address(outputs[0]), 100, int32, 0, comms[0], streams[0]) == 0
    )
    assert (
        fake.ncclBroadcast(address(inputs[1]), address(outputs[1]), 100, int32, 0, comms[1], streams[1]) == 0
    )
    for stream in streams:
        fake.cudaStreamSynchronize(stream)
    for comm in comms:
        fake.ncclCommDestroy(comm)


def test_premulsum_in_a_half_precision_reducescatter(
    fake: ctypes.CDLL, new_stream: Callable[[], int]
) -> None:
    """float16: each input is multiplied (rounded to half) before the sum, part by part."""
    comms = _comms(fake, 2)
    streams = [new_stream(), new_stream()]
    float16 = fake_cuda.NCCL_DTYPES["float16"]
    inputs = [(np.arange(8, dtype=np.float16) + rank) / np.float16(4) for rank in range(2)]
    outputs = [np.zeros(4, np.float16) for _ in range(2)]
    for rank, comm in enumerate(comms):
        op = _premul(fake, comm, np.array([0.5], np.float16))
        fake.ncclReduceScatter(
            address(inputs[rank]), address(outputs[rank]), 4, float16, op, comm, streams[rank]
        )
        fake.ncclRedOpDestroy(op, comm)
    for stream in streams:
        fake.cudaStreamSynchronize(stream)
    scaled = [x * np.float16(0.5) for x in inputs]
    for rank, output in enumerate(outputs):
        assert np.array_equal(output, (scaled[0] + scaled[1])[rank * 4 : rank * 4 + 4])
    for comm in comms:
        fake.ncclCommDestroy(comm)


def test_grouped_reduces_write_only_their_root(fake: ctypes.CDLL, new_stream: Callable[[], int]) -> None:
    """Uneven parts as one ncclReduce per part in a group: each root gets its part's sum, the other
    ranks' receive buffers stay as they were."""
    comms = _comms(fake, 3)
    streams = [new_stream() for _ in comms]
    float64 = fake_cuda.NCCL_DTYPES["float64"]
    parts = [1, 4, 2]
    inputs = [np.arange(7, dtype=np.float64) * (rank + 1) for rank in range(3)]
    outputs = [np.full(parts[rank], -5.0) for rank in range(3)]
    for rank, comm in enumerate(comms):
        fake.ncclGroupStart()
        offset = 0
        for root, count in enumerate(parts):
            assert (
                fake.ncclReduce(
                    address(inputs[rank]) + offset * 8,
                    address(outputs[rank]),
                    count,
                    float64,
                    0,
                    root,
                    comm,
                    streams[rank],
                )
                == 0
            )
            offset += count
        assert fake.ncclGroupEnd() == 0
    for stream in streams:
        fake.cudaStreamSynchronize(stream)
    total = sum(inputs)
    bounds = np.cumsum([0, *parts])
    for rank, output in enumerate(outputs):
        assert np.array_equal(output, total[bounds[rank] : bounds[rank + 1]]), (rank, output)
    for comm in comms:
        fake.ncclCommDestroy(comm)
