"""Fits the scheduling defaults to the link at init, measured with a few timed allreduces.

The default partition, credit and fusion sizes follow the link (config.default_sizes), so init()
needs its bandwidth and per-message latency: from COMMSCHED_LINK_BANDWIDTH / _LATENCY, or timed
before the core starts (MPI or Gloo). A tiny allreduce times the latency, a larger one the
bandwidth; every rank then takes rank 0's figures, so every rank derives the same defaults.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from commsched.config import Settings, default_sizes

log = logging.getLogger("commsched")

# Small enough to cost a few milliseconds at 1 Gbit/s, big enough that its bytes outweigh its latency.
_BANDWIDTH_PROBE_BYTES = 1 << 20
_LATENCY_REPEATS = 5
_BANDWIDTH_REPEATS = 2


def _fastest_mpi_allreduce_s(communicator: Any, nbytes: int, repeats: int) -> float:
    """The fastest of `repeats` allreduces of `nbytes`, each started together on every rank."""
    from mpi4py import MPI

    array = np.zeros(max(1, nbytes // 4), np.float32)
    out = np.empty_like(array)
    fastest = math.inf
    for _ in range(repeats):
        communicator.Barrier()
        start = time.perf_counter()
        communicator.Allreduce(array, out, op=MPI.SUM)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def measure_mpi(comm: Any = None) -> tuple[float, float]:
    """(bandwidth in bytes/s, per-message latency in s) over MPI, rank 0's figures on every rank."""
    from mpi4py import MPI

    # A duplicate keeps the probe's messages apart from anything the caller has in flight.
    communicator = (MPI.COMM_WORLD if comm is None else comm).Dup()
    try:
        link = _measure(communicator.Get_size(), lambda n, r: _fastest_mpi_allreduce_s(communicator, n, r))
        agreed = np.array(link, np.float64)
        communicator.Bcast(agreed, root=0)
        return float(agreed[0]), float(agreed[1])
    finally:
        communicator.Free()


def measure_torch(group: Any = None) -> tuple[float, float] | None:
    """(bandwidth in bytes/s, per-message latency in s) over a torch.distributed group, the group's
    first rank's figures on every rank; None unless the group runs Gloo (host tensors)."""
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    if dist.get_backend(group) != "gloo":
        return None

    def fastest(nbytes: int, repeats: int) -> float:
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        best = math.inf
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            best = min(best, time.perf_counter() - start)
        return best

    link = _measure(dist.get_world_size(group), fastest)
    agreed = torch.tensor(link, dtype=torch.float64)
    dist.broadcast(agreed, src=dist.get_process_group_ranks(group)[0], group=group)
    return float(agreed[0]), float(agreed[1])


def _measure(ranks: int, fastest_allreduce_s: Callable[[int, int], float]) -> tuple[float, float]:
    """This rank's view of the link from a tiny and a bigger allreduce."""
    tiny_s = fastest_allreduce_s(4, _LATENCY_REPEATS)
    big_s = fastest_allreduce_s(_BANDWIDTH_PROBE_BYTES, _BANDWIDTH_REPEATS)
    return link_from_timings(ranks, tiny_s, big_s, _BANDWIDTH_PROBE_BYTES)


def link_from_timings(ranks: int, tiny_s: float, big_s: float, big_bytes: int) -> tuple[float, float]:
    """Bandwidth and latency of the simulator's ring model from a tiny and a big allreduce's times.

    The model charges a ring allreduce 2(n-1) message latencies plus 2(n-1)/n of its bytes at
    the link rate, so the tiny one gives the latency and the difference the rate.
    """
    steps = 2 * (max(2, ranks) - 1)
    latency = max(tiny_s, 0.0) / steps
    wire_bytes = 2.0 * (max(2, ranks) - 1) / max(2, ranks) * big_bytes
    bandwidth = wire_bytes / max(big_s - tiny_s, 1e-7)
    return bandwidth, latency


_SIZE_SETTINGS = ("partition_bytes", "credit_bytes", "fusion_bytes")


def fit_to_link(
    settings: Settings, user_given: frozenset[str], kind: str, comm: Any, process_group: Any, size: int
) -> Settings:
    """`settings` with the sizes the user left unset taken from the link (default_sizes).

    Without link settings and without a transport to time (gRPC, NCCL), the static defaults stay.
    """
    unset = [name for name in _SIZE_SETTINGS if name not in user_given]
    if size < 2 or not unset:
        return settings
    bandwidth, latency = settings.link_bandwidth, settings.link_latency
    if (bandwidth is None or latency is None) and kind in ("mpi", "gloo"):
        measured = measure_mpi(comm) if kind == "mpi" else measure_torch(process_group)
        if measured is not None:
            bandwidth = measured[0] if bandwidth is None else bandwidth
            latency = measured[1] if latency is None else latency
    if bandwidth is None or latency is None:
        return settings
    given_partition = settings.partition_bytes if "partition_bytes" in user_given else None
    sizes = default_sizes(size, bandwidth, latency, partition_bytes=given_partition)
    log.info(
        "link %.3g Gbit/s, %.3g us per message at %d ranks: %s",
        bandwidth * 8e-9,
        latency * 1e6,
        size,
        ", ".join(f"{name}={sizes[name]}" for name in unset),
    )
    return dataclasses.replace(
        settings, link_bandwidth=bandwidth, link_latency=latency, **{name: sizes[name] for name in unset}
    )
