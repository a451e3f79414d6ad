"""Rank script: the places where `import commsched.torch as hvd` must behave exactly as Horovod does.

Shapes that differ with equal element counts fail on every rank; float alltoall splits raise a
ValueError; scale factors multiply in the
tensor's own float dtype; broadcast_optimizer_state leaves zero gradients on training parameters;
join() averages over every rank and refuses broadcast and allgather while a rank has joined.
Each result is checked against a reference computed another way (torch arithmetic on every
rank's inputs). Prints "PASS <check>" per check and "FAIL <check> ..." on a mismatch.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import commsched.torch as hvd
import numpy as np
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


def fails_naming(name: str, run: Callable[[], object]) -> None:
    """`run` raises a RuntimeError (commsched.CollectiveError) whose message names `name`."""
    try:
        run()
    except commsched.CollectiveError as error:
        assert isinstance(error, RuntimeError), f"{type(error).__name__} is no RuntimeError"
        assert name in str(error), f"the error does not name '{name}': {error}"
    else:
        raise AssertionError(f"'{name}' did not fail")


def inputs_of(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Rank's integer-valued float32 input, so sums are exact."""
    generator = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randint(-100, 100, shape, generator=generator).float()


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def shape_mismatch() -> None:
        # Same element count, different shapes: every path must fail on every rank, then go on.
        shape = (17, 23 * 57) if rank == 0 else (17, 23, 57)
        fails_naming("shape.torch", lambda: hvd.allreduce(torch.ones(shape), name="shape.torch"))
        fails_naming(
            "shape.async", lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(shape), name="shape.async"))
        )
        fails_naming("shape.bcast", lambda: hvd.broadcast(torch.ones(shape), 0, name="shape.bcast"))
        array = np.ones(shape, np.float32)  # the framework-free one-call path
        fails_naming("shape.numpy", lambda: commsched.allreduce(array, name="shape.numpy"))
        fails_naming("shape.numpy.bcast", lambda: commsched.broadcast(array, 0, name="shape.numpy.bcast"))
        fails_naming(
            "shape.numpy.async", lambda: commsched.allreduce_async(array, name="shape.numpy.async").wait()
        )
        # Equal shapes still reduce, on each path, and a torch rank meets a numpy rank.
        wanted = sum(inputs_of(r, (4, 3, 2), 1) for r in range(size))
        mine = inputs_of(rank, (4, 3, 2), 1)
        assert torch.equal(hvd.allreduce(mine, op=hvd.Sum, name="shape.same"), wanted)
        if rank % 2:  # the plug-in's name for a collective is "<kind>.<name>"
            got = torch.as_tensor(commsched.allreduce(mine.numpy().copy(), name="allreduce.shape.mixed"))
        else:
            got = hvd.allreduce(mine, op=hvd.Sum, name="shape.mixed")
        assert torch.equal(got, wanted)
        grouped = hvd.grouped_allreduce([mine, mine[0]], op=hvd.Sum, name="shape.group")
        assert torch.equal(grouped[0], wanted) and torch.equal(grouped[1], wanted[0])

    def scale_in_dtype() -> None:
        # Horovod multiplies float32 by a float32 factor (float16 in float32, integers in float64).
        factor = float(np.random.RandomState(1234).uniform())  # Horovod's test factor: float32 rounding shows
        for salt, dtype in enumerate([torch.float32, torch.float64, torch.float16, torch.int32, torch.int64]):
            mine = inputs_of(rank, (17, 17), 10 + salt).to(dtype)
            math_dtype = {
                torch.float16: torch.float32,
                torch.int32: torch.float64,
                torch.int64: torch.float64,
            }
            wide = math_dtype.get(dtype, dtype)
            by = torch.tensor(factor, dtype=torch.float64).to(wide)
            summed = sum(inputs_of(r, (17, 17), 10 + salt).to(dtype) for r in range(size))
            pre = sum(
                (by * inputs_of(r, (17, 17), 10 + salt).to(dtype).to(wide)).to(dtype) for r in range(size)
            )
            post = (summed.to(wide) * by).to(dtype)
            got_pre = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=factor, name=f"pre.{dtype}")
            got_post = hvd.allreduce(mine, op=hvd.Sum, postscale_factor=factor, name=f"post.{dtype}")
            assert torch.equal(got_pre, pre), f"prescale {dtype}: {(got_pre - pre).abs().max()}"
            assert torch.equal(got_post, post), f"postscale {dtype}: {(got_post - post).abs().max()}"

    def optimizer_state_zero_grads() -> None:
        torch.manual_seed(rank)  # different weights per rank until the broadcast
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        model[0].bias.requires_grad_(False)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
        optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        weights = [p.detach().clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        for index, (p, before) in enumerate(zip(model.parameters(), weights)):
            if not p.requires_grad:
                assert p.grad is None, "a frozen parameter got a gradient"
                continue
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), "no zero gradient"
            # The zero-gradient step applies weight decay only: SGD's momentum buffer is decay * weight.
            buffer = inner.state[p]["momentum_buffer"]
            assert torch.allclose(buffer, 1e-2 * before), "momentum buffer is not one zero-gradient step"
            assert torch.equal(hvd.broadcast(buffer, 0, name=f"buffer.{index}"), buffer)
            assert torch.equal(hvd.broadcast(p.detach(), 0, name=f"weight.{index}"), p.detach())

    def join_averages_over_every_rank() -> None:
        for dtype in [torch.float32, torch.int64]:
            for first in range(size):
                mine = inputs_of(rank, (5, 5), 20).to(dtype)
                if rank == first:
                    last = hvd.join(hvd.local_rank())
                else:
                    got = hvd.allreduce(mine, name=f"join.avg.{dtype}", op=hvd.Average)
                    others = sum(inputs_of(r, (5, 5), 20).to(dtype) for r in range(size) if r != first)
                    # Horovod scales an integer sum by 1/size and casts back: rounded toward zero.
                    want = others.div(size, rounding_mode="trunc") if dtype == torch.int64 else others / size
                    assert torch.equal(got, want), f"{got} != {want}"
                    last = hvd.join()
                assert 0 <= last < size

    def join_refuses_broadcast_and_allgather() -> None:
        for label, run in [
            ("join.bcast", lambda: hvd.broadcast(torch.ones(3, 3), size - 1, name="join.bcast")),
            ("join.gather", lambda: hvd.allgather(torch.ones(3, 3), name="join.gather")),
        ]:
            if rank == 0:
                hvd.join(hvd.local_rank())
            else:
                fails_naming(label, run)
                hvd.join()
        # After join() returned everywhere, both run again.
        gathered = hvd.allgather(torch.full((1, 2), float(rank)), name="join.after")
        assert torch.equal(gathered[:, 0], torch.arange(size, dtype=torch.float32))

    def alltoall_float_splits() -> None:
        # Horovod raises ValueError for splits that are not integers; commsched's TypeError is one too.
        for error in (ValueError, TypeError):
            try:
                hvd.alltoall(torch.ones(size), torch.ones(size), name="float.splits")
            except error as raised:
                assert "splits" in str(raised), raised
            else:
                raise AssertionError("float splits were taken")
        got, received = hvd.alltoall(torch.full((size,), float(rank)), torch.ones(size, dtype=torch.int32))
        assert torch.equal(got, torch.arange(size, dtype=torch.float32)) and received.tolist() == [1] * size

    for label, test in [
        ("shape-mismatch", shape_mismatch),
        ("alltoall-float-splits", alltoall_float_splits),
        ("scale-in-dtype", scale_in_dtype),
        ("optimizer-state-zero-grads", optimizer_state_zero_grads),
        ("join-average", join_averages_over_every_rank),
        ("join-refuses", join_refuses_broadcast_and_allgather),
    ]:
        check(label, test)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
