"""Fits the scheduling defaults to the link at init, measured with a few timed allreduces.

The default partition, credit, fusion and inline sizes follow the link (link_defaults.default_sizes and
default_inline_bytes), so init() needs its bandwidth and per-message latency: from
COMMSCHED_LINK_BANDWIDTH / _LATENCY, or timed
before the core starts (MPI or Gloo). A tiny allreduce times the latency, a larger one the
bandwidth; every rank then takes rank 0's figures, so every rank derives the same defaults.

The latency the credit has to cover is that of the allreduce algorithm the transport runs
(collective_model), so each transport names its algorithm (transport_algorithm): MPI runs
MPICH's choice unless an MPIR_CVAR forces one (the rig forces the ring), Gloo and commsched's
gRPC run a ring, NCCL its choice of ring or tree. The probe divides the tiny allreduce by the
latencies of the algorithm run for it, and default_sizes multiplies back by those of the
algorithm run for a partition: under MPICH's choice 2 log2 n (halving-doubling) rather than a
ring's 2(n-1). Other MPI libraries keep the ring model: their tuned choices are not modelled.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from commsched import collective_model
from commsched.config import Settings
from commsched.error_text import first_line
from commsched.link_defaults import MessageCost, default_inline_bytes, default_sizes, fit_message_cost

log = logging.getLogger("commsched")

# Small enough to cost a few milliseconds at 1 Gbit/s, big enough that its bytes outweigh its latency.
_BANDWIDTH_PROBE_BYTES = 1 << 20
_LATENCY_REPEATS = 5
_BANDWIDTH_REPEATS = 2
_TINY_PROBE_BYTES = 4
# On a link whose 1 MiB probe took under _SIZE_PROBE_MAX_S (one host, NVLink, 10 Gbit/s and up), a
# probe at _LARGE_PROBE_BYTES too fits the transport's fixed cost per message (fit_message_cost);
# slower links, the shaped rig's 1 Gbit/s among them, skip it: their partitions follow the wire.
_SIZE_PROBE_MAX_S = 2e-3
_LARGE_PROBE_BYTES = 16 << 20
_SIZE_PROBE_REPEATS = 5
# MPICH's algorithm variables (MPIR_CVAR_*ALLREDUCE_INTRA_ALGORITHM) by the model that stands for them.
_MPICH_FORCED = (
    ("ring", "ring"),
    ("recursive_doubling", "recursive-doubling"),
    ("scatter_allgather", "halving-doubling"),
)


def mpich_algorithm(variable: str, environ: dict[str, str] | None = None, library: str = "MPICH") -> str:
    """The model of the allreduce MPICH runs under `variable` (an MPIR_CVAR_*_INTRA_ALGORITHM name):
    the algorithm it forces, MPICH's own choice by size when unset (or auto), the ring for a
    library that is not MPICH (`library`: MPI_Get_library_version's text)."""
    if not library.startswith("MPICH"):
        return "ring"
    forced = (os.environ if environ is None else environ).get(variable, "").strip().lower()
    return next((model for key, model in _MPICH_FORCED if key in forced), "mpich")


def _mpi_library() -> str:
    """MPI_Get_library_version's text (empty without mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return ""
    return str(MPI.Get_library_version())


def transport_algorithm(kind: str, environ: dict[str, str] | None = None, library: str | None = None) -> str:
    """The allreduce algorithm (collective_model) the transport `kind` runs for commsched's collectives."""
    if kind == "mpi":  # the transport's collectives are nonblocking
        library = _mpi_library() if library is None else library
        return mpich_algorithm("MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM", environ, library)
    return "nccl" if kind == "nccl" else "ring"


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


def measure_mpi(comm: Any = None) -> tuple[float, float, float]:
    """(bandwidth in bytes/s, per-message latency in s, fixed cost per large message in s, 0 on slow
    links: probe_message_cost) over MPI, rank 0's figures on every rank."""
    from mpi4py import MPI

    # A duplicate keeps the probe's messages apart from anything the caller has in flight.
    communicator = (MPI.COMM_WORLD if comm is None else comm).Dup()
    try:
        # The probe's allreduces are blocking: their own variable says what MPICH runs for them.
        algorithm = mpich_algorithm("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", library=_mpi_library())
        ranks = communicator.Get_size()

        def fastest(nbytes: int, repeats: int) -> float:
            return _fastest_mpi_allreduce_s(communicator, nbytes, repeats)

        def agree(*figures: float) -> list[float]:
            agreed = np.array(figures, np.float64)
            communicator.Bcast(agreed, root=0)
            return [float(value) for value in agreed]

        bandwidth, latency = agree(*_measure(ranks, fastest, algorithm))
        # Every rank decides on rank 0's figures, so all run the larger probe or none.
        cost = probe_message_cost(ranks, fastest, bandwidth, latency, algorithm)
        return bandwidth, latency, agree(cost.fixed_s if cost else 0.0)[0]
    finally:
        communicator.Free()


def probe_message_cost(
    ranks: int,
    fastest_allreduce_s: Callable[[int, int], float],
    bandwidth: float,
    latency: float,
    algorithm: str = "ring",
) -> MessageCost | None:
    """The transport's rate for large allreduces (wire bytes per second) and its fixed cost per
    allreduce beyond the algorithm's message latencies, from a line through its times at 1 MiB and
    16 MiB (fit_message_cost); None, without probing, on a link whose `bandwidth` needs
    _SIZE_PROBE_MAX_S or more for 1 MiB (so every rank given the same `bandwidth` does the same)."""
    n = max(2, ranks)
    small = collective_model.resolve(algorithm, _BANDWIDTH_PROBE_BYTES, n, bandwidth, latency)
    if not collective_model.wire_bytes(small, _BANDWIDTH_PROBE_BYTES, n) / bandwidth < _SIZE_PROBE_MAX_S:
        return None
    sizes = (_BANDWIDTH_PROBE_BYTES, _LARGE_PROBE_BYTES)
    fit = fit_message_cost([(size, fastest_allreduce_s(size, _SIZE_PROBE_REPEATS)) for size in sizes])
    large = collective_model.resolve(algorithm, _LARGE_PROBE_BYTES, n, bandwidth, latency)
    wire_share = collective_model.wire_bytes(large, _LARGE_PROBE_BYTES, n) / _LARGE_PROBE_BYTES
    return MessageCost(
        fit.bandwidth_bytes_per_s * wire_share,
        max(0.0, fit.fixed_s - collective_model.steps(large, n) * latency),
    )


def measure_torch(group: Any = None) -> tuple[float, float, float] | None:
    """(bandwidth in bytes/s, per-message latency in s, fixed cost per large message in s) over a
    torch.distributed group, the group's first rank's figures on every rank; None unless the group
    runs Gloo (host tensors)."""
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

    def agree(*figures: float) -> list[float]:
        agreed = torch.tensor(figures, dtype=torch.float64)
        dist.broadcast(agreed, src=dist.get_process_group_ranks(group)[0], group=group)
        return [float(value) for value in agreed]

    ranks, algorithm = dist.get_world_size(group), transport_algorithm("gloo")
    bandwidth, latency = agree(*_measure(ranks, fastest, algorithm))
    cost = probe_message_cost(ranks, fastest, bandwidth, latency, algorithm)
    return bandwidth, latency, agree(cost.fixed_s if cost else 0.0)[0]


def _measure(
    ranks: int, fastest_allreduce_s: Callable[[int, int], float], algorithm: str = "ring"
) -> tuple[float, float]:
    """This rank's view of the link from a tiny and a bigger allreduce."""
    tiny_s = fastest_allreduce_s(_TINY_PROBE_BYTES, _LATENCY_REPEATS)
    big_s = fastest_allreduce_s(_BANDWIDTH_PROBE_BYTES, _BANDWIDTH_REPEATS)
    return link_from_timings(ranks, tiny_s, big_s, _BANDWIDTH_PROBE_BYTES, algorithm, _TINY_PROBE_BYTES)


def link_from_timings(
    ranks: int, tiny_s: float, big_s: float, big_bytes: int, algorithm: str = "ring", tiny_bytes: int = 4
) -> tuple[float, float]:
    """Bandwidth and per-message latency of the simulator's model of `algorithm` from a tiny and a
    big allreduce's times.

    The model charges an allreduce its algorithm's message latencies plus its wire bytes at the
    link rate (collective_model): the tiny one, whose bytes are negligible, gives the latency, and
    the big one less its latencies the rate. For the ring: tiny / 2(n-1), and the rate from
    2(n-1)/n of the big one's bytes over the difference of the two.
    """
    n = max(2, ranks)
    # A tiny message is latency-bound: a library's choice takes its algorithm with the fewest latencies.
    tiny = collective_model.resolve(algorithm, tiny_bytes, n, math.inf, 1.0)
    latency = max(tiny_s, 0.0) / collective_model.steps(tiny, n)
    # Under NCCL's choice the big one's algorithm depends on the rate; the ring's estimate picks it.
    rough = collective_model.wire_bytes("ring", big_bytes, n) / max(big_s - 2 * (n - 1) * latency, 1e-7)
    big = collective_model.resolve(algorithm, big_bytes, n, rough, latency)
    wire_bytes = collective_model.wire_bytes(big, big_bytes, n)
    bandwidth = wire_bytes / max(big_s - collective_model.steps(big, n) * latency, 1e-7)
    return bandwidth, latency


_SIZE_SETTINGS = ("partition_bytes", "credit_bytes", "fusion_bytes", "inline_bytes")


def rounds_path(control_channel: str, kind: str) -> str:
    """Where agreement rounds travel relative to the data (link_defaults.default_sizes' `rounds`): "data" when
    COMMSCHED_CONTROL_CHANNEL=transport puts them in a host transport's own connection, behind its
    bytes; "channel" otherwise (the TCP channel, one host's shared memory, or NCCL's data on the device)."""
    return "data" if control_channel == "transport" and kind != "nccl" else "channel"


def fit_to_link(
    settings: Settings,
    user_given: frozenset[str],
    kind: str,
    comm: Any,
    process_group: Any,
    size: int,
    device_memory: bool = False,
) -> Settings:
    """`settings` with the sizes the user left unset taken from the link (default_sizes) and the
    allreduce algorithm the transport `kind` runs (transport_algorithm). `device_memory`: the
    collectives' buffers, fused ones too, live on a GPU (a CUDA-aware MPI), whose copies do not cap fusion.

    Without link settings and without a transport to time (gRPC, NCCL), the static defaults stay.
    """
    unset = [name for name in _SIZE_SETTINGS if name not in user_given]
    if size < 2:
        # One rank has no link to cut collectives for: a partition would only add launches.
        if "partition_bytes" in user_given:
            return settings
        return dataclasses.replace(settings, partition_bytes=0)
    if not unset:
        return settings
    bandwidth, latency = settings.link_bandwidth, settings.link_latency
    message_cost = settings.link_message_cost
    if (bandwidth is None or latency is None) and kind in ("mpi", "gloo"):
        try:
            measured = measure_mpi(comm) if kind == "mpi" else measure_torch(process_group)
        except RuntimeError as error:  # Gloo's error names an address, not the rank
            first = first_line(error)
            raise RuntimeError(
                f"commsched.init(): a rank was lost while the {size} ranks measured their link ({first}): "
                "it ended or lost contact before commsched started (its launcher's output names it)"
            ) from error
        if measured is not None:
            bandwidth = measured[0] if bandwidth is None else bandwidth
            latency = measured[1] if latency is None else latency
            message_cost = measured[2] if message_cost is None else message_cost
    message_cost = message_cost or 0.0  # a link given by variables is not probed for it
    if bandwidth is None or latency is None:
        return settings
    given_partition = settings.partition_bytes if "partition_bytes" in user_given else None
    algorithm = transport_algorithm(kind)
    rounds = rounds_path(settings.control_channel, kind)
    sizes: dict[str, int] = default_sizes(
        size,
        bandwidth,
        latency,
        partition_bytes=given_partition,
        algorithm=algorithm,
        rounds=rounds,
        # The transport's own fixed cost per large message weighs on a partition as commsched's does.
        collective_overhead_s=settings.collective_overhead + message_cost,
        fused_in_host_memory=not device_memory,
    )
    if "credit_bytes" in user_given:
        sizes["credit_bytes"] = settings.credit_for(size)
    sizes["inline_bytes"] = default_inline_bytes(size, bandwidth, latency, sizes["credit_bytes"], algorithm)
    log.info(
        "link %.3g Gbit/s, %.3g us per message (%.3g us more per large one) at %d ranks, %s allreduce: %s",
        bandwidth * 8e-9,
        latency * 1e6,
        message_cost * 1e6,
        size,
        algorithm,
        ", ".join(f"{name}={sizes[name]}" for name in unset),
    )
    return dataclasses.replace(
        settings,
        link_bandwidth=bandwidth,
        link_latency=latency,
        link_message_cost=message_cost,
        **{name: sizes[name] for name in unset},
    )
