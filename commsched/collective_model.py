"""Closed-form cost of one allreduce under the algorithms transports run (the simulator's model).

Per message of m bytes on n ranks, p the largest power of two <= n:

- ring: 2(n-1) message latencies, 2(n-1)/n m bytes on each rank's link (Gloo, torch's Gloo group,
  commsched's gRPC ring).
- recursive-doubling: log2 p latencies, the whole message at each step.
- halving-doubling (Rabenseifner): recursive-halving reduce-scatter then recursive-doubling
  allgather, 2 log2 p latencies and 2(p-1)/p m bytes.
  When n is not a power of two, both fold the n-p surplus ranks in and out: MPICH sends each of them
  the whole message to a partner and back, 2 more latencies and 2m more bytes.
- tree: NCCL's double binary tree as NCCL's own tuning models it, 2 floor(log2 n) latencies and 2m.
- mpich: MPICH's choice, recursive doubling up to 2048 bytes (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE) or
  with fewer elements than p, halving-doubling above.
- nccl: NCCL's choice, whichever of ring and tree takes less time for the message.

csrc/sim/network.cc holds the simulator's copy; tests keep the two in agreement.
"""

from __future__ import annotations

ALGORITHMS = ("ring", "recursive-doubling", "halving-doubling", "tree", "mpich", "nccl")
# The algorithms each library's choice picks from, the one its large messages use first.
LIBRARY_CHOICES = {"mpich": ("halving-doubling", "recursive-doubling"), "nccl": ("tree", "ring")}
MPICH_SHORT_MESSAGE_BYTES = 2048
_FLOAT32_BYTES = 4


def check_algorithm(algorithm: str) -> str:
    """`algorithm` if the model knows it, else a ValueError naming the accepted ones."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"allreduce algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return algorithm


def _power_of_two_log2(ranks: int) -> int:
    """log2 of the largest power of two <= ranks."""
    return max(1, ranks).bit_length() - 1


def steps(algorithm: str, ranks: int) -> float:
    """Sequential message latencies of one allreduce under a concrete algorithm (not a library's choice)."""
    log2 = _power_of_two_log2(ranks)
    fold = 0 if ranks == 1 << log2 else 2
    return {
        "ring": 2.0 * (ranks - 1),
        "recursive-doubling": float(log2 + fold),
        "halving-doubling": float(2 * log2 + fold),
        "tree": 2.0 * log2,
    }[check_concrete(algorithm)]


def wire_bytes(algorithm: str, nbytes: float, ranks: int) -> float:
    """Bytes on each rank's link for one allreduce of `nbytes` under a concrete algorithm."""
    log2 = _power_of_two_log2(ranks)
    power = 1 << log2
    fold = 0.0 if ranks == power else 2.0 * nbytes
    return {
        "ring": 2.0 * (ranks - 1) / ranks * nbytes,
        "recursive-doubling": log2 * nbytes + fold,
        "halving-doubling": 2.0 * (power - 1) / power * nbytes + fold,
        "tree": 2.0 * nbytes,
    }[check_concrete(algorithm)]


def check_concrete(algorithm: str) -> str:
    """`algorithm` if it is one algorithm, not a library's choice between several."""
    if check_algorithm(algorithm) in LIBRARY_CHOICES:
        raise ValueError(f"{algorithm!r} is a library's choice by size; resolve it first (resolve())")
    return algorithm


def resolve(algorithm: str, nbytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> str:
    """The concrete algorithm `algorithm` runs for a message of `nbytes` (itself unless a library's choice)."""
    if check_algorithm(algorithm) == "mpich":
        short = nbytes <= MPICH_SHORT_MESSAGE_BYTES or nbytes // _FLOAT32_BYTES < 1 << _power_of_two_log2(
            ranks
        )
        return "recursive-doubling" if short else "halving-doubling"
    if algorithm == "nccl":
        ring, tree = (alone_s(a, nbytes, ranks, bandwidth_bytes_per_s, latency_s) for a in ("ring", "tree"))
        return "tree" if tree < ring else "ring"
    return algorithm


def alone_s(
    algorithm: str, nbytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Seconds of one allreduce alone on the link (a library's choice resolved for this size)."""
    concrete = resolve(algorithm, nbytes, ranks, bandwidth_bytes_per_s, latency_s)
    return steps(concrete, ranks) * latency_s + wire_bytes(concrete, nbytes, ranks) / bandwidth_bytes_per_s
