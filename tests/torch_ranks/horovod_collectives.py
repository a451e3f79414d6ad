"""Rank script: `import commsched.torch as hvd` collectives, sync and async, against torch references.

Every rank builds every rank's input from (rank, salt), so each result is checked against a
reference computed locally in another way (torch ops on the stacked inputs). Runs under
mpiexec or torchrun; prints "PASS <check>" per check and "FAIL <check> ..." on a mismatch.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import commsched.torch as hvd
import torch

import commsched

INTEGERS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALL = [*INTEGERS, *FLOATS, torch.bool]
failures = 0


def check(label: str, test: Callable[[], None]) -> None:
    """Runs one check; prints PASS or FAIL with the reason."""
    global failures
    try:
        test()
    except Exception as error:  # noqa: BLE001 - every failure is reported, then the run goes on
        failures += 1
        print(f"FAIL {label}: {error!r}\n{traceback.format_exc()}", flush=True)
    else:
        print(f"PASS {label}", flush=True)


def values(dtype: torch.dtype, rows: int, rank: int, salt: int, columns: int = 3) -> torch.Tensor:
    """Small exact values for `rank`: sums and products of a few stay exact in every dtype."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, columns), generator=generator).bool()
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (rows, columns), generator=generator).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, tolerance: float = 0.0) -> None:
    """Asserts equal dtype, shape and values (within `tolerance` for floats)."""
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.dtype == torch.bool or tolerance == 0.0:
        assert torch.equal(got, want), f"{got} != {want}"
    else:
        assert torch.allclose(got.double(), want.double(), rtol=tolerance, atol=tolerance), f"{got} != {want}"


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of every rank's input, computed in float64 (or logically for bool)."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(inputs)
        return stacked.any(0) if op == "max" else stacked.all(0)
    stacked = torch.stack([t.double() for t in inputs])
    if op == "sum":
        result = stacked.sum(0)
    elif op == "average":
        result = stacked.sum(0) / len(inputs)
        if not dtype.is_floating_point:
            result = torch.trunc(result)  # Horovod scales integers by 1/size and casts: toward zero
    elif op == "min":
        result = stacked.min(0).values
    elif op == "max":
        result = stacked.max(0).values
    else:
        result = stacked.prod(0)
    return result.to(dtype)


def tolerance(dtype: torch.dtype) -> float:
    """What a 3-rank float average may differ from the float64 reference."""
    return {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)


def main() -> int:
    hvd.init()
    hvd.init()  # a second init() does nothing, as in Horovod
    rank, size = hvd.rank(), hvd.size()
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}

    def allreduce_every_dtype() -> None:
        for salt, dtype in enumerate(ALL):
            for label, op in ops.items():
                if dtype == torch.bool and label not in ("min", "max", "product"):
                    continue
                if dtype == torch.uint8 and label == "product":
                    continue  # no negative values, but keep products of uint8 out of overflow worries
                inputs = [values(dtype, 4, r, salt) for r in range(size)]
                mine = inputs[rank].clone()
                got = hvd.allreduce(mine, name=f"every.{dtype}.{label}", op=op)
                same(got, reference(inputs, label), tolerance(dtype) if label == "average" else 0.0)
                assert torch.equal(mine, inputs[rank]), "allreduce changed its input"

    def allreduce_forms() -> None:
        inputs = [values(torch.float32, 5, r, 40) for r in range(size)]
        want = reference(inputs, "sum")
        handle = hvd.allreduce_async(inputs[rank].clone(), name="async", op=hvd.Sum)
        same(hvd.synchronize(handle), want)
        assert hvd.poll(handle)
        in_place = inputs[rank].clone()
        handle = hvd.allreduce_async_(in_place, name="async_", op=hvd.Sum)
        hvd.synchronize(handle)
        same(in_place, want)
        in_place = inputs[rank].clone()
        assert hvd.allreduce_(in_place, op=hvd.Sum) is in_place
        same(in_place, want)
        same(hvd.allreduce(inputs[rank], average=False), want)  # the deprecated argument still works
        scaled = hvd.allreduce(inputs[rank], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
        same(scaled, want * 1.5, 1e-6)
        transposed = inputs[rank].t()  # not contiguous
        same(hvd.allreduce(transposed, op=hvd.Sum), want.t())
        compressed = hvd.allreduce(inputs[rank], op=hvd.Sum, compression=hvd.Compression.fp16)
        same(compressed, want, 1e-3)
        bf16 = hvd.allreduce(inputs[rank].double(), op=hvd.Average, compression=hvd.Compression.bf16)
        same(bf16, (want / size).double(), 2e-2)

    def grouped() -> None:
        inputs = [[values(dtype, 2 + i, r, 50 + i) for i, dtype in enumerate(FLOATS)] for r in range(size)]
        wants = [reference([inputs[r][i] for r in range(size)], "sum") for i in range(len(FLOATS))]
        for got, want in zip(hvd.grouped_allreduce(inputs[rank], op=hvd.Sum), wants):
            same(got, want)
        handle = hvd.grouped_allreduce_async(inputs[rank], name="group", op=hvd.Sum)
        for got, want in zip(hvd.synchronize(handle), wants):
            same(got, want)
        copies = [t.clone() for t in inputs[rank]]
        hvd.grouped_allreduce_(copies, op=hvd.Sum)
        for got, want in zip(copies, wants):
            same(got, want)

    def allgather_every_dtype() -> None:
        for salt, dtype in enumerate(ALL):
            inputs = [values(dtype, r + 1, r, 60 + salt) for r in range(size)]  # uneven first dimension
            same(hvd.allgather(inputs[rank], name=f"gather.{dtype}"), torch.cat(inputs))
        handle = hvd.allgather_async(torch.full((2, 2), rank, dtype=torch.int64))
        same(
            hvd.synchronize(handle),
            torch.cat([torch.full((2, 2), r, dtype=torch.int64) for r in range(size)]),
        )

    def broadcast_every_dtype() -> None:
        root = size - 1
        for salt, dtype in enumerate(ALL):
            inputs = [values(dtype, 3, r, 80 + salt) for r in range(size)]
            mine = inputs[rank].clone()
            same(hvd.broadcast(mine, root_rank=root, name=f"bcast.{dtype}"), inputs[root])
            assert torch.equal(mine, inputs[rank]), "broadcast changed its input"
            hvd.broadcast_(mine, root)
            same(mine, inputs[root])
        handle = hvd.broadcast_async(torch.tensor([float(rank)]), 0)
        same(hvd.synchronize(handle), torch.tensor([0.0]))
        target = torch.tensor([rank + 5])
        hvd.synchronize(hvd.broadcast_async_(target, 0))
        same(target, torch.tensor([5]))

    def reducescatter_forms() -> None:
        rows = 2 * size + 1  # not a multiple of size: the first ranks get one row more
        counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(counts[:rank])
        for dtype, op, label in [
            (torch.float32, hvd.Average, "average"),
            (torch.float64, hvd.Sum, "sum"),
            (torch.int32, hvd.Sum, "sum"),
        ]:
            inputs = [values(dtype, rows, r, 90) for r in range(size)]
            want = reference(inputs, label)[start : start + counts[rank]]
            same(hvd.reducescatter(inputs[rank], op=op), want, 1e-6 if dtype.is_floating_point else 0.0)
            handle = hvd.reducescatter_async(inputs[rank], name=f"rs.{dtype}", op=op)
            same(hvd.synchronize(handle), want, 1e-6 if dtype.is_floating_point else 0.0)
        inputs = [values(torch.float32, rows, r, 91) for r in range(size)]
        scaled = hvd.reducescatter(inputs[rank], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        same(scaled, reference(inputs, "sum")[start : start + counts[rank]] * 0.5, 1e-6)

    def alltoall_forms() -> None:
        # Rank s sends (d + s) % 3 rows to rank d; every row carries its sender and destination.
        def sent(source: int) -> tuple[torch.Tensor, list[int]]:
            splits = [(d + source) % 3 for d in range(size)]
            rows = [
                torch.tensor([[source, d, k] for k in range(n)], dtype=torch.int64)
                for d, n in enumerate(splits)
            ]
            return torch.cat(rows).reshape(-1, 3), splits

        mine, splits = sent(rank)
        want = torch.cat([sent(s)[0][sum(sent(s)[1][:rank]) :][: sent(s)[1][rank]] for s in range(size)])
        output, received = hvd.alltoall(mine, splits=torch.tensor(splits, dtype=torch.int32))
        same(output, want)
        same(received, torch.tensor([sent(s)[1][rank] for s in range(size)], dtype=torch.int32))
        equal = torch.arange(size * 2, dtype=torch.float32) + 100 * rank
        output = hvd.alltoall(equal)  # no splits: equal parts, and only the output comes back
        same(
            output,
            torch.cat(
                [torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * s for s in range(size)]
            ),
        )
        output, received = hvd.synchronize(hvd.alltoall_async(equal, splits=[2] * size))
        same(received, torch.full((size,), 2, dtype=torch.int32))

    def objects_and_barrier() -> None:
        assert hvd.allgather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
        assert hvd.broadcast_object(("from", rank), root_rank=size - 1) == ("from", size - 1)
        hvd.barrier()

    def wrong_uses() -> None:
        for bad, error in [
            # Adasum reduces floats only (and needs a power-of-two number of ranks).
            (
                lambda: hvd.allreduce(torch.ones(1, dtype=torch.int32), op=hvd.Adasum),
                (TypeError, NotImplementedError),
            ),
            (lambda: hvd.allreduce(torch.ones(1), op="median"), ValueError),
            (lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum, average=True), ValueError),
            (lambda: hvd.allreduce(torch.ones(1), compression="int4"), ValueError),
            (lambda: hvd.synchronize(42), TypeError),
        ]:
            try:
                bad()
            except error:
                continue
            raise AssertionError(f"no {error.__name__} raised")

    def basics() -> None:
        assert hvd.is_initialized() and 0 <= hvd.local_rank() < hvd.local_size() <= size
        assert hvd.cross_size() * hvd.local_size() == size and 0 <= hvd.cross_rank() < hvd.cross_size()
        assert isinstance(hvd.mpi_built(), bool) and isinstance(hvd.gloo_built(), bool)
        assert hvd.mpi_enabled() == (commsched.config()["transport"] == "mpi")

    for label, test in [
        ("allreduce-every-dtype-and-op", allreduce_every_dtype),
        ("allreduce-forms", allreduce_forms),
        ("grouped-allreduce", grouped),
        ("allgather-every-dtype", allgather_every_dtype),
        ("broadcast-every-dtype", broadcast_every_dtype),
        ("reducescatter", reducescatter_forms),
        ("alltoall", alltoall_forms),
        ("objects-and-barrier", objects_and_barrier),
        ("wrong-uses", wrong_uses),
        ("basics", basics),
    ]:
        check(label, test)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
