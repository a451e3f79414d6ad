"""Measures commsched's own cost per collective on a link: what partition and fusion sizes must cover.

A collective through commsched costs what the transport's does plus the core's share of agreement,
queueing, launch and completion. Where the link is fast (one host, NVLink) that fixed cost, not
the wire, decides how small a partition can be: link_defaults.default_sizes takes it as
`collective_overhead_s`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from commsched.link_defaults import MessageCost

# Each message is as small as the core still sends as a collective of its own (not inline in the
# agreement round), so the wire's share stays small next to the fixed costs being measured.
_MESSAGE_BYTES = 16 << 10
_MESSAGES = 48
_REPEATS = 3
# One tensor sent whole and cut into partitions: what each partition adds is what a partition pays.
_PARTITIONED_BYTES = 8 << 20
_PARTITIONS = 16
_CREDIT_PARTITIONS = 4  # the link rule's least credit, in partitions
_PARTITION_REPEATS = 7


def _burst_s(
    comm: Any, submit: Any, buffers: list[Any], repeats: int = _REPEATS, statistic: Any = min
) -> float:
    """`statistic` (the best by default) over repeats of the slowest rank's time per message for one
    burst of `submit` calls."""
    from mpi4py import MPI

    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        submit(buffers)
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / len(buffers))
    return float(statistic(samples))  # the best: interference on a shared machine only slows a run


def _partition_cost_s(comm: Any) -> float:
    """commsched's time per partition added: one 8 MiB allreduce cut into 16 partitions (credit for
    4 in flight) against the same tensor whole, the difference of their medians over the 15
    partitions added. The median, not the best: training pays what the host's other work leaves,
    not its quietest moment."""
    import statistics

    import numpy as np

    import commsched

    tensor = np.ones(_PARTITIONED_BYTES // 4, np.float32)

    def submit(items: list[Any]) -> None:
        commsched.allreduce_async(items[0], name="overhead.partitioned", priority=0).wait()

    times = []
    for partition in (0, _PARTITIONED_BYTES // _PARTITIONS):
        commsched.init(
            transport="mpi",
            partition_bytes=partition,
            fusion_bytes=0,
            inline_bytes=0,
            credit_bytes=_CREDIT_PARTITIONS * (partition or _PARTITIONED_BYTES),
        )
        try:
            submit([tensor])  # registers the name
            times.append(_burst_s(comm, submit, [tensor], _PARTITION_REPEATS, statistics.median))
        finally:
            commsched.shutdown()
    return max(0.0, (times[1] - times[0]) / (_PARTITIONS - 1))


def measure_collective_overhead(comm: Any) -> float:
    """commsched's fixed cost per collective on this link, in seconds (never negative): the larger of
    its time per collective in a burst of separate allreduces less raw MPI's for the same burst, and
    what each partition adds to one large allreduce (_partition_cost_s).

    In the burst commsched runs with partitioning, fusion and inline rounds off and credit for the
    whole burst, so each tensor is one collective and all may be in flight at once, as raw MPI's
    are. The burst alone read 3-96 us in ten replays on the 2-core host under other jobs (VGG-16 and
    ResNet-50, 2026-11-27), 3-12 us in six of them, while a 16 MiB allreduce cut into 512 KiB to
    2 MiB partitions paid 25-39 us per partition added: the floor the burst set left VGG-16's
    replay at 1/16 scale 256-512 KiB partitions, and priority+overlap 0.81-0.97 of fifo+barrier.
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
    return max(scheduled_s - raw_s, _partition_cost_s(comm), 0.0)


def measure_message_cost(comm: Any, bandwidth: float, latency_s: float) -> MessageCost | None:
    """Rank 0's probe of the transport's rate and fixed cost per large allreduce, on every rank (the
    sizes derived from it must agree); None on a slow link (link_probe.probe_message_cost)."""
    import numpy as np

    from commsched.link_probe import _fastest_mpi_allreduce_s, probe_message_cost

    def fastest(nbytes: int, repeats: int) -> float:
        return _fastest_mpi_allreduce_s(comm, nbytes, repeats)

    cost = probe_message_cost(comm.Get_size(), fastest, bandwidth, latency_s)
    # Every rank takes the same branch: the probe's gate reads the `bandwidth` all ranks share.
    agreed = np.array(dataclasses.astuple(cost) if cost else (0.0, 0.0), np.float64)
    comm.Bcast(agreed, root=0)
    return MessageCost(float(agreed[0]), float(agreed[1])) if cost else None
