"""Rank script: gradients through hvd collectives against one process computing them with plain torch.

Every rank knows every rank's input x_r and loss weights w_r, so one process can build the
whole computation with torch ops on leaves and let autograd differentiate it. Horovod's
rules (which commsched.torch follows): allreduce and alltoall give the derivative of the
sum of every rank's loss, reducescatter size times it; allgather and broadcast that of their mean.
Prints "PASS <check>" or "FAIL <check> ...".
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


def tensor(rank: int, salt: int, *shape: int) -> torch.Tensor:
    """Rank `rank`'s float64 values for this check."""
    return torch.randn(
        *shape, generator=torch.Generator().manual_seed(100 * salt + rank), dtype=torch.float64
    )


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Asserts equal shapes and values up to float64 rounding."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), f"max difference {(got - want).abs().max()}"


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def leaves(salt: int, *shape: int) -> list[torch.Tensor]:
        return [tensor(r, salt, *shape).requires_grad_() for r in range(size)]

    def weights(salt: int, *shape: int) -> list[torch.Tensor]:
        return [tensor(r, salt + 50, *shape) for r in range(size)]

    def allreduce_gradient(op: str, pre: float, post: float) -> Callable[[], None]:
        def test() -> None:
            xs, ws = leaves(1, 4, 3), weights(1, 4, 3)
            mine = xs[rank].detach().clone().requires_grad_()
            y = hvd.allreduce(mine, op=op, prescale_factor=pre, postscale_factor=post)
            (y * ws[rank]).sum().backward()
            combined = sum(x * pre for x in xs) * post
            if op == hvd.Average:
                combined = combined / size
            sum(((combined * w).sum() for w in ws), torch.zeros((), dtype=torch.float64)).backward()
            assert mine.grad is not None
            close(mine.grad, xs[rank].grad)

        return test

    def grouped_gradient() -> None:
        xs = [leaves(2, 3), leaves(3, 2, 2)]
        ws = [weights(2, 3), weights(3, 2, 2)]
        mine = [x[rank].detach().clone().requires_grad_() for x in xs]
        ys = hvd.grouped_allreduce(mine, op=hvd.Average)
        sum((y * w[rank]).sum() for y, w in zip(ys, ws)).backward()
        total = torch.zeros((), dtype=torch.float64)
        for x, w in zip(xs, ws):
            mean = sum(x) / size
            total = total + sum((mean * wr).sum() for wr in w)
        total.backward()
        for m, x in zip(mine, xs):
            close(m.grad, x[rank].grad)

    def allgather_gradient() -> None:
        xs = [tensor(r, 4, r + 1, 2).requires_grad_() for r in range(size)]  # uneven rows
        rows = sum(r + 1 for r in range(size))
        ws = weights(4, rows, 2)
        mine = xs[rank].detach().clone().requires_grad_()
        (hvd.allgather(mine) * ws[rank]).sum().backward()
        gathered = torch.cat(xs)
        (sum((gathered * w).sum() for w in ws) / size).backward()  # the mean of every rank's loss
        close(mine.grad, xs[rank].grad)

    def broadcast_gradient() -> None:
        root = size - 1
        xs, ws = leaves(5, 3, 2), weights(5, 3, 2)
        mine = xs[rank].detach().clone().requires_grad_()
        (hvd.broadcast(mine, root) * ws[rank]).sum().backward()
        (sum((xs[root] * w).sum() for w in ws) / size).backward()
        want = xs[rank].grad if xs[rank].grad is not None else torch.zeros_like(mine)
        close(mine.grad, want)

    def reducescatter_gradient(op: str) -> Callable[[], None]:
        def test() -> None:
            rows = 2 * size + 1
            counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
            xs = leaves(6, rows, 2)
            ws = [tensor(r, 56, counts[r], 2) for r in range(size)]
            mine = xs[rank].detach().clone().requires_grad_()
            (hvd.reducescatter(mine, op=op, prescale_factor=3.0) * ws[rank]).sum().backward()
            combined = sum(x * 3.0 for x in xs)
            if op == hvd.Average:
                combined = combined / size
            parts = torch.split(combined, counts)
            sum((p * w).sum() for p, w in zip(parts, ws)).backward()
            # Horovod's backward gathers the incoming gradient times the scale factors and, for a
            # sum, times size: size times the derivative of the sum of every rank's loss, for both ops.
            close(mine.grad, xs[rank].grad * size)

        return test

    def alltoall_gradient() -> None:
        splits = [[(d + s) % 3 for d in range(size)] for s in range(size)]
        xs = [tensor(s, 7, sum(splits[s]), 2).requires_grad_() for s in range(size)]
        received = [[splits[s][d] for s in range(size)] for d in range(size)]
        ws = [tensor(d, 57, sum(received[d]), 2) for d in range(size)]
        mine = xs[rank].detach().clone().requires_grad_()
        output, _ = hvd.alltoall(mine, splits=splits[rank])
        (output * ws[rank]).sum().backward()
        pieces = [torch.split(x, splits[s]) for s, x in enumerate(xs)]
        outputs = [torch.cat([pieces[s][d] for s in range(size)]) for d in range(size)]
        sum((o * w).sum() for o, w in zip(outputs, ws)).backward()
        close(mine.grad, xs[rank].grad)

    def sync_batch_norm() -> None:
        torch.manual_seed(0)
        per_rank = 3
        xs = [tensor(r, 8, per_rank, 4, 5).requires_grad_() for r in range(size)]
        ws = weights(8, per_rank, 4, 5)
        synced = hvd.SyncBatchNorm(4).double()
        plain = torch.nn.BatchNorm1d(4).double()
        with torch.no_grad():
            for module in (synced, plain):
                module.weight.copy_(torch.linspace(0.5, 2.0, 4))
                module.bias.copy_(torch.linspace(-1.0, 1.0, 4))
        mine = xs[rank].detach().clone().requires_grad_()
        out = synced(mine)
        (out * ws[rank]).sum().backward()
        whole = plain(torch.cat(xs))
        close(out.detach(), whole.detach()[rank * per_rank : (rank + 1) * per_rank])
        (whole * torch.cat(ws)).sum().backward()  # the sum of every rank's loss
        close(mine.grad, xs[rank].grad)
        for got, want in [(synced.weight.grad, plain.weight.grad), (synced.bias.grad, plain.bias.grad)]:
            close(hvd.allreduce(got, op=hvd.Sum), want)  # local gradients that add up to the whole batch's
        close(synced.running_mean, plain.running_mean)
        close(synced.running_var, plain.running_var)
        synced.eval()
        plain.eval()
        probe = tensor(0, 9, 2, 4, 5)
        close(synced(probe), plain(probe))

    for label, test in [
        ("allreduce-average", allreduce_gradient(hvd.Average, 1.0, 1.0)),
        ("allreduce-sum-scaled", allreduce_gradient(hvd.Sum, 0.5, 4.0)),
        ("grouped-allreduce", grouped_gradient),
        ("allgather", allgather_gradient),
        ("broadcast", broadcast_gradient),
        ("reducescatter-average", reducescatter_gradient(hvd.Average)),
        ("reducescatter-sum", reducescatter_gradient(hvd.Sum)),
        ("alltoall", alltoall_gradient),
        ("sync-batch-norm", sync_batch_norm),
    ]:
        check(label, test)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
