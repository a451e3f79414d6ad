"""The rank program of gpu_check.py: correctness of every dtype and op through commsched, then a size
sweep against raw NCCL. One rank on a real GPU (torch / CuPy arrays), or N ranks under mpiexec on the
fake CUDA/NCCL library of tests/fake_cuda.py (FakeCudaArray objects), where sums cross processes.

Each check computes the expected result on the host from every rank's inputs and compares the
reduced array with it exactly (averages over a rank count that is not a power of two: within one
rounding of the dtype). Rank 0 writes {"correctness": [...], "sweep": [...]} to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import commsched

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8")
FLOATS = ("float16", "bfloat16", "float32", "float64")
PARTITION_BYTES = 256 * 1024
FUSION_BYTES = 4 * 1024 * 1024
TIMEOUT_S = 60.0
# Elements per ordinary check: odd, so no chunk or vector width divides it evenly.
COUNT = 1031
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep before a late write: tens of milliseconds
FAKE_WRITE_DELAY_US = 20_000  # the fake's producer writes this long after it is queued
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
Row = dict[str, Any]
Submit = Callable[[Any], commsched.Handle]


def rank_values(dtype: str, count: int, rank: int, salt: int) -> np.ndarray:
    """What `rank` contributes: small integers, so every sum and power-of-two average is exact in any dtype."""
    values = (np.arange(count, dtype=np.int64) * 7 + rank * 5 + salt * 3) % 11
    if dtype != "uint8":
        values = values - 5
    return values.astype(np.float64 if dtype in FLOATS else np.int64)


def expected(dtype: str, op: str, count: int, size: int, salt: int) -> np.ndarray:
    """The reduction of every rank's rank_values, computed on the host."""
    total = sum(rank_values(dtype, count, r, salt) for r in range(size))
    return total / size if op == "average" else total


def compare(got: np.ndarray, want: np.ndarray, dtype: str, op: str, size: int) -> str:
    """'' when `got` is the reduction, else what differs (first index, values, how many)."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if op == "average" and size & (size - 1):
        wrong = ~np.isclose(got, want, rtol=2 * _EPS[dtype], atol=0)
    else:
        wrong = got != want
    if not wrong.any():
        return ""
    first = int(np.argmax(wrong))
    return f"{int(wrong.sum())} of {want.size} wrong; [{first}] is {got[first].item()!r}, expected {want[first].item()!r}"


# -- arrays on a real GPU ----------------------------------------------------------------------
class TorchKit:
    """CUDA tensors from PyTorch; CuPy (when installed) presents some of them through its array interface."""

    name = "cuda"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.cuda.set_device(0)
        self.dtypes = {d: getattr(torch, d) for d in DTYPES}
        try:
            import cupy
        except ImportError:
            cupy = None
        self.cupy = cupy

    def places(self) -> list[str]:
        """Where the checks produce tensors besides the current stream."""
        places = ["side stream (torch.cuda.Stream)", "per-thread default stream (torch)"]
        if self.cupy is not None:
            places.append("per-thread default stream (CuPy)")
        return places

    def tidy(self) -> None:
        """Nothing to tidy on a real GPU."""

    def _read(self, tensor: Any, dtype: str) -> np.ndarray:
        torch = self.torch
        reader = torch.cuda.Stream()  # non-blocking: it does not wait for other streams implicitly
        with torch.cuda.stream(reader):
            wide = tensor.to(torch.float64 if dtype in FLOATS else torch.int64)
            return wide.cpu().numpy()

    def read_result(self, result: Any, dtype: str) -> np.ndarray:
        """A collective's new tensor (allgather, reducescatter, alltoall) as flat host values."""
        return self._read(result, dtype).ravel()

    def submit_on(self, place: str, values: np.ndarray, dtype: str, submit: Submit) -> tuple[Any, Any]:
        """Puts `values` on the GPU at `place` (late, after a sleep kernel, off the current stream), submits
        it from that stream, and returns (handle, read) where read() gives the host values."""
        torch = self.torch
        source = torch.from_numpy(values).to(self.dtypes[dtype]).cuda()
        if place == "current stream":
            return submit(source), lambda: self._read(source, dtype)
        stream = torch.cuda.Stream() if place.startswith("side") else torch.cuda.ExternalStream(2)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tensor = torch.zeros_like(source)
            torch.cuda._sleep(SLEEP_CYCLES)
            tensor.copy_(source)  # device to device: queued, so it lands long after submit returns
            if place.endswith("(CuPy)"):
                with self.cupy.cuda.Stream.ptds:  # its __cuda_array_interface__ names stream 2
                    handle = submit(self.cupy.asarray(tensor))
            else:
                handle = submit(tensor)
        return handle, lambda: self._read(tensor, dtype)


# -- arrays on the fake library ----------------------------------------------------------------
class FakeKit:
    """FakeCudaArray objects over host memory; late writes are the fake's delayed producer on a stream."""

    name = "fake"

    def __init__(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import fake_cuda

        self.fake_cuda = fake_cuda
        self.array_type = fake_cuda.FakeCudaArray
        self.lib = fake_cuda.declare(ctypes.CDLL(os.environ["COMMSCHED_CUDART_LIBRARY"]))

    def tidy(self) -> None:
        """Empties the fake's call log: it has room for a few hundred calls, and writes past its end after."""
        if hasattr(self.lib, "fake_reset"):
            self.lib.fake_reset()

    def places(self) -> list[str]:
        """Where the checks produce arrays besides the legacy default stream."""
        return ["side stream (cudaStreamCreateWithFlags)", "per-thread default stream (2)"]

    def storage(self, values: np.ndarray, dtype: str) -> np.ndarray:
        """Host bytes of `values` in `dtype` (bfloat16: the top half of float32)."""
        if dtype == "bfloat16":
            return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return values.astype(dtype)

    def values(self, storage: np.ndarray, dtype: str) -> np.ndarray:
        """The inverse of storage(), widened for comparison."""
        if dtype == "bfloat16":
            return (storage.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return storage.astype(np.float64 if dtype in FLOATS else np.int64)

    def array(self, storage: np.ndarray, dtype: str, stream: int | None) -> Any:
        """A FakeCudaArray over `storage`, ready on `stream`."""
        array = self.array_type(storage, stream=stream)
        if dtype == "bfloat16":
            array.__cuda_array_interface__["typestr"] = "<V2"
        return array

    def submit_on(self, place: str, values: np.ndarray, dtype: str, submit: Submit) -> tuple[Any, Any]:
        """Writes `values` into fake device memory on `place`'s stream, submits, returns (handle, read)."""
        host = self.storage(values, dtype)
        if place == "current stream":
            array = self.array(host, dtype, 1)
            return submit(array), lambda: self.values(array.host, dtype)
        if place.startswith("side"):
            handle = ctypes.c_void_p()
            self._check(
                self.lib.cudaStreamCreateWithFlags(ctypes.byref(handle), 1), "cudaStreamCreateWithFlags"
            )
            stream = int(handle.value or 0)
        else:
            stream = 2
        device = np.zeros_like(host)
        # A producer "kernel" on that stream that writes the values only after FAKE_WRITE_DELAY_US.
        self.fake_cuda.launch_write(self.lib, stream, device, host, FAKE_WRITE_DELAY_US)
        array = self.array(device, dtype, stream)
        return submit(array), lambda: self.values(array.host, dtype)

    def read_result(self, result: Any, dtype: str) -> np.ndarray:
        """A collective's new array (its bytes in the fake's host-visible device memory) as flat values."""
        interface = result.__cuda_array_interface__
        count = int(np.prod(interface["shape"]))
        storage = np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
        raw = (ctypes.c_char * (count * storage.itemsize)).from_address(interface["data"][0])
        return self.values(np.frombuffer(raw, dtype=storage).copy(), dtype)

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"fake {call} returned {status}")


# -- the checks ----------------------------------------------------------------------------------
class Checks:
    """Runs each correctness check on this rank; rows say what was checked and how it went here."""

    def __init__(self, kit: Any, rank: int, size: int, corrupt_rank: int | None) -> None:
        self.kit, self.rank, self.size, self.corrupt_rank = kit, rank, size, corrupt_rank
        self.rows: list[Row] = []
        self._salt = 0

    def _inputs(self, dtype: str, count: int) -> tuple[np.ndarray, int]:
        """This rank's inputs (plus one on --corrupt-rank, after the reference is fixed) and their salt."""
        self._salt += 1
        values = rank_values(dtype, count, self.rank, self._salt)
        if self.rank == self.corrupt_rank:
            values = values + 1
        return values, self._salt

    def _row(self, check: str, dtype: str, op: str, count: int, place: str, run: Callable[[], str]) -> None:
        self.kit.tidy()
        try:
            problem = run()
        except Exception as error:  # noqa: BLE001 -- a failing check is a row, not the end of the run
            problem = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        row = {"check": check, "dtype": dtype, "op": op, "elements": count, "place": place}
        self.rows.append({**row, "ranks": self.size, "passed": problem == "", "detail": problem})

    def reduce(self, check: str, dtype: str, op: str, count: int, place: str = "current stream") -> None:
        """One allreduce of `count` elements produced at `place`, compared with the host reference."""

        def run() -> str:
            values, salt = self._inputs(dtype, count)
            name = f"check.{len(self.rows)}"
            handle, read = self.kit.submit_on(
                place, values, dtype, lambda a: commsched.allreduce_async(a, name=name, op=op)
            )
            handle.wait(TIMEOUT_S)
            return compare(read(), expected(dtype, op, count, self.size, salt), dtype, op, self.size)

        self._row(check, dtype, op, count, place, run)

    def partitioned(self) -> None:
        """A float32 tensor four partitions long: values, and at least one launch per partition."""
        count = 4 * PARTITION_BYTES // 4 - 13

        def run() -> str:
            before = commsched.stats()["launches"]
            values, salt = self._inputs("float32", count)
            name = f"check.{len(self.rows)}"
            handle, read = self.kit.submit_on(
                "current stream", values, "float32", lambda a: commsched.allreduce_async(a, name=name)
            )
            handle.wait(TIMEOUT_S)
            problem = compare(
                read(), expected("float32", "sum", count, self.size, salt), "float32", "sum", self.size
            )
            launches = commsched.stats()["launches"] - before
            chunks = math.ceil(count * 4 / PARTITION_BYTES)
            if not problem and launches < chunks:
                problem = f"{launches} launches for {chunks} partitions"
            return problem

        self._row(
            f"partitioned ({PARTITION_BYTES // 1024} KiB partitions)",
            "float32",
            "sum",
            count,
            "current stream",
            run,
        )

    def fused(self, tensors: int = 48, count: int = 97) -> None:
        """Many small tensors agreed together: values, and at least one fused launch.

        They go as one group, so every rank agrees them in one round whatever the host's load;
        submitted one by one, a slow submitter lets each round agree a single tensor.
        """

        def run() -> str:
            before = commsched.stats()["fused_launches"]
            arrays, reads, salts = [], [], []
            for _ in range(tensors):
                values, salt = self._inputs("float32", count)
                array, read = self.kit.submit_on("current stream", values, "float32", lambda a: a)
                arrays.append(array)
                reads.append(read)
                salts.append(salt)
            commsched.grouped_allreduce_async(arrays, name=f"check.{len(self.rows)}").wait(TIMEOUT_S)
            problems = [
                compare(
                    read(), expected("float32", "sum", count, self.size, salt), "float32", "sum", self.size
                )
                for read, salt in zip(reads, salts)
            ]
            wrong = [p for p in problems if p]
            if wrong:
                return f"{len(wrong)} of {tensors} tensors wrong: {wrong[0]}"
            fused = commsched.stats()["fused_launches"] - before
            if fused <= 0:
                fusion = commsched.config()["fusion_bytes"]
                return f"values right, but no fused launch (stats fused_launches +0; fusion_bytes={fusion})"
            return ""

        self._row(f"fused ({tensors} tensors)", "float32", "sum", count, "current stream", run)

    def scaled_or_min_max(self, dtype: str, op: str, prescale: float, postscale: float) -> None:
        """An allreduce with op min, max or product, or a sum with scale factors, against the host."""

        def run() -> str:
            values, salt = self._inputs(dtype, COUNT)
            everyone = [rank_values(dtype, COUNT, r, salt) for r in range(self.size)]
            if op == "min":
                want = np.minimum.reduce(everyone)
            elif op == "max":
                want = np.maximum.reduce(everyone)
            elif op == "product":
                want = np.multiply.reduce(everyone)
            else:
                want = sum(everyone) * prescale * postscale
            name = f"check.{len(self.rows)}"
            handle, read = self.kit.submit_on(
                "current stream",
                values,
                dtype,
                lambda a: commsched.allreduce_async(
                    a, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale
                ),
            )
            handle.wait(TIMEOUT_S)
            return compare(read(), want, dtype, op, self.size)

        label = op if prescale == postscale == 1.0 else f"{op} x{prescale} x{postscale}"
        self._row("allreduce", dtype, label, COUNT, "current stream", run)

    def with_output(self, kind: str, dtype: str) -> None:
        """Uneven allgather, Horovod's uneven reducescatter, or alltoall with splits, against the host."""
        row = 2
        ranks = self.size

        def run() -> str:
            self._salt += 1
            salt = self._salt
            if kind == "allgather":
                counts = [(r + 1) * row for r in range(ranks)]
            elif kind == "reducescatter":
                # Flat arrays split by elements: an odd count gives the first ranks one more.
                counts = [2 * ranks + 1] * ranks
            else:
                splits = [[(source + target) % 2 + 1 for target in range(ranks)] for source in range(ranks)]
                counts = [sum(split) * row for split in splits]
            everyone = [rank_values(dtype, counts[r], r, salt) for r in range(ranks)]
            values = everyone[self.rank] + (1 if self.rank == self.corrupt_rank else 0)
            name = f"check.{len(self.rows)}"
            if kind == "allgather":
                want = np.concatenate(everyone)
                submit = lambda a: commsched.allgather_async(a, name=name)
            elif kind == "reducescatter":
                rows = 2 * ranks + 1
                mine = [rows // ranks + (1 if r < rows % ranks else 0) for r in range(ranks)]
                start = sum(mine[: self.rank])
                want = sum(everyone)[start : start + mine[self.rank]]
                submit = lambda a: commsched.reducescatter_async(a, name=name)
            else:
                pieces = []
                for source in range(ranks):
                    offsets = np.cumsum([0, *splits[source]]) * row
                    pieces.append(everyone[source][offsets[self.rank] : offsets[self.rank + 1]])
                want = np.concatenate(pieces)
                submit = lambda a: commsched.alltoall_async(
                    a, splits=[s * row for s in splits[self.rank]], name=name
                )
            handle, _ = self.kit.submit_on("current stream", values, dtype, submit)
            result = handle.wait(TIMEOUT_S)
            if kind == "alltoall":
                result = result[0]
            return compare(self.kit.read_result(result, dtype), want, dtype, "sum", self.size)

        self._row(kind, dtype, "sum", 0, "current stream", run)

    def more_collectives(self) -> None:
        """min/max/product, scale factors, and the collectives with a new output, for every dtype."""
        for dtype in DTYPES:
            for op in ("min", "max", "product"):
                self.scaled_or_min_max(dtype, op, 1.0, 1.0)
            if dtype in FLOATS:
                self.scaled_or_min_max(dtype, "sum", 0.5, 4.0)
            else:
                self.scaled_or_min_max(dtype, "sum", 3.0, 2.0)
            for kind in ("allgather", "reducescatter", "alltoall"):
                self.with_output(kind, dtype)

    def run_all(self) -> list[Row]:
        """Every dtype and op, partitioned, fused, and each stream place."""
        for dtype in DTYPES:
            for op in ("sum", "average") if dtype in FLOATS else ("sum",):
                self.reduce("allreduce", dtype, op, COUNT)
        self.partitioned()
        self.fused()
        self.more_collectives()
        for place in self.kit.places():
            self.reduce("late write", "float32", "sum", 1 << 20, place)
            # CuPy has no bfloat16: its half-precision check is float16.
            half = "float16" if place.endswith("(CuPy)") else "bfloat16"
            self.reduce("late write", half, "average", COUNT, place)
        return self.rows


# -- the size sweep ------------------------------------------------------------------------------
def _iterations(nbytes: int, fake: bool) -> int:
    budget = 5e7 if fake else 2e9  # bytes moved per size and path
    return max(3, min(50 if fake else 200, int(budget / max(nbytes, 1 << 16))))


def _time(run: Callable[[], None], iterations: int, tidy: Callable[[], None]) -> float:
    """Seconds per run() after three warm-up runs; tidy() (the fake's log) goes before each."""
    for _ in range(3):
        tidy()
        run()
    started = time.perf_counter()
    for _ in range(iterations):
        tidy()
        run()
    return (time.perf_counter() - started) / iterations


class _TorchRaw:
    """Raw NCCL on the same GPU: torch.distributed's NCCL backend, world size 1 (CuPy's NCCL as fallback)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        try:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            self.name, self._dist = "torch.distributed nccl", dist
        except Exception:  # noqa: BLE001 -- no NCCL backend in this torch build: CuPy's NCCL instead
            from cupy.cuda import nccl

            self.name, self._dist = "cupy.cuda.nccl", None
            self._nccl = nccl
            self._comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)

    def array(self, count: int) -> Any:
        """A float32 device array of `count` elements."""
        return self.torch.ones(count, dtype=self.torch.float32, device="cuda")

    def allreduce(self, tensor: Any) -> None:
        """One allreduce, complete on the GPU when this returns."""
        if self._dist is not None:
            self._dist.all_reduce(tensor)
        else:
            stream = self.torch.cuda.current_stream().cuda_stream
            self._comm.allReduce(
                tensor.data_ptr(),
                tensor.data_ptr(),
                tensor.numel(),
                self._nccl.NCCL_FLOAT32,
                self._nccl.NCCL_SUM,
                stream,
            )
        self.torch.cuda.synchronize()

    def close(self) -> None:
        """Tears the raw communicator down."""
        if self._dist is not None:
            self._dist.destroy_process_group()


class _FakeRaw:
    """The fake library's own ncclAllReduce on a communicator of all ranks, called through ctypes."""

    name = "fake ncclAllReduce"

    def __init__(self, kit: FakeKit, rank: int, size: int) -> None:
        lib, fake = kit.lib, kit.fake_cuda
        self._lib, self._kit = lib, kit
        lib.cudaSetDevice(commsched.local_rank())  # the device commsched uses too
        unique = fake.unique_id(lib) if rank == 0 else b""
        if size > 1:
            from mpi4py import MPI

            unique = MPI.COMM_WORLD.bcast(unique, root=0)
        self._comm = ctypes.c_void_p()
        status = lib.ncclCommInitRank(ctypes.byref(self._comm), size, fake.unique_id_from(unique), rank)
        FakeKit._check(status, "ncclCommInitRank")
        self._stream = ctypes.c_void_p()
        FakeKit._check(
            lib.cudaStreamCreateWithFlags(ctypes.byref(self._stream), 1), "cudaStreamCreateWithFlags"
        )

    def array(self, count: int) -> Any:
        """A float32 FakeCudaArray of `count` elements."""
        return self._kit.array(np.ones(count, np.float32), "float32", 1)

    def allreduce(self, array: Any) -> None:
        """One in-place float32 sum, complete when this returns."""
        address, count = array.host.ctypes.data, array.host.size
        FakeKit._check(
            self._lib.ncclAllReduce(address, address, count, 7, 0, self._comm, self._stream), "ncclAllReduce"
        )
        FakeKit._check(self._lib.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        """Destroys the raw communicator and its stream."""
        self._lib.ncclCommDestroy(self._comm)
        self._lib.cudaStreamDestroy(self._stream)


def sweep(kit: Any, raw: Any, largest: int, fake: bool) -> list[Row]:
    """Seconds per float32 allreduce through commsched and through raw NCCL, 4 B to `largest`, x4 steps."""
    rows: list[Row] = []
    nbytes = 4
    while nbytes <= largest:
        count = nbytes // 4
        iterations = _iterations(nbytes, fake)
        ours = partial(commsched.allreduce, raw.array(count), name=f"sweep.{nbytes}", timeout=TIMEOUT_S)
        scheduled = _time(ours, iterations, kit.tidy)
        direct = _time(partial(raw.allreduce, raw.array(count)), iterations, kit.tidy)
        rows.append(
            {
                "bytes": nbytes,
                "iterations": iterations,
                "commsched_us": scheduled * 1e6,
                "raw_us": direct * 1e6,
                "ratio": scheduled / direct if direct > 0 else None,
                "raw": raw.name,
            }
        )
        nbytes *= 4
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fake", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--largest", type=int, default=256 << 20, help="largest sweep size in bytes")
    parser.add_argument("--corrupt-rank", type=int, default=None)
    args = parser.parse_args()
    kit: Any = FakeKit() if args.fake else TorchKit()
    commsched.init(
        device="cuda", partition_bytes=PARTITION_BYTES, fusion_bytes=FUSION_BYTES, stall_timeout=30
    )
    rank, size = commsched.rank(), commsched.size()
    rows = Checks(kit, rank, size, args.corrupt_rank).run_all()
    # The checks cut tensors into small partitions on purpose; the sweep times what a user gets,
    # the defaults (at one rank: no partitions, there is no link to cut for).
    commsched.shutdown()
    commsched.init(device="cuda", stall_timeout=30)
    settings = {k: commsched.config()[k] for k in ("partition_bytes", "credit_bytes", "fusion_bytes")}
    raw: Any = _FakeRaw(kit, rank, size) if args.fake else _TorchRaw()
    timings = [{**row, "settings": settings} for row in sweep(kit, raw, args.largest, args.fake)]
    raw.close()
    commsched.shutdown()
    if size > 1:
        from mpi4py import MPI

        every = MPI.COMM_WORLD.gather(rows, root=0)
        if rank != 0:
            return 0
        rows = merge(every)
    Path(args.out).write_text(json.dumps({"correctness": rows, "sweep": timings}, indent=1))
    return 0


def merge(every: list[list[Row]]) -> list[Row]:
    """One row per check: passed only where every rank passed; the detail names the first failing rank."""
    merged = []
    for per_rank in zip(*every):
        row = dict(per_rank[0])
        failing = [(r, x) for r, x in enumerate(per_rank) if not x["passed"]]
        row["passed"] = not failing
        row["detail"] = f"rank {failing[0][0]}: {failing[0][1]['detail']}" if failing else ""
        merged.append(row)
    return merged


if __name__ == "__main__":
    sys.exit(main())
