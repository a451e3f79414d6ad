"""Device-memory collectives through the core and the NCCL (or CUDA-aware MPI) transport, over the fake
CUDA/NCCL library.

Run under mpiexec with COMMSCHED_NCCL_LIBRARY / COMMSCHED_CUDART_LIBRARY pointing at the fake. The
fake runs stream work on worker threads and reduces across the real ranks, so a collective that
does not wait for its producer, or a fused copy that runs out of order, shows as a wrong number.
Every result is checked exactly against numpy. Prints "DEVICE OK <case>" per passing case.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_cuda import FakeCudaArray

import commsched

SIDE_STREAM = 0x5EED  # a producer's stream the fake has never seen: it gets a worker of its own
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8]


def rank_values(dtype: type, count: int, rank: int, salt: int) -> np.ndarray:
    """Small values that no dtype overflows when summed over a few ranks, distinct per rank and tensor."""
    values = (np.arange(count) * 7 + rank * 13 + salt) % 23
    return values.astype(dtype)


def expected_sum(dtype: type, count: int, size: int, salt: int) -> np.ndarray:
    """The sum over ranks, computed on the host in a wide type and cast back."""
    total = sum(rank_values(np.int64, count, r, salt) for r in range(size))
    return total.astype(dtype)


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Raises naming the tensor when the result differs from the reference."""
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(
            f"{name}: {bad.size} wrong elements, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
        )


def mixed_tensors(policy: str, size: int, rank: int) -> None:
    """Many tensors of every dtype and size, some cut into chunks and some fused, in a shuffled order."""
    rng = np.random.default_rng(17)  # the same sizes on every rank
    specs = [(DTYPES[i % len(DTYPES)], int(rng.choice([1, 3, 64, 500, 3000, 40_000]))) for i in range(60)]
    arrays = []
    for index, (dtype, count) in enumerate(specs):
        # Odd ones say the per-thread default stream produced them: an event is recorded and waited on.
        stream = 2 if index % 2 else None
        arrays.append(FakeCudaArray(rank_values(dtype, count, rank, index), stream=stream))
    order = np.random.default_rng(rank).permutation(len(specs))  # each rank submits in its own order
    handles = {}
    for index in order:
        dtype, count = specs[index]
        handles[index] = commsched.allreduce_async(
            arrays[index], name=f"{policy}.t{index}", priority=int(index)
        )
    for index, handle in handles.items():
        handle.wait(60)
        dtype, count = specs[index]
        check(f"{policy}.t{index}", arrays[index].host, expected_sum(dtype, count, size, index))
    print(f"DEVICE OK mixed {policy}", flush=True)


def average_and_broadcast(size: int, rank: int) -> None:
    """op="average" runs as ncclAvg (fused and partitioned alike); broadcasts take the root's bytes."""
    floats = [FakeCudaArray(rank_values(np.float64, n, rank, n), stream=None) for n in (5, 7, 20_000)]
    handles = [commsched.allreduce_async(a, name=f"avg{i}", op="average") for i, a in enumerate(floats)]
    for handle, array, n in zip(handles, floats, (5, 7, 20_000)):
        handle.wait(60)
        want = sum(rank_values(np.float64, n, r, n) for r in range(size)) / size
        check(handle.name, array.host, want)
    root = size - 1
    sent = [FakeCudaArray(rank_values(np.int32, n, rank, 1), stream=None) for n in (9, 11, 30_000)]
    handles = [commsched.broadcast_async(a, root=root, name=f"bcast{i}") for i, a in enumerate(sent)]
    for handle, array, n in zip(handles, sent, (9, 11, 30_000)):
        handle.wait(60)
        check(handle.name, array.host, rank_values(np.int32, n, root, 1))
    print("DEVICE OK average-broadcast", flush=True)


def late_producer(size: int, rank: int, library: ctypes.CDLL, delay_us: int) -> None:
    """A producer writes the gradient late on a side stream; submitted at once, the collective must wait.

    Without the wait on the submit-time event the collective would sum the zeros there before the
    write, and the result would be wrong. Both an unfused (partitioned) and a fused tensor are checked.
    """
    library.fake_launch_write.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint,
    ]
    cases = [("late.big", 50_000)] + [(f"late.small{i}", 16 + i) for i in range(4)]
    sources, targets, handles = [], [], []
    for name, count in cases:
        source = rank_values(np.float32, count, rank, 3)
        target = FakeCudaArray(np.zeros(count, np.float32), stream=SIDE_STREAM)
        library.fake_launch_write(
            SIDE_STREAM, target.host.ctypes.data, source.ctypes.data, source.nbytes, delay_us
        )
        handles.append(commsched.allreduce_async(target, name=name))
        sources.append(source)
        targets.append(target)
    for handle, target, (name, count) in zip(handles, targets, cases):
        handle.wait(60)
        check(name, target.host, expected_sum(np.float32, count, size, 3))
    # The late tensor holds the credit, so the small ones queue behind it and share launches,
    # whatever the host's timing (with nothing holding them, each may go out in its own round).
    stats = commsched.stats()
    assert stats["fused_launches"] > 0 and stats["launches"] < stats["chunks"], stats
    print(f"DEVICE OK late-producer fused={stats['fused_launches']}", flush=True)


def refusal_reaches_every_rank(size: int, rank: int) -> None:
    """A tensor the device transport refuses on one rank (on another GPU there) fails on every rank at
    once, naming that rank, instead of leaving the others waiting for it."""
    wrong = rank == size - 1
    array = FakeCudaArray(np.ones(8, np.float32), stream=None, device_id=3 if wrong else None)
    if wrong:
        try:
            commsched.allreduce_async(array, name="elsewhere")
        except ValueError as error:
            assert "cuda:3" in str(error), error
        else:
            raise AssertionError("a tensor on another GPU was accepted")
    else:
        handle = commsched.allreduce_async(array, name="elsewhere")
        try:
            handle.wait(20)  # far below COMMSCHED_STALL_SHUTDOWN
        except commsched.CollectiveError as error:
            assert error.rank == size - 1 and "cuda:3" in str(error), error
        else:
            raise AssertionError("the other ranks' collective did not fail")
    # The refusing rank is done at once; without this it could shut down (the next step under
    # --transport mpi) before a slower rank submitted 'elsewhere', which then finds commsched stopped.
    commsched.barrier()
    print("DEVICE OK refusal", flush=True)


def device_host(result: object, dtype: type) -> np.ndarray:
    """A device result's bytes, read on the host (the fake's device memory is host memory)."""
    interface = result.__cuda_array_interface__  # type: ignore[attr-defined]
    count = int(np.prod(interface["shape"]))
    raw = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(interface["data"][0])
    return np.frombuffer(raw, dtype=dtype).reshape(interface["shape"]).copy()


def reductions(size: int, rank: int) -> None:
    """min, max and product (bool as and/or), prescale/postscale of sums and averages, fused (small)
    and partitioned (large), all submitted before any is waited for."""
    cases = []
    for count in (5, 9, 20_000):
        for dtype in (np.int32, np.float64, np.int8):
            for op in ("min", "max", "product"):
                values = rank_values(dtype, count, rank, count) % 3 + 1 if op == "product" else None
                cases.append((f"{op}.{np.dtype(dtype).name}.{count}", dtype, count, op, values, 1.0, 1.0))
        cases.append((f"bool.min.{count}", np.bool_, count, "min", None, 1.0, 1.0))
        cases.append((f"bool.max.{count}", np.bool_, count, "max", None, 1.0, 1.0))
        cases.append((f"bool.product.{count}", np.bool_, count, "product", None, 1.0, 1.0))
        cases.append((f"scaled.sum.f32.{count}", np.float32, count, "sum", None, 0.5, 4.0))
        cases.append((f"scaled.avg.f64.{count}", np.float64, count, "average", None, 2.0, 0.25))
        cases.append((f"scaled.sum.f16.{count}", np.float16, count, "sum", None, 0.5, 2.0))
        cases.append((f"scaled.sum.i64.{count}", np.int64, count, "sum", None, 3.0, 2.0))
    arrays, inputs, handles = [], [], []
    for salt, (name, dtype, count, op, values, pre, post) in enumerate(cases):
        per_rank = []
        for r in range(size):
            if dtype is np.bool_:
                per_rank.append(((np.arange(count) + r + salt) % (size + 1)) != 0)
            elif op == "product":
                per_rank.append((rank_values(dtype, count, r, salt) % 3 + 1).astype(dtype))
            else:
                per_rank.append(rank_values(dtype, count, r, salt))
        inputs.append(per_rank)
        arrays.append(FakeCudaArray(per_rank[rank].copy(), stream=2))
        handles.append(
            commsched.allreduce_async(
                arrays[-1], name=name, op=op, prescale_factor=pre, postscale_factor=post
            )
        )
    for handle, array, per_rank, (name, dtype, count, op, _, pre, post) in zip(
        handles, arrays, inputs, cases
    ):
        handle.wait(60)
        if op in ("min", "max"):
            want = np.minimum.reduce(per_rank) if op == "min" else np.maximum.reduce(per_rank)
            check(name, array.host, want.astype(dtype))
        elif op == "product":
            want = np.ones(count, np.int64) if dtype is not np.bool_ else np.ones(count, bool)
            for part in per_rank:
                want = want & part if dtype is np.bool_ else want * part.astype(np.int64)
            check(name, array.host, want.astype(dtype))
        else:
            total = sum(part.astype(np.float64) for part in per_rank) * pre * post
            total = total / size if op == "average" else total
            if np.dtype(dtype).kind == "i":
                check(name, array.host, total.astype(dtype))
            elif not np.allclose(array.host.astype(np.float64), total, rtol=1e-3, atol=1e-3):
                raise AssertionError(f"{name}: {array.host[:5]} != {total[:5]}")
    print("DEVICE OK reductions", flush=True)


def output_collectives(size: int, rank: int) -> None:
    """allgather (even and uneven rows), reducescatter (even and Horovod's uneven split, sum, average and
    scaled), alltoall with splits, a barrier and a grouped allreduce, every result against numpy."""
    row = 3
    gathers = {
        "gather.even": [rank_values(np.float32, 4 * row, r, 5).reshape(4, row) for r in range(size)],
        "gather.uneven": [
            rank_values(np.int64, (r + 1) * row, r, 6).reshape(r + 1, row) for r in range(size)
        ],
        "gather.empty": [rank_values(np.int32, r * 700, r, 7).reshape(r, 700) for r in range(size)],
    }
    handles = {
        name: commsched.allgather_async(FakeCudaArray(parts[rank].copy(), stream=2), name=name)
        for name, parts in gathers.items()
    }
    scatters = {  # rows per input: size * 2 splits evenly, size * 2 + 1 leaves the first ranks a row more
        "scatter.even.sum": (size * 2, "sum", 1.0, 1.0, np.float64),
        "scatter.uneven.sum": (size * 2 + 1, "sum", 1.0, 1.0, np.int32),
        "scatter.uneven.avg": (size * 2 + 1, "average", 1.0, 1.0, np.float64),
        "scatter.even.scaled": (size * 2, "sum", 0.5, 3.0, np.float32),
    }
    scatter_inputs = {
        name: [rank_values(dtype, rows * row, r, len(name)).reshape(rows, row) for r in range(size)]
        for name, (rows, _, _, _, dtype) in scatters.items()
    }
    for name, (rows, op, pre, post, dtype) in scatters.items():
        handles[name] = commsched.reducescatter_async(
            FakeCudaArray(scatter_inputs[name][rank].copy(), stream=2),
            name=name,
            op=op,
            prescale_factor=pre,
            postscale_factor=post,
        )
    splits = [[(source + target) % 3 for target in range(size)] for source in range(size)]
    sent = [rank_values(np.float32, sum(splits[r]) * row, r, 9).reshape(-1, row) for r in range(size)]
    handles["alltoall"] = commsched.alltoall_async(
        FakeCudaArray(sent[rank].copy(), stream=2), splits=splits[rank], name="alltoall"
    )
    for name, parts in gathers.items():
        got = device_host(handles[name].wait(60), parts[0].dtype)
        check(name, got, np.concatenate(parts))
    for name, (rows, op, pre, post, dtype) in scatters.items():
        mine = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(mine[:rank])
        total = sum(x.astype(np.float64) for x in scatter_inputs[name]) * pre * post
        want = (total / size if op == "average" else total)[start : start + mine[rank]]
        got = device_host(handles[name].wait(60), dtype)
        if np.dtype(dtype).kind == "i":
            check(name, got, want.astype(dtype))
        elif got.shape != want.shape or not np.allclose(got, want, rtol=1e-5):
            raise AssertionError(f"{name}: {got.ravel()[:5]} != {want.ravel()[:5]}")
    result, received = handles["alltoall"].wait(60)
    pieces = []
    for source in range(size):
        offsets = np.cumsum([0, *splits[source]])
        pieces.append(sent[source][offsets[rank] : offsets[rank + 1]])
    check("alltoall", device_host(result, np.float32), np.concatenate(pieces))
    assert received == [splits[source][rank] for source in range(size)], received
    commsched.barrier(timeout=60)
    members = [FakeCudaArray(rank_values(np.float32, n, rank, n), stream=2) for n in (4, 50_000)]
    group = commsched.grouped_allreduce_async(members, name="grouped", op="max")
    group.wait(60)
    for array, n in zip(members, (4, 50_000)):
        check(
            "grouped", array.host, np.maximum.reduce([rank_values(np.float32, n, r, n) for r in range(size)])
        )
    print("DEVICE OK output-collectives", flush=True)


def main() -> None:
    """Runs the cases named on the command line on this rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay-us", type=int, default=200_000)
    parser.add_argument("--transport", default="nccl", help="nccl, or mpi for a CUDA-aware MPI")
    args = parser.parse_args()
    library = ctypes.CDLL(os.environ["COMMSCHED_CUDART_LIBRARY"])
    for policy in ("priority", "fifo"):
        commsched.init(
            device="cuda",
            transport=args.transport,
            policy=policy,
            partition_bytes="16KiB",
            fusion_bytes="64KiB",
        )
        size, rank = commsched.size(), commsched.rank()
        mixed_tensors(policy, size, rank)
        if policy == "priority":
            average_and_broadcast(size, rank)
            late_producer(size, rank, library, args.delay_us)
            refusal_reaches_every_rank(size, rank)
            if args.transport == "nccl":
                reductions(size, rank)
                output_collectives(size, rank)
        commsched.shutdown()
    print("DEVICE ALL OK", flush=True)


if __name__ == "__main__":
    main()
