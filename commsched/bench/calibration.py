"""Raw MPI allreduce timings that calibrate `commsched-bench schedule`'s replay and simulator.

Each figure is the slowest rank's, agreed over the communicator, so every rank derives the same
compute scale and size-cost table from one measurement.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def slowest_per_iteration(comm: Any, periods: list[float]) -> list[float]:
    """Each iteration's period on the rank where it took longest."""
    import numpy as np
    from mpi4py import MPI

    slowest = np.empty(len(periods))
    comm.Allreduce(np.asarray(periods, dtype=np.float64), slowest, op=MPI.MAX)
    return slowest.tolist()


def raw_allreduce_s(comm: Any, nbytes: int, repeats: int) -> float:
    """Median over repeats of the slowest rank's time for one raw in-place MPI allreduce."""
    import numpy as np
    from mpi4py import MPI

    buffer = np.zeros(max(1, nbytes // 4), np.float32)
    comm.Allreduce(MPI.IN_PLACE, buffer)
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buffer)
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(samples)


_CALIBRATION_BYTES = 16 << 20  # moved per timing of one size (at least two messages)
_SMALLEST_CALIBRATED = 16 << 10
_MAX_CALIBRATION_IN_FLIGHT = 64


def raw_iallreduce_s(comm: Any, nbytes: int, count: int, in_flight: int, repeats: int) -> float:
    """Best over repeats of the slowest rank's time per message for `count` raw nonblocking
    allreduces, `in_flight` of them outstanding at a time (as the credit lets commsched's chunks)."""
    import numpy as np
    from mpi4py import MPI

    buffers = [np.zeros(max(1, nbytes // 4), np.float32) for _ in range(in_flight)]
    comm.Iallreduce(MPI.IN_PLACE, buffers[0]).Wait()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        requests: list[Any] = []
        for index in range(count):
            if len(requests) == in_flight:
                requests.pop(0).Wait()
            requests.append(comm.Iallreduce(MPI.IN_PLACE, buffers[index % in_flight]))
        MPI.Request.Waitall(requests)
        samples.append(comm.allreduce((time.perf_counter() - start) / count, op=MPI.MAX))
    return min(samples)  # interference on a shared machine only ever slows a run down


def measure_size_costs(
    comm: Any, total_bytes: int, credit_bytes: int, whole_s: float, small_s: float, repeats: int
) -> list[tuple[int, float]]:
    """Cost per byte of raw nonblocking allreduces by size (16 KiB up to all gradients, steps of 4x),
    relative to one blocking allreduce of all gradients: the simulator's size-cost table.

    MPI libraries change algorithm and pipelining with message size (MPICH over TCP at 3 ranks moves
    a byte in 64 KiB messages in 0.57 of the time it takes in one large one), and commsched sends
    partitioned and fused messages, as many at once as the credit allows, not one of everything.
    """
    costs = []
    size = _SMALLEST_CALIBRATED
    sizes = []
    while size < total_bytes:
        sizes.append(size)
        size *= 4
    sizes.append(total_bytes)
    for size in sizes:
        count = max(2, min(total_bytes, _CALIBRATION_BYTES) // size)
        # Capped: MPICH over TCP at 4 ranks hung in Waitall with 512 16 KiB Iallreduces outstanding
        # (--credit-bytes 8MiB); beyond a few dozen in flight the per-byte cost no longer changes.
        in_flight = max(1, min(count, credit_bytes // size, _MAX_CALIBRATION_IN_FLIGHT))
        per_message = raw_iallreduce_s(comm, size, count, in_flight, repeats)
        # The model charges a collective its latency (the 4-byte allreduce, hidden behind the
        # others when several are in flight) plus bytes at a rate: the factor makes the rate fit.
        wire_s = per_message - (small_s if in_flight == 1 else 0.0)
        costs.append((size, max(0.05, wire_s * total_bytes / (size * whole_s))))
    return costs
