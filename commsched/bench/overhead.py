"""Measures commsched's own cost per collective on a link: what partition and fusion sizes must cover.

A collective through commsched costs what the transport's does plus the core's share of agreement,
queueing, launch and completion. Where the link is fast (one host, NVLink) that fixed cost, not
the wire, decides how small a partition can be: link_defaults.default_sizes takes it as
`collective_overhead_s`.
"""

from __future__ import annotations

import time
from typing import Any

# Each message is as small as the core still sends as a collective of its own (not inline in the
# agreement round), so the wire's share stays small next to the fixed costs being measured.
_MESSAGE_BYTES = 16 << 10
_MESSAGES = 48
_REPEATS = 3


def _burst_s(comm: Any, submit: Any, buffers: list[Any]) -> float:
    """Best over repeats of the slowest rank's time per message for one burst of `submit` calls."""
    from mpi4py import MPI

    best = float("inf")
    for _ in range(_REPEATS):
        comm.Barrier()
        start = time.perf_counter()
        submit(buffers)
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        best = min(best, elapsed / len(buffers))  # interference on a shared machine only slows a run
    return best


def measure_collective_overhead(comm: Any) -> float:
    """commsched's time per collective in a burst of separate allreduces, less raw MPI's for the
    same burst, in seconds (never negative): its fixed cost per collective on this link.

    commsched runs with partitioning, fusion and inline rounds off and credit for the whole burst,
    so each tensor is one collective and all may be in flight at once, as raw MPI's are.
    """
    import numpy as np
    from mpi4py import MPI

    import commsched

    buffers = [np.ones(_MESSAGE_BYTES // 4, np.float32) for _ in range(_MESSAGES)]

    def raw(items: list[Any]) -> None:
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, b) for b in items])

    def scheduled(items: list[Any]) -> None:
        handles = [
            commsched.allreduce_async(b, name=f"overhead.{i}", priority=i) for i, b in enumerate(items)
        ]
        for handle in handles:
            handle.wait()

    raw(buffers)
    raw_s = _burst_s(comm, raw, buffers)
    commsched.init(
        transport="mpi",
        partition_bytes=0,
        fusion_bytes=0,
        inline_bytes=0,
        credit_bytes=_MESSAGE_BYTES * _MESSAGES,
    )
    try:
        scheduled(buffers)  # the first burst registers the names
        scheduled_s = _burst_s(comm, scheduled, buffers)
    finally:
        commsched.shutdown()
    return max(0.0, scheduled_s - raw_s)
