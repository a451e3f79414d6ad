"""Rank script: Horovod 0.28.1's grouped allgather and reducescatter, sparse_allreduce_async, integer
averages, object collectives after a join, and HorovodInternalError, through commsched.torch.

Every rank builds every rank's inputs from seeds, so each result is checked against torch on all
inputs in one process. Gradients follow Horovod's backward rules (horovod/torch/mpi_ops.py):
an allgather's gradient is the average of the incoming ones, this rank's rows; a reducescatter's
is the allgather of the incoming ones times the scale factors, times size for a sum.
Prints "PASS <check>" or "FAIL <check> ...".
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

import commsched.torch as hvd
import torch

import commsched

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


def values(rank: int, salt: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank `rank`'s integer-valued input for a check (so sums are exact in every dtype)."""
    generator = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randint(-50, 50, shape, generator=generator).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Asserts equal shapes, dtypes and values."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert torch.allclose(got.double(), want.double(), rtol=1e-12, atol=1e-12), f"{got} != {want}"


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rows = 2 * size + 1  # not a multiple of size: the first rows % size ranks get one row more
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]

    def grouped_allgather() -> None:
        dtypes = [torch.float32, torch.int64, torch.float16]
        inputs = [[values(r, 1 + i, r + 1, 3, dtype=d) for i, d in enumerate(dtypes)] for r in range(size)]
        wants = [torch.cat([inputs[r][i] for r in range(size)]) for i in range(len(dtypes))]
        for got in (
            hvd.grouped_allgather(inputs[rank]),
            hvd.synchronize(hvd.grouped_allgather_async(inputs[rank], name="grouped.gather")),
        ):
            assert len(got) == len(wants)
            for g, w in zip(got, wants):
                same(g, w)

    def grouped_allgather_grad() -> None:
        xs = [[values(r, 4 + i, r + 2, 2) for i in range(2)] for r in range(size)]
        mine = [x.clone().requires_grad_() for x in xs[rank]]
        total = sum(r + 2 for r in range(size))
        incoming = [[values(r, 8 + i, total, 2) for i in range(2)] for r in range(size)]
        for g, w in zip(hvd.grouped_allgather(mine), incoming[rank]):
            g.backward(w)
        offset = sum(r + 2 for r in range(rank))
        for i, m in enumerate(mine):
            mean = sum(incoming[r][i] for r in range(size)) / size
            same(m.grad, mean.narrow(0, offset, rank + 2))

    def grouped_reducescatter(op: str, pre: float, post: float) -> Callable[[], None]:
        def test() -> None:
            dtypes = [torch.float64, torch.float32]
            inputs = [
                [values(r, 11 + i, rows, 2, dtype=d) for i, d in enumerate(dtypes)] for r in range(size)
            ]
            got = hvd.grouped_reducescatter(inputs[rank], op=op, prescale_factor=pre, postscale_factor=post)
            later = hvd.synchronize(
                hvd.grouped_reducescatter_async(
                    inputs[rank], name="grouped.rs", op=op, prescale_factor=pre, postscale_factor=post
                )
            )
            for i, dtype in enumerate(dtypes):
                total = sum(inputs[r][i].double() for r in range(size)) * pre * post
                if op == hvd.Average:
                    total = total / size
                want = torch.split(total, counts)[rank].to(dtype)
                same(got[i], want)
                same(later[i], want)

        return test

    def grouped_reducescatter_grad(op: str) -> Callable[[], None]:
        def test() -> None:
            pre, post = 2.0, 0.25
            mine = [values(rank, 14 + i, rows, 3).requires_grad_() for i in range(2)]
            incoming = [[values(r, 18 + i, counts[r], 3) for i in range(2)] for r in range(size)]
            parts = hvd.grouped_reducescatter(mine, op=op, prescale_factor=pre, postscale_factor=post)
            for p, w in zip(parts, incoming[rank]):
                p.backward(w)
            factor = pre * post * (size if op == hvd.Sum else 1)
            for i, m in enumerate(mine):
                same(m.grad, torch.cat([incoming[r][i] for r in range(size)]) * factor)

        return test

    def grouped_process_sets() -> None:
        # Each rank alone in its set (as Horovod's test at 2 ranks): the set's result is its own input.
        sets = [hvd.add_process_set([r]) for r in range(size)]
        try:
            mine = [values(rank, 21, 3, 2), values(rank, 22, 4)]
            for g, x in zip(hvd.grouped_allgather(mine, process_set=sets[rank]), mine):
                same(g, x)
            parts = hvd.grouped_reducescatter(mine, op=hvd.Sum, process_set=sets[rank], postscale_factor=3.0)
            for p, x in zip(parts, mine):
                same(p, x * 3.0)
        finally:
            for process_set in reversed(sets):
                hvd.remove_process_set(process_set)

    def sparse_allreduce(op: str) -> Callable[[], None]:
        def test() -> None:
            dense = [values(r, 25, 9, 4) * (values(r, 26, 9, 4) > 30) for r in range(size)]
            result = hvd.sparse_allreduce_async(dense[rank].to_sparse(), name=f"sparse.{op}", op=op)()
            assert result.is_sparse, "the result is not sparse"
            want = sum(dense) / (size if op == hvd.Average else 1)
            same(result.to_dense(), want)

        return test

    def integer_average_truncates() -> None:
        # Odd sums of negative values: Horovod gives -37 for (-75)/2 (toward zero), not the floor -38.
        inputs = [values(r, 30, 7, 5, dtype=torch.int32) * 2 + (1 if r == 0 else 0) for r in range(size)]
        want = sum(i.long() for i in inputs).div(size, rounding_mode="trunc").to(torch.int32)
        assert not torch.equal(want, sum(i.long() for i in inputs).div(size, rounding_mode="floor").int())
        same(hvd.allreduce(inputs[rank], op=hvd.Average), want)
        same(hvd.grouped_allreduce([inputs[rank]], op=hvd.Average)[0], want)

    def object_after_join() -> None:
        # The joined rank skips the others' unnamed allgather; the object allgather must still meet.
        for first in range(size):
            if rank == first:
                last = hvd.join()
            else:
                try:
                    hvd.allgather(torch.ones(2, 2))
                except RuntimeError as error:
                    assert "joined" in str(error), error
                else:
                    raise AssertionError("an allgather with a joined rank ran")
                last = hvd.join()
            assert hvd.allgather_object(last) == [last] * size
            assert hvd.allgather_object(("after", first)) == [("after", first)] * size

    def internal_error() -> None:
        assert hvd.HorovodInternalError is commsched.HorovodInternalError
        assert issubclass(hvd.HorovodInternalError, RuntimeError)
        try:
            hvd.reducescatter(torch.ones(rows + rank, 2), name="rs.mismatch")
        except hvd.HorovodInternalError as error:
            assert "rs.mismatch" in str(error), error
        else:
            raise AssertionError("a reducescatter of different shapes ran")

    def duplicate_name_refused() -> None:
        # Horovod refuses a name submitted again right after the first; the first may be done in the
        # core by then (rank 1 waits for that here), so the name stays taken until synchronize().
        tensor = torch.ones(3)
        if rank == 0:
            first = hvd.allreduce_async(tensor, name="dup", op=hvd.Sum)
        hvd.barrier()
        if rank == 1:
            first = hvd.allreduce_async(tensor, name="dup", op=hvd.Sum)
            while not hvd.poll(first):
                time.sleep(0.001)
            try:
                hvd.allreduce_async(tensor, name="dup")
            except ValueError as error:
                assert "allreduce.dup" in str(error), error
            else:
                raise AssertionError("a name not yet synchronized was taken again")
        same(hvd.synchronize(first), tensor * size)
        same(hvd.synchronize(hvd.allreduce_async(tensor, name="dup", op=hvd.Sum)), tensor * size)

    def join_fails_when_a_rank_leaves() -> None:
        # A join that cannot complete ends with an error naming the rank, instead of waiting.
        if rank == 0:
            try:
                hvd.join()
            except RuntimeError as error:
                # Rank 1's shutdown() ends the join, or, when it came first, stops commsched before it.
                text = str(error)
                assert "before every rank joined" in text or "shutdown() was called on rank 1" in text, error
                assert "rank 1" in text, error
            else:
                raise AssertionError("join() returned though rank 1 shut down without joining")
        elif rank == 1:
            hvd.shutdown()

    for label, test in [
        ("grouped-allgather", grouped_allgather),
        ("grouped-allgather-grad", grouped_allgather_grad),
        ("grouped-reducescatter-sum", grouped_reducescatter(hvd.Sum, 0.5, 3.0)),
        ("grouped-reducescatter-average", grouped_reducescatter(hvd.Average, 1.0, 1.0)),
        ("grouped-reducescatter-grad-sum", grouped_reducescatter_grad(hvd.Sum)),
        ("grouped-reducescatter-grad-average", grouped_reducescatter_grad(hvd.Average)),
        ("grouped-process-sets", grouped_process_sets),
        ("sparse-allreduce-sum", sparse_allreduce(hvd.Sum)),
        ("sparse-allreduce-average", sparse_allreduce(hvd.Average)),
        ("integer-average-truncates", integer_average_truncates),
        ("object-after-join", object_after_join),
        ("internal-error", internal_error),
        ("duplicate-name-refused", duplicate_name_refused),
        ("join-fails-when-a-rank-leaves", join_fails_when_a_rank_leaves),  # last: rank 1 stops
    ]:
        check(label, test)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
