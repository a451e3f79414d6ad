"""The transport's fixed cost per large message: its fit from timings at two sizes, the probe that
runs only on fast links, and the sizes default_sizes and the replay derive from it."""

from __future__ import annotations

import argparse

import pytest

from commsched.link_defaults import (
    LARGEST_PARTITION_BYTES,
    MessageCost,
    default_sizes,
    fit_message_cost,
    fusion_copy_cap_bytes,
    overhead_floor_bytes,
)
from commsched.link_probe import probe_message_cost

MIB = 1 << 20


def _line(fixed_s: float, rate: float, sizes: tuple[int, ...]) -> list[tuple[int, float]]:
    return [(size, fixed_s + size / rate) for size in sizes]


def test_the_fit_gives_back_the_line_the_timings_follow() -> None:
    """Times on a line fixed + bytes / rate give back its rate and fixed cost, from two sizes or more."""
    for sizes in ((MIB, 16 * MIB), (MIB, 4 * MIB, 16 * MIB)):
        fit = fit_message_cost(_line(300e-6, 5e9, sizes))
        assert fit.bandwidth_bytes_per_s == pytest.approx(5e9)
        assert fit.fixed_s == pytest.approx(300e-6)
    # The replay's size costs of 2026-11-27 (VGG-16, 1/16 scale, MPICH shared memory): a byte of
    # 1 MiB at 0.45 ns, of 16 MiB at 0.16 ns. A 1 MiB probe alone read 2.2 GB/s; the line says a
    # fixed 0.32 ms per message at 7.1 GB/s.
    fit = fit_message_cost([(MIB, 0.45e-9 * MIB), (16 * MIB, 0.16e-9 * 16 * MIB)])
    assert 6e9 < fit.bandwidth_bytes_per_s < 7.5e9 and 280e-6 < fit.fixed_s < 330e-6


def test_noise_below_the_origin_counts_no_fixed_cost() -> None:
    """A bigger message dearer per byte than a line through zero allows (or one that took less time)
    is noise: no fixed cost, and the rate through the origin lies between the samples' own rates."""
    for samples in ([(MIB, 200e-6), (16 * MIB, 4000e-6)], [(MIB, 2e-3), (16 * MIB, 1e-3)]):
        fit = fit_message_cost(samples)
        assert fit.fixed_s == 0.0
        rates = [size / seconds for size, seconds in samples]
        assert min(rates) <= fit.bandwidth_bytes_per_s <= max(rates)


@pytest.mark.parametrize(
    ("samples", "words"),
    [
        ([(MIB, 1e-3)], "two sizes"),
        ([(MIB, 1e-3), (MIB, 2e-3)], "two sizes"),
        ([(MIB, 1e-3), (16 * MIB, 0.0)], "above 0"),
        ([(0, 1e-3), (16 * MIB, 1e-3)], "above 0"),
        ([(MIB, float("nan")), (16 * MIB, 1e-3)], "above 0"),
    ],
)
def test_the_fit_refuses_what_no_line_can_come_from(samples: list[tuple[int, float]], words: str) -> None:
    """One size, or a size or time that is not above 0, is refused naming what is wrong."""
    with pytest.raises(ValueError, match=words):
        fit_message_cost(samples)


def test_the_floor_stops_at_the_largest_partition() -> None:
    """However large the cost per collective, partitions stop at 64 MiB and the credit counts as many
    of them as the rule gave; a given partition stays, with the credit the rule counts in it."""
    fitted = default_sizes(2, 5e9, 2e-6)
    ratio = fitted["credit_bytes"] // fitted["partition_bytes"]
    # 32 x 5 GB/s x 300 us = 48 MB: the nearest power of two is 64 MiB; 3 ms would ask for 480 MB.
    for overhead in (300e-6, 3e-3):
        assert overhead_floor_bytes(5e9, overhead) == LARGEST_PARTITION_BYTES
        assert default_sizes(2, 5e9, 2e-6, collective_overhead_s=overhead) == {
            "partition_bytes": LARGEST_PARTITION_BYTES,
            "credit_bytes": LARGEST_PARTITION_BYTES * ratio,
            "fusion_bytes": fusion_copy_cap_bytes(overhead),
        }
    given = default_sizes(2, 5e9, 2e-6, partition_bytes=MIB, collective_overhead_s=300e-6)
    assert given["partition_bytes"] == MIB and given["credit_bytes"] == MIB * ratio
    # Half that cost: a 32 MiB floor.
    assert default_sizes(2, 5e9, 2e-6, collective_overhead_s=150e-6)["partition_bytes"] == 32 * MIB


def test_the_floor_runs_at_the_rate_large_messages_move() -> None:
    """The floor counts the bytes the link moves at the message rate the fit measured, not the
    rate of the probe that mixed the fixed cost in."""
    slow_probe = default_sizes(2, 2e9, 2e-6, collective_overhead_s=100e-6)
    at_message_rate = default_sizes(
        2, 2e9, 2e-6, collective_overhead_s=100e-6, message_bandwidth_bytes_per_s=8e9
    )
    assert slow_probe["partition_bytes"] == overhead_floor_bytes(2e9, 100e-6)
    assert (
        at_message_rate["partition_bytes"]
        == overhead_floor_bytes(8e9, 100e-6)
        > slow_probe["partition_bytes"]
    )
    # The rig's links (1 Gbit/s, tens of us) keep the rule's sizes with or without it.
    for ranks, latency in ((2, 10e-6), (4, 60e-6)):
        assert default_sizes(ranks, 1.25e8, latency, collective_overhead_s=20e-6) == default_sizes(
            ranks, 1.25e8, latency
        )


def test_the_probe_times_two_sizes_on_fast_links_only() -> None:
    """A link that needs 2 ms or more for 1 MiB is not probed further; a fast one is timed at 1 and
    16 MiB and its fixed cost is what the line gives less the algorithm's message latencies, its
    rate in wire bytes (a 4-rank ring moves 2 x 3/4 of the payload)."""
    asked: list[int] = []

    def fastest(nbytes: int, repeats: int) -> float:
        asked.append(nbytes)
        return 400e-6 + nbytes / 4e9

    assert probe_message_cost(2, fastest, 4e8, 20e-6) is None  # 1 MiB takes 2.6 ms
    assert asked == []
    cost = probe_message_cost(4, fastest, 4e9, 5e-6, "ring")
    assert sorted(set(asked)) == [MIB, 16 * MIB]
    assert isinstance(cost, MessageCost)
    assert cost.fixed_s == pytest.approx(400e-6 - 6 * 5e-6)
    assert cost.bandwidth_bytes_per_s == pytest.approx(4e9 * 1.5)
    # Timings with no fixed cost beyond the latencies count none.
    flat = probe_message_cost(2, lambda n, r: 2 * 5e-6 + n / 4e9, 4e9, 5e-6)
    assert flat is not None and flat.fixed_s == pytest.approx(0.0, abs=1e-12)


def test_the_replay_counts_the_message_cost_at_full_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """commsched-bench schedule at --scale 16: the transport's fixed cost per message weighs 16 times as
    much against the full model's collectives, as commsched's own does, at the message rate: 300 us
    at 5 GB/s lifts 256 KiB partitions to the largest, 64 MiB / 16."""
    from commsched.bench.schedule import _replay_sizes

    for name in ("PARTITION", "CREDIT", "FUSION", "INLINE"):
        monkeypatch.delenv(f"COMMSCHED_{name}_BYTES", raising=False)
    args = argparse.Namespace(
        partition_bytes=None, credit_bytes=None, fusion_bytes=None, inline_bytes=None, scale=16.0
    )
    plain = _replay_sizes(args, 2, 2e9, 2e-6, 5e-6)
    full = default_sizes(2, 2e9, 2e-6, collective_overhead_s=80e-6)["partition_bytes"]
    assert plain["partition_bytes"] == full // 16 == 256 * 1024  # 32 x 2 GB/s x 80 us: 4 MiB
    costly = _replay_sizes(args, 2, 2e9, 2e-6, 5e-6, MessageCost(5e9, 300e-6))
    assert costly["partition_bytes"] == LARGEST_PARTITION_BYTES // 16
    # Fusion stops where a fused tensor's copies cost more than the collective they save.
    assert costly["fusion_bytes"] == fusion_copy_cap_bytes(16 * 305e-6) // 16
    # Only the rate changes: 5 us at 8 GB/s instead of 2 GB/s, four times the floor.
    faster = _replay_sizes(args, 2, 2e9, 2e-6, 5e-6, MessageCost(8e9, 0.0))
    assert faster["partition_bytes"] == 4 * plain["partition_bytes"]
