"""Rank script: `op=hvd.Adasum` in commsched.torch's allreduce forms, against Horovod's formula.

Every rank builds every rank's input from its rank, so each result is checked against the
pairwise formula computed here in float64 (2 ranks: one pair). Prints "PASS <check>" per check.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import commsched.torch as hvd
import torch

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


def vector(rank: int, dtype: torch.dtype, n: int = 37) -> torch.Tensor:
    """Rank `rank`'s input: random, so neither orthogonal nor parallel to the other rank's."""
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64).to(dtype)


def formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Horovod's Adasum of two vectors, in float64."""
    a, b = a.double(), b.double()
    dot = torch.dot(a, b)
    return (1 - dot / (2 * torch.dot(a, a))) * a + (1 - dot / (2 * torch.dot(b, b))) * b


def main() -> int:
    """Runs the checks on this rank; the exit status counts the failures."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert size == 2, "this script checks one Adasum pair: run it on 2 ranks"
    tolerance = {torch.float16: 2e-3, torch.float32: 1e-6, torch.float64: 1e-12}

    def in_place() -> None:
        for dtype, tol in tolerance.items():
            tensor = vector(rank, dtype)
            hvd.allreduce_(tensor, op=hvd.Adasum, name=f"adasum.{dtype}")
            expected = formula(vector(0, dtype), vector(1, dtype))
            assert tensor.dtype == dtype
            assert torch.allclose(tensor.double(), expected, rtol=tol, atol=tol), (dtype, tensor, expected)

    def async_and_scaled() -> None:
        source = vector(rank, torch.float32).reshape(37, 1)
        handle = hvd.allreduce_async(source, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
        result = hvd.synchronize(handle)
        expected = formula(2 * vector(0, torch.float32), 2 * vector(1, torch.float32)) * 0.25
        assert result.shape == (37, 1) and torch.equal(source, vector(rank, torch.float32).reshape(37, 1))
        assert torch.allclose(result.reshape(-1).double(), expected, rtol=1e-6, atol=1e-6)

    def parallel_averages() -> None:
        tensor = vector(0, torch.float64) * (rank + 1)
        hvd.allreduce_(tensor, op=hvd.Adasum)
        assert torch.allclose(tensor, vector(0, torch.float64) * 1.5, rtol=1e-12)

    def differentiable() -> None:
        # hvd.allreduce's gradient is the Adasum of the incoming gradients, as Horovod's.
        x = vector(rank, torch.float64).requires_grad_()
        reduced = hvd.allreduce(x, op=hvd.Adasum, name="adasum.autograd")
        assert torch.allclose(reduced.detach(), formula(vector(0, torch.float64), vector(1, torch.float64)))
        weights = vector(rank + 5, torch.float64)
        (reduced * weights).sum().backward()
        expected = formula(vector(5, torch.float64), vector(6, torch.float64))
        assert torch.allclose(x.grad, expected, rtol=1e-12, atol=1e-12), (x.grad, expected)

    def delta_optimizer() -> None:
        # Horovod's Adasum optimizer: each rank steps SGD with momentum on its own gradients, and the
        # ranks' parameter deltas are combined with Adasum; the reference tracks each rank's momentum.
        import numpy as np

        from commsched import adasum

        torch.manual_seed(3)
        model = torch.nn.Linear(5, 3).double()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=hvd.Adasum)
        assert repr(optimizer).startswith("DistributedOptimizer(Adasum")
        buffers = [torch.zeros_like(p) for p in model.parameters()]
        for step in range(3):
            x = torch.randn(
                6, 5, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64
            )
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            for buffer, param in zip(buffers, model.parameters()):
                buffer.mul_(0.9 if step else 0.0).add_(param.grad)
            optimizer.step()
            every = hvd.allgather_object([(-0.05 * b).reshape(-1).numpy() for b in buffers])
            for i, param in enumerate(model.parameters()):
                want = before[i].reshape(-1).numpy() + adasum.combine([deltas[i] for deltas in every])
                assert np.allclose(param.detach().reshape(-1).numpy(), want, rtol=1e-12, atol=1e-12), (
                    step,
                    i,
                )
        solo = hvd.add_process_set([0])
        for wrong in ({"overlap_forward": True, "model": model}, {"process_set": solo}):
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, **wrong)
            except NotImplementedError as refusal:
                assert "op=hvd.Adasum" in str(refusal), refusal
            else:
                raise AssertionError(f"the Adasum optimizer took {wrong}")
        hvd.remove_process_set(solo)

    def refused() -> None:
        solo = hvd.add_process_set([0])
        for bad, error in [
            (lambda: hvd.allreduce_(torch.ones(2, dtype=torch.int32), op=hvd.Adasum), TypeError),
            (
                lambda: hvd.allreduce_async(torch.ones(2), op=hvd.Adasum, process_set=solo),
                NotImplementedError,
            ),
            (lambda: hvd.grouped_allreduce_([torch.ones(2)], op=hvd.Adasum), NotImplementedError),
        ]:
            try:
                bad()
            except error as refusal:
                assert "Adasum" in str(refusal), refusal
            else:
                raise AssertionError(f"{bad} was not refused")
        hvd.remove_process_set(solo)

    check("adasum-in-place", in_place)
    check("adasum-async-scaled", async_and_scaled)
    check("adasum-parallel-averages", parallel_averages)
    check("adasum-differentiable", differentiable)
    check("adasum-delta-optimizer", delta_optimizer)
    check("adasum-refused", refused)
    hvd.shutdown()
    return failures


if __name__ == "__main__":
    sys.exit(main())
