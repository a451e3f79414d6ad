"""Default partition, credit, fusion and inline sizes fitted to a link's bandwidth, per-message
latency and allreduce algorithm (the rules the simulator chose; see benchmarks/choose_defaults.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from commsched import collective_model


@dataclass(frozen=True)
class DefaultRule:
    """Partition, credit and fusion sizes as a function of the link's ring delay (see default_sizes).

    Partition and credit are each `scale x (delay / 1 MiB) ** exponent`, rounded to a power of two;
    the constants are fitted by benchmarks/choose_defaults.py with the simulator over rank counts,
    bandwidths and latencies (docs/data/default_rule.json holds the fit and its table).
    """

    partition_scale_bytes: float
    partition_exponent: float
    min_partition_bytes: int
    max_partition_bytes: int
    credit_scale_bytes: float
    credit_exponent: float
    min_credit_partitions: int
    max_credit_partitions: int
    fusion_bytes: int


# Fitted by `python benchmarks/choose_defaults.py --keep-pinned --json docs/data/default_rule.json`
# with agreement rounds on the control channel, as they run across hosts: every constant searched
# among the rules that keep the sizes of the pinned links (choose_defaults.PINNED_LINKS: 2-4 ranks
# at 1 Gbit/s and 10-60 us, the shaped rig every replay figure was measured on, and 2-8 ranks at
# 10-100 Gbit/s and 2-20 us, one host or a few); within 1.11x (1.014x geometric mean) of each case's best grid setting over 2-1024 ranks,
# 1-100 Gbit/s, 2-50 us, where the rule before (partitions to 64 MiB, credit 1 MiB x delay/MiB)
# came within 1.24x (1.020x). Past ~4 MiB of delay the credit spans more partitions, not larger
# ones, so one finishes and frees credit for an urgent tensor sooner (1024 ranks, 100 Gbit/s, 5 us,
# 64 MiB of credit: 1.03-1.07 of the best schedule in 4 MiB partitions, up to 1.29 in 16 MiB).
# The credit grows as the delay ** 0.75: about the delay at 30 MiB (64 ranks, 100 Gbit/s, 20 us;
# half of it, 4 partitions of 4 MiB, was 1.27-1.36) and about half of it from ~120 MiB, where the
# whole delay in flight queued all of ResNet-50's 97.5 MiB of gradient ahead of its first layer's
# (1.101). Of 2-8 ranks, only links past 4 MiB of delay (4-8 ranks at 40-100 Gbit/s and 30-60 us,
# not measured) changed, from 8 MiB partitions to 4: in the simulator up to 1.1% faster (3.4% for
# ResNet-50 under NCCL at 4 ranks, 60 us), never more than 0.04% slower.
DEFAULT_RULE = DefaultRule(
    partition_scale_bytes=4 * 1024**2,
    partition_exponent=0.25,
    min_partition_bytes=256 * 1024,
    max_partition_bytes=4 * 1024**2,
    credit_scale_bytes=2 * 1024**2,
    credit_exponent=0.75,
    min_credit_partitions=4,
    max_credit_partitions=64,
    fusion_bytes=4 * 1024**2,
)
# The rule before's largest partition: the rule for rounds behind the data keeps it, and the most a
# partition grows to past the rule's largest (when the credit needs more than the most partitions,
# or NCCL turns to its ring above it: _ring_sized_under_nccl).
LARGEST_PARTITION_BYTES = 64 * 1024**2
# The rule fitted before rounds could leave the data's path in the simulator (choose_defaults.py with
# rounds queued behind the data, as --rounds data runs; at most 1.17x, 1.03x on geometric mean), for
# rounds in the transport's own connection (COMMSCHED_CONTROL_CHANNEL=transport): each round queues
# behind the bytes in flight, so credit comes back late and 8 x the delay keeps the link busy.
# Links with under ~2.5 MiB of delay (the 2-4-rank rig's) get the same sizes from both rules.
ROUNDS_ON_DATA_RULE = dataclasses.replace(
    DEFAULT_RULE,
    max_partition_bytes=LARGEST_PARTITION_BYTES,
    credit_scale_bytes=8 * 1024**2,
    credit_exponent=1.0,
)
ROUNDS = ("channel", "data")
_DELAY_UNIT_BYTES = 1024**2
# A partition or fused collective moves at least this many times the bytes the link could have
# carried during commsched's own fixed cost per collective (host work, its share of agreement,
# launch, completion), so that cost stays a few percent of the collective. On one host under
# mpiexec (2.1 GB/s, 1 us per message, commsched 14-25 us per collective) the VGG-16 replay at 1/16
# scale got the rule's 64 KiB partitions: 18550 launches in 36 iterations, priority 18.2 ms per
# iteration against fifo's 12.3. At 32 x the floor is 1 MiB: 1331 launches, 13.1 ms; at 16 x,
# 512 KiB, priority+overlap was still 0.89-1.0 of fifo+barrier.
OVERHEAD_FLOOR_FACTOR = 32
# Fusing a tensor copies it into the fused buffer and back out, on the core's thread. On links of
# 10 Gbit/s and more (one host's shared memory moved 4-5 GB/s here) those two copies take a quarter
# of the tensor's wire time or more, where a collective of its own would cost only the fixed cost
# per collective: a tensor is worth fusing there only while its copies cost less than that, so
# fusion stops at collective_overhead x HOST_COPY_BYTES_PER_S / 2 (fusion_copy_cap_bytes). The rate
# is one core's copy at the low end of what this host measured (14 GB/s for 6 MiB, hot). In the
# VGG-16, ResNet-50, BERT-base and GPT-2 medium replays on one host (2 ranks, MPICH shared memory)
# the fusion the overhead floor had raised to 2-4 MiB at 1/16 scale became 32-256 KiB and every
# schedule got faster (priority+overlap 5-20%, docs/measurements.md).
HOST_COPY_BYTES_PER_S = 10e9
COPY_CAPPED_LINK_BYTES_PER_S = HOST_COPY_BYTES_PER_S / 8


def ring_delay_bytes(ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Bytes the link could move while one ring allreduce pays its 2(n-1) message latencies."""
    return bandwidth_bytes_per_s * 2 * max(1, ranks - 1) * latency_s


def link_delay_bytes(
    ranks: int, bandwidth_bytes_per_s: float, latency_s: float, algorithm: str = "ring"
) -> float:
    """Bytes the link could move while one allreduce under a concrete `algorithm` pays its message
    latencies (collective_model.steps): ring_delay_bytes for the ring."""
    return bandwidth_bytes_per_s * collective_model.steps(algorithm, max(2, ranks)) * latency_s


def _power_of_two(value: float, low: int, high: int) -> int:
    """`value` rounded to the nearest power of two (in log scale), within [low, high]."""
    if not value > 0:
        return low
    return int(min(high, max(low, 2 ** round(math.log2(value)))))


def _scaled(scale_bytes: float, exponent: float, delay_bytes: float) -> float:
    """scale x (delay / 1 MiB) ** exponent: a constant at exponent 0, 0 for no delay otherwise."""
    if exponent == 0:
        return scale_bytes
    return scale_bytes * (max(delay_bytes, 0.0) / _DELAY_UNIT_BYTES) ** exponent


def _sizes_for_delay(delay: float, rule: DefaultRule, partition_bytes: int | None) -> dict[str, int]:
    """The rule's partition, credit and fusion for a link whose collectives wait `delay` bytes' time."""
    credit = _scaled(rule.credit_scale_bytes, rule.credit_exponent, delay)
    partition = _power_of_two(
        _scaled(rule.partition_scale_bytes, rule.partition_exponent, delay),
        rule.min_partition_bytes,
        rule.max_partition_bytes,
    )
    if partition == rule.max_partition_bytes:
        # Past its largest, the partition grows only so the credit fits in the most partitions.
        partition = _power_of_two(
            credit / rule.max_credit_partitions,
            partition,
            max(partition, LARGEST_PARTITION_BYTES),
        )
    if partition_bytes:  # the user's partition: credit still counts whole partitions of it
        partition = partition_bytes
    partitions = _power_of_two(
        credit / partition,
        rule.min_credit_partitions,
        rule.max_credit_partitions,
    )
    return {
        "partition_bytes": partition,
        "credit_bytes": partition * partitions,
        "fusion_bytes": rule.fusion_bytes,
    }


def default_sizes(
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    rule: DefaultRule | None = None,
    partition_bytes: int | None = None,
    algorithm: str = "ring",
    rounds: str = "channel",
    collective_overhead_s: float = 0.0,
    message_bandwidth_bytes_per_s: float | None = None,
    fused_in_host_memory: bool = True,
) -> dict[str, int]:
    """The default partition, credit and fusion sizes for a link (the fitted rule).

    Credit keeps the link busy while collectives in flight wait out their latency: it grows
    with the link's delay, the bytes the link moves during the message latencies of one
    allreduce under the transport's `algorithm` (collective_model; the ring's 2(n-1) at 1024
    ranks dwarf what a 2-rank job needs, halving-doubling's 2 log2 n do not). Partitions grow
    more slowly, so an urgent tensor still finds a chunk boundary soon. A given `partition_bytes`
    (not 0) is kept, and the credit counted in it. For a library's choice by size (mpich, nccl)
    the delay is that of the algorithm the library runs for a message of the partition picked
    under it: commsched's collectives are mostly whole partitions. Without a `rule`, the one for
    where agreement rounds travel: `rounds` "channel" (DEFAULT_RULE) or "data" (ROUNDS_ON_DATA_RULE).
    `collective_overhead_s` is commsched's own cost per collective beyond the wire's latency
    (measured: measure_collective_overhead in commsched.bench.schedule) plus the transport's own
    fixed cost per large message (fit_message_cost); on a fast link it sets a floor under partition
    and fusion (overhead_floor_bytes) at the rate partition-sized messages move,
    `message_bandwidth_bytes_per_s` (fit_message_cost; None: `bandwidth_bytes_per_s`), and the
    credit counts it. The floor stops at LARGEST_PARTITION_BYTES: with partitioning off where it
    reached that, GPT-2 medium's replay at 1/16 scale on one host lost priority's gain (priority+overlap
    0.99 of fifo+barrier, 1.22 with 1 MiB partitions), and VGG-16's stayed at 0.93-0.94. On links
    of COPY_CAPPED_LINK_BYTES_PER_S and more, fusion stops where a fused tensor's copies would cost
    more than that cost per collective (fusion_copy_cap_bytes), below the rule's size too, where
    fused buffers are copied in host memory (`fused_in_host_memory`; a GPU copies at its memory's rate).
    """
    sizes = _fitted_sizes(ranks, bandwidth_bytes_per_s, latency_s, rule, partition_bytes, algorithm, rounds)
    rate = message_bandwidth_bytes_per_s or bandwidth_bytes_per_s
    floor = overhead_floor_bytes(rate, collective_overhead_s)
    if floor > sizes["partition_bytes"] or floor > sizes["fusion_bytes"]:
        credit_partitions = max(1, sizes["credit_bytes"] // max(1, sizes["partition_bytes"]))
        partition = partition_bytes or max(sizes["partition_bytes"], floor)
        sizes = {
            "partition_bytes": partition,
            "credit_bytes": max(sizes["credit_bytes"], partition * credit_partitions),
            "fusion_bytes": max(sizes["fusion_bytes"], floor),
        }
    if fused_in_host_memory and collective_overhead_s > 0 and rate >= COPY_CAPPED_LINK_BYTES_PER_S:
        sizes["fusion_bytes"] = min(sizes["fusion_bytes"], fusion_copy_cap_bytes(collective_overhead_s))
    return sizes


@dataclass(frozen=True)
class MessageCost:
    """A transport's time for one allreduce of a large message: fixed_s + bytes / bandwidth."""

    bandwidth_bytes_per_s: float
    fixed_s: float


def fit_message_cost(samples: Sequence[tuple[float, float]]) -> MessageCost:
    """The least-squares line seconds = fixed + bytes / bandwidth through (bytes, seconds) samples of
    at least two sizes.

    A probe at one size sees the rate and the fixed cost mixed: on MPICH's shared memory (2 ranks,
    the 2-core host) a byte of a 1 MiB nonblocking allreduce cost 1.7-2.8 times one of a 16 MiB
    allreduce in three of four replays' size-cost tables, equal in the fourth. Noise can tilt the line below the origin (a
    bigger message cheaper per byte than the line allows) or flat: then no fixed cost is counted
    and the rate is the least-squares one through the origin.
    """
    points = [(float(size), float(seconds)) for size, seconds in samples]
    bad = [p for p in points if not (p[0] > 0 and p[1] > 0 and math.isfinite(p[0] + p[1]))]
    if bad:
        raise ValueError(f"message cost samples need bytes and seconds above 0, got {bad[0]}")
    if len({size for size, _ in points}) < 2:
        raise ValueError(f"a message cost fit needs samples at two sizes or more, got {points}")
    mean_size = sum(size for size, _ in points) / len(points)
    mean_s = sum(seconds for _, seconds in points) / len(points)
    spread = sum((size - mean_size) ** 2 for size, _ in points)
    slope = sum((size - mean_size) * (seconds - mean_s) for size, seconds in points) / spread
    fixed = mean_s - slope * mean_size
    if slope > 0 and fixed >= 0:
        return MessageCost(1.0 / slope, fixed)
    through_origin = sum(size * seconds for size, seconds in points) / sum(size**2 for size, _ in points)
    return MessageCost(1.0 / through_origin, 0.0)


def overhead_floor_bytes(bandwidth_bytes_per_s: float, collective_overhead_s: float) -> int:
    """The smallest partition and fusion size, a power of two, that keeps a per-collective cost of
    `collective_overhead_s` under 1/OVERHEAD_FLOOR_FACTOR of the collective's wire time (0: none)."""
    if not collective_overhead_s > 0 or not bandwidth_bytes_per_s > 0:
        return 0
    return _power_of_two(
        OVERHEAD_FLOOR_FACTOR * bandwidth_bytes_per_s * collective_overhead_s, 1, LARGEST_PARTITION_BYTES
    )


def fusion_copy_cap_bytes(collective_overhead_s: float) -> int:
    """The largest fusion size, a power of two up to LARGEST_PARTITION_BYTES, whose copies into and out
    of a fused buffer cost no more than the collective of its own they save (HOST_COPY_BYTES_PER_S);
    default_sizes caps fusion with it on links of COPY_CAPPED_LINK_BYTES_PER_S and more."""
    return _power_of_two(collective_overhead_s * HOST_COPY_BYTES_PER_S / 2, 1, LARGEST_PARTITION_BYTES)


def _fitted_sizes(
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    rule: DefaultRule | None,
    partition_bytes: int | None,
    algorithm: str,
    rounds: str,
) -> dict[str, int]:
    """default_sizes without the overhead floor: the fitted rule alone."""
    if rule is None:
        if rounds not in ROUNDS:
            raise ValueError(f"rounds must be one of {', '.join(ROUNDS)}, got {rounds!r}")
        rule = DEFAULT_RULE if rounds == "channel" else ROUNDS_ON_DATA_RULE
    choices = collective_model.LIBRARY_CHOICES.get(collective_model.check_algorithm(algorithm), (algorithm,))
    fitted = [
        _sizes_for_delay(link_delay_bytes(ranks, bandwidth_bytes_per_s, latency_s, c), rule, partition_bytes)
        for c in choices
    ]
    for concrete, sizes in zip(choices, fitted):
        chosen = collective_model.resolve(
            algorithm, sizes["partition_bytes"], max(2, ranks), bandwidth_bytes_per_s, latency_s
        )
        if chosen == concrete and algorithm == "nccl":
            return _ring_sized_under_nccl(
                sizes, ranks, bandwidth_bytes_per_s, latency_s, rule, partition_bytes
            )
        if chosen == concrete:
            return sizes
    return fitted[0]


def _ring_sized_under_nccl(
    sizes: dict[str, int],
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    rule: DefaultRule,
    partition_bytes: int | None,
) -> dict[str, int]:
    """Under NCCL's choice, partitions just below the size where NCCL turns from its tree to its ring
    move twice their bytes (the tree's) where one partition more would move 2(n-1)/n: the partition
    grows to the ring's smallest size when that is at most LARGEST_PARTITION_BYTES, past the rule's
    largest partition if need be (a partition the user set stays), and the credit then covers the
    ring's delay. At 8 ranks, 100 Gbit/s and 20 us NCCL turns to its ring at 8 MiB; the rule's 4 MiB
    on its tree were 1.06-1.14 of the best schedule, 8 MiB on its ring 1.00-1.02."""
    n = max(2, ranks)
    partition = sizes["partition_bytes"]
    if (
        partition_bytes
        or collective_model.resolve("nccl", partition, n, bandwidth_bytes_per_s, latency_s) != "tree"
    ):
        return sizes
    while partition < max(rule.max_partition_bytes, LARGEST_PARTITION_BYTES):
        partition *= 2
        if collective_model.resolve("nccl", partition, n, bandwidth_bytes_per_s, latency_s) == "ring":
            delay = link_delay_bytes(ranks, bandwidth_bytes_per_s, latency_s, "ring")
            return _sizes_for_delay(delay, rule, partition)
    return sizes


# The fitted inline limit starts from the fixed default before it; COMMSCHED_INLINE_BYTES goes up to
# MAX_INLINE_BYTES, and the core takes at most INLINE_ROUND_BUDGET_BYTES / ranks (every rank receives
# every rank's inline bytes in one round: kInlineRoundBudgetBytes in csrc/core/settings.h).
MIN_FITTED_INLINE_BYTES = 4 * 1024
MAX_INLINE_BYTES = 64 * 1024
INLINE_ROUND_BUDGET_BYTES = 256 * 1024


def inline_cap_bytes(ranks: int) -> int:
    """The largest power of two the core accepts as the inline limit at `ranks` ranks (0 past 256 Ki ranks)."""
    share = min(MAX_INLINE_BYTES, INLINE_ROUND_BUDGET_BYTES // max(2, ranks))
    return 1 << (share.bit_length() - 1) if share else 0


def default_inline_bytes(
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    credit_bytes: int,
    algorithm: str = "ring",
) -> int:
    """The largest power of two a tensor may have to ride in the agreement round, from 4 KiB (or the
    core's cap, when lower) to the core's cap (inline_cap_bytes).

    Inline, every rank receives the tensor from every other rank: (ranks - 1) times its bytes, in a
    round that runs anyway and, across hosts, on the control channel ahead of the data. Alone in a
    collective it would move the algorithm's own bytes, pay its message latencies, and first wait for
    the collectives in flight, up to `credit_bytes` of them: the tensor the next forward needs first
    (a CNN's first layer, small and ready last) waited that long on the rig. A tensor goes inline
    while the bytes it adds over the collective's take no longer than those latencies and that wait.
    """
    n = max(2, ranks)
    size = inline_cap_bytes(n)
    while size > MIN_FITTED_INLINE_BYTES:
        concrete = collective_model.resolve(algorithm, size, n, bandwidth_bytes_per_s, latency_s)
        added = (n - 1) * size - collective_model.wire_bytes(concrete, size, n)
        saved = link_delay_bytes(n, bandwidth_bytes_per_s, latency_s, concrete) + credit_bytes
        if added <= saved:
            break
        size //= 2
    return size
