"""Adasum: Horovod's adaptive-summation allreduce (op=hvd.Adasum), over commsched's allgather.

Two gradients a and b combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add up and parallel ones average. Ranks combine in Horovod's
vector-halving distance-doubling order: at level 1, 2, 4, ... rank r's partial result meets
rank r ^ level's, the lower rank on the left. Dot products and norms are taken in float64, a
coefficient stays 1 when its norm squared is below sqrt(DBL_MIN) (as Horovod's adasum.h), and
each level's sum is rounded to the tensor's dtype, as Horovod's in-place ScaledAdd does.

commsched has no Adasum in its core: each rank allgathers every rank's tensor (one scheduled
collective, like any other) and runs the same deterministic combination, so all ranks get the
same bits. That costs size x the bytes of an allreduce on the wire; it is meant for the
modest sizes Adasum is used with on CPU transports. As in Horovod, the number of ranks must be
a power of two, and process sets other than the global one are refused; commsched's NCCL
transport has no Adasum and refuses it by name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)
# Horovod's threshold below which a norm squared counts as zero (sqrt of the smallest normal double).
_SQRT_DOUBLE_MIN = float(np.sqrt(sys.float_info.min))


def check_ranks(size: int) -> None:
    """Refuses a rank count Adasum's pairwise halving cannot pair up (not a power of two)."""
    if size < 1 or size & (size - 1):
        raise NotImplementedError(
            f"op=Adasum needs a power-of-two number of ranks (as Horovod), not {size}; "
            "run 1, 2, 4, 8, ... ranks or use op=hvd.Average"
        )


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two vectors of one float dtype, rounded to that dtype."""
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    dot = float(np.dot(a64, b64))
    a_norm_sq = float(np.dot(a64, a64))
    b_norm_sq = float(np.dot(b64, b64))
    a_coefficient = 1.0 - dot / a_norm_sq * 0.5 if a_norm_sq >= _SQRT_DOUBLE_MIN else 1.0
    b_coefficient = 1.0 - dot / b_norm_sq * 0.5 if b_norm_sq >= _SQRT_DOUBLE_MIN else 1.0
    return (a_coefficient * a64 + b_coefficient * b64).astype(a.dtype)


def combine(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Adasum of one vector per rank (in rank order), combined level by level as Horovod pairs ranks."""
    check_ranks(len(vectors))
    dtypes = {vector.dtype for vector in vectors}
    if len(dtypes) != 1 or next(iter(dtypes)).type not in FLOAT_DTYPES:
        raise TypeError(f"op=Adasum reduces float16, float32 or float64 tensors of one dtype, not {dtypes}")
    partial = [np.ascontiguousarray(vector).reshape(-1) for vector in vectors]
    if len({vector.size for vector in partial}) != 1:
        sizes = [vector.size for vector in partial]
        raise ValueError(f"op=Adasum needs the same number of elements on every rank, got {sizes} by rank")
    level = 1
    while level < len(partial):
        partial = [
            pair(partial[i], partial[i + level]) if i % (2 * level) == 0 else partial[i]
            for i in range(len(partial))
        ]
        level *= 2
    return partial[0]


def start_torch(
    target: Any,
    source: Any,
    core_name: str,
    prescale_factor: float,
    postscale_factor: float,
    process_set: Any,
) -> tuple[Callable[[], bool], Callable[[], Any]]:
    """Starts Adasum of torch tensor `source` into `target`; (done, finish) for a commsched.torch Handle."""
    import torch

    import commsched
    from commsched import _horovod

    if not _horovod.is_global(process_set):
        raise NotImplementedError(
            "op=Adasum does not support process sets other than the global one (as Horovod)"
        )
    check_ranks(commsched.size())
    if commsched.config().get("transport") == "nccl":
        raise NotImplementedError(
            "op=Adasum is not available on commsched's NCCL transport; run with the MPI or Gloo transport "
            "(COMMSCHED_TRANSPORT) or use op=hvd.Average"
        )
    if source.dtype not in (torch.float16, torch.float32, torch.float64):
        raise TypeError(f"op=Adasum reduces float16, float32 or float64 tensors, not {source.dtype}")
    row = source.detach().reshape(1, -1).to("cpu", copy=True)
    if prescale_factor != 1.0:
        row.mul_(prescale_factor)
    work = _horovod._core("allgather_async")(row, name=core_name)

    def finish() -> Any:
        gathered = work.wait()
        rows = [part.numpy() for part in torch.as_tensor(gathered).reshape(commsched.size(), -1)]
        result = torch.from_numpy(combine(rows)).reshape(target.shape)
        if postscale_factor != 1.0:
            result.mul_(postscale_factor)
        target.copy_(result)
        return target

    return work.done, finish
