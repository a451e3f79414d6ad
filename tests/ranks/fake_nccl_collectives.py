"""One rank of tests/test_fake_cuda.py's collective checks, started as a plain process (no MPI): runs every
collective for every dtype and op through the fake NCCL on one stream, synchronizes once, and saves each
case's input and result to OUT/rank<R>.npz for the parent to compare against numpy.

usage: fake_nccl_collectives.py LIBRARY ID_HEX NRANKS RANK OUT COUNT DTYPE...
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_cuda


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype for an NCCL type name; bfloat16 comes from ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def values(rng: np.random.Generator, dtype: np.dtype, count: int) -> np.ndarray:
    """Integers over the whole range (sums and products wrap), floats with every mantissa bit in use."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    return rng.uniform(-8, 8, count).astype(dtype)


def bits(array: np.ndarray) -> np.ndarray:
    """The array's raw bytes as unsigned integers (npz cannot hold ml_dtypes' bfloat16)."""
    return array.view(f"u{array.dtype.itemsize}")


def main() -> None:
    library, id_hex, nranks, rank, out, count = sys.argv[1:7]
    dtypes, nranks, rank, count = sys.argv[7:], int(nranks), int(rank), int(count)
    lib = fake_cuda.load(Path(library))
    comm, stream = ctypes.c_void_p(), ctypes.c_void_p()
    result = lib.ncclCommInitRank(
        ctypes.byref(comm), nranks, fake_cuda.unique_id_from(bytes.fromhex(id_hex)), rank
    )
    assert result == 0, f"rank {rank}: ncclCommInitRank returned {result}"
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    rng = np.random.default_rng(1000 + rank)
    cases: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (input, result), kept alive until synced
    address = fake_cuda.address

    def check(code: int, what: str) -> None:
        assert code == 0, f"rank {rank}: {what} returned {code}"

    for name in dtypes:
        dtype, code = numpy_dtype(name), fake_cuda.NCCL_DTYPES[name]
        for op, op_code in fake_cuda.NCCL_OPS.items():
            data = values(rng, dtype, count)
            cases[f"allreduce_inplace__{name}__{op}"] = (data.copy(), data)
            check(
                lib.ncclAllReduce(address(data), address(data), count, code, op_code, comm, stream),
                "allreduce",
            )
            send, recv = values(rng, dtype, count), np.zeros(count, dtype)
            cases[f"allreduce__{name}__{op}"] = (send, recv)
            check(
                lib.ncclAllReduce(address(send), address(recv), count, code, op_code, comm, stream),
                "allreduce",
            )
            send, recv = values(rng, dtype, count * nranks), np.zeros(count, dtype)
            cases[f"reducescatter__{name}__{op}"] = (send, recv)
            check(
                lib.ncclReduceScatter(address(send), address(recv), count, code, op_code, comm, stream),
                "reducescatter",
            )
        for root in sorted({0, nranks - 1}):
            data = values(rng, dtype, count)
            cases[f"broadcast__{name}__{root}"] = (data.copy(), data)  # in place
            check(
                lib.ncclBroadcast(address(data), address(data), count, code, root, comm, stream), "broadcast"
            )
        send, recv = values(rng, dtype, count), np.zeros(count * nranks, dtype)
        cases[f"allgather__{name}__none"] = (send, recv)
        check(lib.ncclAllGather(address(send), address(recv), count, code, comm, stream), "allgather")
        # alltoall as NCCL users write it: a group of one send and one receive per peer, self included
        send, recv = values(rng, dtype, count * nranks), np.zeros(count * nranks, dtype)
        cases[f"alltoall__{name}__none"] = (send, recv)
        check(lib.ncclGroupStart(), "ncclGroupStart")
        for peer in range(nranks):
            part = peer * count * dtype.itemsize
            check(lib.ncclSend(address(send) + part, count, code, peer, comm, stream), "send")
            check(lib.ncclRecv(address(recv) + part, count, code, peer, comm, stream), "recv")
        check(lib.ncclGroupEnd(), "ncclGroupEnd")
    check(lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
    error = ctypes.c_int(-1)
    check(lib.ncclCommGetAsyncError(comm, ctypes.byref(error)), "ncclCommGetAsyncError")
    assert error.value == 0, f"rank {rank}: async error {error.value}"
    check(lib.ncclCommDestroy(comm), "ncclCommDestroy")
    check(lib.cudaStreamDestroy(stream), "cudaStreamDestroy")
    saved = {f"{case}__in": bits(pair[0]) for case, pair in cases.items()}
    saved.update({f"{case}__out": bits(pair[1]) for case, pair in cases.items()})
    np.savez(Path(out) / f"rank{rank}.npz", **saved)


if __name__ == "__main__":
    main()
