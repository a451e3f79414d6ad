"""The sharded optimizer's step, per bucket: take a landed reduce-scatter, update that shard alone.

step() no longer waits for every reduce-scatter before it updates any shard: it takes the buckets
in the order their reduce-scatters land, steps the wrapped optimizer on that bucket's shard alone
and starts the bucket's all-gather at once, so updates and gathers overlap the reduce-scatters
still on the wire. The wrapped optimizer's state is per shard and its step elementwise (both
checked at wrap time), so stepping the shards one at a time gives the same values as one step
over all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from commsched.torch import _shard_layout as layout
from commsched.torch import _shard_state as _state
from commsched.torch.optimizer import _needs_closure, step_on

import torch

# Optimizers whose update of a parameter reads the whole tensor (norms, factored moments, matrix
# roots): a flat shard would change their maths, so they are refused by name.
WHOLE_TENSOR = frozenset(
    {
        "lbfgs",
        "muon",
        "adafactor",
        "shampoo",
        "distributedshampoo",
        "soap",
        "kron",
        "lamb",
        "lars",
        "sparseadam",
    }
)


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer whose step needs whole tensors (or a closure), naming it."""
    names = [cls.__name__ for cls in type(optimizer).__mro__]
    whole = next((name for name in names if name.lower() in WHOLE_TENSOR), None)
    if whole is not None or _needs_closure(optimizer):
        raise ValueError(
            f"shard=True cannot wrap {type(optimizer).__name__}: its step needs whole parameter tensors "
            "(or a closure), but each rank holds only a flat shard of them. Use an elementwise optimizer "
            "(SGD, Adam, AdamW, RMSprop, Adagrad, ...) or shard=False"
        )


# Polling pauses while no reduce-scatter has landed: short enough to add little to the step, long
# enough to leave the core's thread the CPU (the core has no wait-for-any).
_FIRST_PAUSE_S = 50e-6
_MAX_PAUSE_S = 500e-6


def next_landed(pending: list[layout.ShardBucket], timeout: float | None) -> layout.ShardBucket:
    """The first of `pending` whose reduce-scatter finished (or failed), waiting up to `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _FIRST_PAUSE_S
    while True:
        for bucket in pending:
            if bucket.scatter.done():
                return bucket
        if deadline is not None and time.monotonic() >= deadline:
            pending[0].scatter.wait(0.0)  # raises the TimeoutError that says where it stands
            return pending[0]
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE_S)


def take(bucket: layout.ShardBucket, timeout: float | None) -> None:
    """Waits for the bucket's reduce-scatter and keeps this rank's part as the shard's gradient."""
    part = bucket.scatter.wait(timeout)
    bucket.scatter = None
    bucket.ready = 0
    if not isinstance(part, torch.Tensor):
        part = torch.as_tensor(part)
    part = part.reshape(-1).to(bucket.shard.device)
    if bucket.shard.grad is None:
        bucket.shard.grad = torch.empty_like(bucket.shard)
    bucket.shard.grad.copy_(part.view(bucket.shard.dtype) if part.dtype != bucket.shard.dtype else part)


def update(
    inner: torch.optim.Optimizer,
    buckets: list[layout.ShardBucket],
    unused: set[int],
    updating: Callable[[list[torch.Tensor], Callable[[], Any]], Any],
) -> None:
    """Steps the wrapped optimizer on these buckets' shards only, between the parameter update hooks.

    `updating` is the optimizer's hook runner, called with the buckets' parameters; a parameter
    in `unused` (no rank used it) keeps its values and state.
    """
    chosen: dict[int, list[torch.Tensor]] = {}
    for bucket in buckets:
        layout.refresh(bucket)  # the parameters may have been changed since the last gather
        chosen.setdefault(bucket.group, []).append(bucket.shard)
    params = list({id(m.param): m.param for bucket in buckets for m in bucket.members}.values())
    updating(
        params, lambda: step_on(inner, chosen, lambda: _state.update(inner, buckets, unused, inner.step))
    )
