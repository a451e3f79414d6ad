"""Horovod's synchronous collectives on torch tensors, differentiable as Horovod's are.

Gradients follow Horovod's rules, each computed by commsched collectives in backward:

* allreduce (average, sum or Adasum, with scale factors): the gradient is the same allreduce of
  the incoming gradient, i.e. for a sum the derivative of the sum of every rank's loss;
* allgather: the average over ranks of the incoming gradients, this rank's rows of it;
* broadcast: the average over ranks of the incoming gradients on the root, zeros elsewhere;
* reducescatter: the allgather of the incoming gradients times the scale factors, and times
  size for a sum (Horovod's rule: an average's gradient is the gathered one unscaled);
* grouped allgather and grouped reducescatter: each member as its single form;
* alltoall: the incoming gradient sent back where its rows came from.

Min, max and product allreduces have no gradient here (backward raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from commsched.torch import _wire
from commsched.torch import collectives as _ops
from commsched.torch.compression import Compression, compressor

import torch
from commsched import _horovod
from commsched._horovod import global_process_set


def _reduce_backward(op: str) -> None:
    if op not in (_horovod.Average, _horovod.Sum, _horovod.Adasum):
        raise RuntimeError(
            f"allreduce with op={op!r} has no gradient in commsched.torch; only average, sum and Adasum "
            "allreduces do"
        )


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, name: str | None, op: str, pre: float, post: float, process_set: Any
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        handle = _ops.allreduce_async(tensor, None, name, op, pre, post, process_set)
        return _ops.synchronize(handle)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _reduce_backward(ctx.op)
        reduced = allreduce(
            grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post, process_set=ctx.process_set
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
    *,
    process_group: Any = None,
) -> torch.Tensor:
    """Returns the average (or op) of `tensor` over all ranks as a new tensor; differentiable.

    `process_group`: a torch.distributed group to start commsched over, if it is not running.
    """
    op = _horovod.resolve_op(op, average, adasum=True)
    if process_group is not None:
        _wire.ensure_initialized(process_group, _wire.cuda_device_name([tensor]))
    chosen = compressor(compression)
    compressed, context = chosen.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return chosen.decompress(reduced, context)  # type: ignore[no-any-return]


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, name: str | None, op: str, pre: float, post: float, process_set: Any, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        handle = _ops.grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)
        return tuple(_ops.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _reduce_backward(ctx.op)
        reduced = grouped_allreduce(
            list(grads),
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """Returns the average (or op) of each tensor over all ranks, reduced together; differentiable."""
    op = _horovod.resolve_op(op, average)
    chosen = compressor(compression)
    pairs = [chosen.compress(t) for t in tensors]
    if not pairs:
        return []
    reduced = _GroupedAllreduce.apply(
        name, op, prescale_factor, postscale_factor, process_set, *(t for t, _ in pairs)
    )
    return [chosen.decompress(t, context) for t, (_, context) in zip(reduced, pairs)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any) -> torch.Tensor:  # type: ignore[override]
        gathered = _ops.synchronize(_ops.allgather_rows(tensor, name, process_set))
        ctx.rows, ctx.shape, ctx.process_set = gathered.rows, tensor.shape, process_set
        return gathered.tensor  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = allreduce(grad, op=_horovod.Average, process_set=ctx.process_set)
        me = _horovod.set_rank(ctx.process_set)
        offset = sum(ctx.rows[:me])
        mine = reduced.narrow(0, offset, ctx.rows[me])
        return mine.reshape(ctx.shape), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Returns every rank's `tensor` concatenated on the first dimension, in rank order; differentiable."""
    return _Allgather.apply(tensor, name, process_set)  # type: ignore[no-any-return]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _ops.synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = allreduce(grad, op=_horovod.Average, process_set=ctx.process_set)
        if _horovod.rank() != ctx.root_rank:  # root_rank is a global rank, also on a process set
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Returns root_rank's `tensor` on every rank as a new tensor; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)  # type: ignore[no-any-return]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, name: str | None, op: str, process_set: Any, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.scale = op, process_set, pre * post
        return _ops.synchronize(_ops.reducescatter_async(tensor, name, op, process_set, pre, post))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        scaled = _reducescatter_grad(grad, ctx.op, ctx.scale, ctx.process_set)
        return allgather(scaled, process_set=ctx.process_set), None, None, None, None, None


def _reducescatter_grad(grad: torch.Tensor, op: str, scale: float, process_set: Any) -> torch.Tensor:
    """The incoming gradient of a reducescatter scaled as Horovod's backward scales it, before the allgather."""
    if op == _horovod.Sum:
        scale *= _horovod.set_size(process_set)
    return (grad * scale if scale != 1 else grad).contiguous()


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = _horovod.Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Returns this rank's part of the average (or sum) of every rank's `tensor`, cut on the first dimension."""
    op = _horovod.resolve_op(op)
    chosen = compressor(compression)
    compressed, context = chosen.compress(tensor)
    part = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return chosen.decompress(part, context)  # type: ignore[no-any-return]


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Any:  # type: ignore[override]
        output, received = _ops.synchronize(_ops.alltoall_parts(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:  # type: ignore[override]
        handle = _ops.alltoall_parts(grad.contiguous(), ctx.received, None, ctx.process_set)
        returned, _ = _ops.synchronize(handle)
        return returned, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Sends rows splits[r] of `tensor` to rank r (equal parts without splits) and returns what arrived.

    Returns the received rows in rank order; with `splits` given, (output, received_splits) as in
    Horovod. Differentiable.
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: Any, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        gathered = _ops.synchronize(_ops.grouped_allgather_rows(tensors, name, process_set))
        ctx.rows = [g.rows for g in gathered]
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(g.tensor for g in gathered)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = grouped_allreduce(
            [g.contiguous() for g in grads], op=_horovod.Average, process_set=ctx.process_set
        )
        me = _horovod.set_rank(ctx.process_set)
        mine = [
            r.narrow(0, sum(rows[:me]), rows[me]).reshape(shape)
            for r, rows, shape in zip(reduced, ctx.rows, ctx.shapes)
        ]
        return (None, None, *mine)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> list[torch.Tensor]:
    """Returns allgather() of each tensor, started together; differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, name: str | None, op: str, process_set: Any, pre: float, post: float, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.process_set, ctx.scale = op, process_set, pre * post
        handle = _ops.grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)
        return tuple(_ops.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        scaled = [_reducescatter_grad(g, ctx.op, ctx.scale, ctx.process_set) for g in grads]
        return (None, None, None, None, None, *grouped_allgather(scaled, process_set=ctx.process_set))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = _horovod.Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Returns reducescatter() of each tensor, started together; differentiable."""
    op = _horovod.resolve_op(op)
    chosen = compressor(compression)
    pairs = [chosen.compress(t) for t in tensors]
    parts = _GroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *(t for t, _ in pairs)
    )
    return [chosen.decompress(part, context) for part, (_, context) in zip(parts, pairs)]
