"""The fake NCCL of tests/fake_cuda/ checked through ctypes, without commsched: collectives in one process
and across real processes match numpy bit for bit, and NCCL's failure modes (late peer, abort, injected
errors) behave as NCCL's do. Its CUDA runtime half: tests/test_fake_cuda.py."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import fake_cuda
import numpy as np
import pytest
from fake_cuda import CUDA_ERROR_NOT_READY, NCCL_REMOTE_ERROR, address, launch_write

RANK_SCRIPT = Path(__file__).resolve().parent / "ranks" / "fake_nccl_collectives.py"
FLOAT32 = fake_cuda.NCCL_DTYPES["float32"]
SLOW_US = 300_000  # a producer this late is certainly still running when the host looks


def test_a_one_rank_communicator_is_the_identity(fake: ctypes.CDLL, new_stream: Callable[[], int]) -> None:
    """Size 1: sum, average, gathers and scatters give the input back; a send to self meets its receive."""
    (comm,) = fake_cuda.communicators(fake, 1)
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
    (comm,) = fake_cuda.communicators(fake, 1)
    compute, nccl = new_stream(), new_stream()
    gradient, result = np.zeros(512, np.float32), np.zeros(512, np.float32)
    launch_write(fake, compute, gradient, np.full(512, 3, np.float32), SLOW_US)
    ready = fake_cuda.new_event(fake)
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
    lonely, absent = fake_cuda.communicators(fake, 2)
    stream = new_stream()
    data = np.ones(100, np.float32)
    assert fake.ncclAllReduce(address(data), address(data), 100, FLOAT32, 0, lonely, stream) == 0
    deadline = time.monotonic() + 20
    while fake_cuda.async_error(fake, lonely) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_cuda.async_error(fake, lonely) == NCCL_REMOTE_ERROR
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
    waiting, leaving = fake_cuda.communicators(fake, 2)
    stream = new_stream()
    data = np.ones(10, np.float32)
    fake.ncclBroadcast(address(data), address(data), 10, FLOAT32, 1, waiting, stream)
    fake.ncclCommAbort(leaving)
    deadline = time.monotonic() + 10
    while fake_cuda.async_error(fake, waiting) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_cuda.async_error(fake, waiting) == NCCL_REMOTE_ERROR
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
    (comm,) = fake_cuda.communicators(fake, 1)
    assert fake_cuda.async_error(fake, comm) == 0
    fake.fake_fail_comm(comm, 3)
    assert fake_cuda.async_error(fake, comm) == 3
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
    comms = fake_cuda.communicators(fake, 2)
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
    comms = fake_cuda.communicators(fake, 2)
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
    comms = fake_cuda.communicators(fake, 3)
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
