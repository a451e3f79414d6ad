"""Defaults from the link: the fitted rule (link_defaults.default_sizes) and how init() applies it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import run_ranks

from commsched.config import SettingError, Settings, parse_rate, resolve
from commsched.link_defaults import (
    DEFAULT_RULE,
    LARGEST_PARTITION_BYTES,
    ROUNDS_ON_DATA_RULE,
    DefaultRule,
    default_inline_bytes,
    default_sizes,
    link_delay_bytes,
)
from commsched.link_probe import link_from_timings, rounds_path

ROOT = Path(__file__).resolve().parents[1]
RANKS = [2, 3, 8, 64, 1024, 4096]
RATES = [1e8, 1.25e8, 1.25e9, 1.25e10, 5e10]
LATENCIES = [0.0, 1e-6, 5e-6, 20e-6, 1e-4]
MIB = 1024**2


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def test_the_rule_grows_with_ranks_bandwidth_and_latency() -> None:
    """Partition and credit never shrink when any of the three grows; all sizes stay in the rule's clamps,
    a partition past the rule's largest only where the credit fills (about) the most partitions."""
    for ranks, rate, latency in itertools.product(RANKS, RATES, LATENCIES):
        sizes = default_sizes(ranks, rate, latency)
        assert DEFAULT_RULE.min_partition_bytes <= sizes["partition_bytes"] <= LARGEST_PARTITION_BYTES
        partitions = sizes["credit_bytes"] // sizes["partition_bytes"]
        assert sizes["credit_bytes"] == partitions * sizes["partition_bytes"]
        assert DEFAULT_RULE.min_credit_partitions <= partitions <= DEFAULT_RULE.max_credit_partitions
        if sizes["partition_bytes"] > DEFAULT_RULE.max_partition_bytes:
            assert partitions >= DEFAULT_RULE.max_credit_partitions // 2, (ranks, rate, latency, sizes)
        assert _is_power_of_two(sizes["partition_bytes"]) and _is_power_of_two(partitions)
        assert sizes["fusion_bytes"] == DEFAULT_RULE.fusion_bytes
        for bigger in (
            (ranks * 2, rate, latency),
            (ranks, rate * 2, latency),
            (ranks, rate, latency * 2 + 1e-6),
        ):
            grown = default_sizes(*bigger)
            assert grown["partition_bytes"] >= sizes["partition_bytes"], (bigger, grown, sizes)
            assert grown["credit_bytes"] >= sizes["credit_bytes"], (bigger, grown, sizes)


def test_the_rule_depends_on_the_ring_delay_only() -> None:
    """Two links with the same bandwidth x 2(n-1) x latency get the same sizes."""
    assert default_sizes(9, 1.25e9, 20e-6) == default_sizes(5, 1.25e9, 40e-6) == default_sizes(3, 5e9, 20e-6)


def test_a_given_partition_is_kept_and_credit_counts_it() -> None:
    """With the user's partition, credit is still a whole power-of-two number of those partitions."""
    sizes = default_sizes(1024, 1.25e10, 20e-6, partition_bytes=128 * 1024)
    assert sizes["partition_bytes"] == 128 * 1024
    partitions = sizes["credit_bytes"] // (128 * 1024)
    assert sizes["credit_bytes"] % (128 * 1024) == 0 and _is_power_of_two(partitions)


def test_a_hand_made_rule_gives_its_formula() -> None:
    """The rule computed by hand: partition = delay / 4 rounded to 2**k, credit = 2 x delay in partitions."""
    mib = 1 << 20
    rule = DefaultRule(mib / 4, 1.0, mib, 64 * mib, 2.0 * mib, 1.0, 2, 64, mib)
    delay = 1.25e9 * 2 * 63 * 20e-6  # 64 ranks, 10 Gbit/s, 20 us: 3.15 MB
    assert delay == pytest.approx(3.15e6)
    sizes = default_sizes(64, 1.25e9, 20e-6, rule=rule)
    assert sizes["partition_bytes"] == mib  # 0.79 MB rounds to 1 MiB
    assert sizes["credit_bytes"] == mib * 8  # 6.3 MB is 6 MiB, nearest power of two 8
    assert default_sizes(2, 1.25e8, 1e-6, rule=rule) == {
        "partition_bytes": mib,
        "credit_bytes": 2 * mib,
        "fusion_bytes": mib,
    }
    # Square root: 64x the delay, 8x the credit.
    root = DefaultRule(mib, 0.0, mib, mib, 4.0 * mib, 0.5, 1, 4096, mib)
    assert default_sizes(2, 1.25e9, mib / 2.5e9, rule=root)["credit_bytes"] == 4 * mib
    assert default_sizes(2, 1.25e9, 64 * mib / 2.5e9, rule=root)["credit_bytes"] == 32 * mib


def test_the_code_holds_the_fitted_rule() -> None:
    """link_defaults.DEFAULT_RULE is the rule benchmarks/choose_defaults.py wrote to docs/data/default_rule.json."""
    fitted = json.loads((ROOT / "docs" / "data" / "default_rule.json").read_text())
    assert DefaultRule(**fitted["rule"]) == DEFAULT_RULE
    for row in fitted["rows"]:
        assert default_sizes(row["ranks"], row["bandwidth_bytes_per_s"], row["latency_s"]) == row["defaults"]


def test_credit_grows_as_the_delay_to_the_three_quarters_over_partitions_of_at_most_4_mib() -> None:
    """Credit is 2 MiB x (delay / 1 MiB) ** 0.75 counted in partitions, rounded to 2**k, at least 4;
    partitions stop at 4 MiB until the credit would need more than 64 of them."""
    mib = 1024**2
    # 1024 ranks, 100 Gbit/s, 2 us: a delay of 12.5e9 x 2046 x 2e-6 = 51.2 MB = 48.8 MiB; partition
    # 4 MiB x 48.8 ** 0.25 = 10.6 MiB, at most 4 MiB; credit 2 x 48.8 ** 0.75 = 36.9 MiB = 9.2
    # partitions -> 8, 32 MiB.
    assert default_sizes(1024, 12.5e9, 2e-6) == {
        "partition_bytes": 4 * mib,
        "credit_bytes": 32 * mib,
        "fusion_bytes": 4 * mib,
    }
    # 64 ranks, 100 Gbit/s, 20 us: 30.0 MiB of delay, 2 x 30 ** 0.75 = 25.7 MiB -> 6.4 partitions -> 8.
    assert default_sizes(64, 12.5e9, 20e-6)["credit_bytes"] == 32 * mib
    # 1024 ranks, 100 Gbit/s, 5 us: 122.0 MiB of delay, 73.2 MiB of credit -> 18.3 partitions -> 16:
    # 64 MiB, about half the delay. The whole delay (128 MiB in 16 MiB partitions) put all of
    # ResNet-50's 97.5 MiB in flight at once, ahead of its first layer: 1.101 of the best schedule.
    assert default_sizes(1024, 12.5e9, 5e-6) == {
        "partition_bytes": 4 * mib,
        "credit_bytes": 64 * mib,
        "fusion_bytes": 4 * mib,
    }
    # 1024 ranks, 100 Gbit/s, 20 us: 487.8 MiB of delay, 207 MiB of credit -> 51.8 partitions -> 64.
    assert default_sizes(1024, 12.5e9, 20e-6)["credit_bytes"] == 256 * mib
    # 1024 ranks, 100 Gbit/s, 50 us: 1219.5 MiB of delay, 412 MiB of credit would be 103 partitions of
    # 4 MiB: the partition grows to 412 / 64 = 6.4 -> 8 MiB, and 51.5 of them round to 64, 512 MiB.
    assert default_sizes(1024, 12.5e9, 50e-6) == {
        "partition_bytes": 8 * mib,
        "credit_bytes": 512 * mib,
        "fusion_bytes": 4 * mib,
    }
    # The rig's links (2-4 ranks, up to 4 Gbit/s, 20-100 us) have delays under 0.3 MiB: the credit
    # stays at its floor of 4 partitions.
    for ranks, rate, latency in itertools.product((2, 3, 4), (1.2e8, 5e8), (20e-6, 45e-6, 100e-6)):
        sizes = default_sizes(ranks, rate, latency)
        assert sizes["credit_bytes"] == 4 * sizes["partition_bytes"]


@pytest.mark.parametrize(
    ("ranks", "rate", "latency", "algorithm", "partition_kib", "credit_kib"),
    [
        # The shaped rig: 2-4 ranks, 1 Gbit/s, 10-60 us per message.
        (2, 1.25e8, 10e-6, "ring", 1024, 4096),
        (3, 1.25e8, 30e-6, "ring", 1024, 4096),
        (4, 1.25e8, 60e-6, "ring", 2048, 8192),
        (4, 1e8, 45e-6, "mpich", 2048, 8192),
        (4, 1.25e8, 60e-6, "nccl", 2048, 8192),
        # 2-8 ranks at 10-100 Gbit/s, 2-20 us.
        (2, 1.25e9, 5e-6, "ring", 1024, 4096),
        (8, 1.25e9, 20e-6, "ring", 4096, 16384),
        (8, 1.25e10, 2e-6, "ring", 4096, 16384),
        (8, 1.25e10, 20e-6, "ring", 4096, 16384),
        (8, 1.25e10, 20e-6, "mpich", 4096, 16384),
        (8, 1.25e10, 5e-6, "nccl", 4096, 16384),
        (4, 1.25e10, 20e-6, "nccl", 4096, 16384),
        # NCCL turns from its tree to its ring at 8 MiB here: the partition grows past the rule's 4 MiB.
        (8, 1.25e10, 20e-6, "nccl", 8192, 32768),
    ],
)
def test_pinned_links_keep_their_sizes(
    ranks: int, rate: float, latency: float, algorithm: str, partition_kib: int, credit_kib: int
) -> None:
    """The pinned links, the rig's (where the replays were measured) and 2-8 ranks at 10-100 Gbit/s,
    keep the sizes the rule before the 4 MiB ceiling and the 0.75 power gave them."""
    sizes = default_sizes(ranks, rate, latency, algorithm=algorithm)
    assert (sizes["partition_bytes"], sizes["credit_bytes"]) == (partition_kib * 1024, credit_kib * 1024)


def test_the_fit_scores_the_sizes_default_sizes_gives() -> None:
    """benchmarks/choose_defaults.py's vector copy of the rule (what the fit scores, and what
    --keep-pinned compares) gives the ring's links the sizes default_sizes gives, both rules."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import choose_defaults

    links = list(itertools.product(RANKS, RATES, LATENCIES)) + choose_defaults.PINNED_LINKS
    delays = np.array([link_delay_bytes(*link) for link in links])
    for rounds, rule in (("channel", DEFAULT_RULE), ("data", ROUNDS_ON_DATA_RULE)):
        partitions, credits = choose_defaults._formula_sizes(rule, delays)
        for link, partition, credit in zip(links, partitions, credits):
            sizes = default_sizes(*link, rounds=rounds)
            assert (sizes["partition_bytes"], sizes["credit_bytes"]) == (partition, credit), (link, rounds)


def test_rounds_behind_the_data_keep_eight_times_the_delay_as_credit() -> None:
    """COMMSCHED_CONTROL_CHANNEL=transport: each round queues behind the bytes in flight, so the credit
    that comes back through it is late; the rule fitted that way (--rounds data) keeps 8 x the delay."""
    mib = 1024**2
    # 48.8 MiB of delay at 1024 ranks, 100 Gbit/s, 2 us: 8 x 48.8 / 8 MiB = 48.8 -> 64 partitions.
    assert default_sizes(1024, 12.5e9, 2e-6, rounds="data")["credit_bytes"] == 512 * mib
    # The rule before the 4 MiB partition ceiling: partitions up to 64 MiB, credit 8 x the delay.
    assert ROUNDS_ON_DATA_RULE == dataclasses.replace(
        DEFAULT_RULE,
        max_partition_bytes=64 * mib,
        credit_scale_bytes=8 * mib,
        credit_exponent=1.0,
    )
    # Under 2.5 MiB of delay both rules sit on the floor of 4 partitions.
    assert default_sizes(4, 5e8, 100e-6, rounds="data") == default_sizes(4, 5e8, 100e-6)
    assert rounds_path("transport", "mpi") == rounds_path("transport", "gloo") == "data"
    # NCCL's bytes move on the device; its rounds go over the host transport, never behind them.
    assert (
        rounds_path("transport", "nccl")
        == rounds_path("auto", "mpi")
        == rounds_path("tcp", "gloo")
        == "channel"
    )
    with pytest.raises(ValueError, match="rounds must be one of channel, data"):
        default_sizes(8, 1e9, 1e-5, rounds="tcp")


def test_link_settings_parse_and_name_the_variable_when_wrong() -> None:
    """COMMSCHED_LINK_BANDWIDTH takes rates with units, COMMSCHED_LINK_LATENCY durations."""
    settings = resolve({}, environ={"COMMSCHED_LINK_BANDWIDTH": "10gbit", "COMMSCHED_LINK_LATENCY": "20us"})
    assert settings.link_bandwidth == pytest.approx(1.25e9) and settings.link_latency == pytest.approx(20e-6)
    assert resolve({"link_bandwidth": "1.25GB/s"}, environ={}).link_bandwidth == pytest.approx(1.25e9)
    assert parse_rate("400mbit") == pytest.approx(5e7) and parse_rate(3e9) == 3e9
    with pytest.raises(SettingError, match="COMMSCHED_LINK_BANDWIDTH.*10gbit"):
        resolve({}, environ={"COMMSCHED_LINK_BANDWIDTH": "fast"})
    with pytest.raises(SettingError, match="link_bandwidth"):
        resolve({"link_bandwidth": "0gbit"}, environ={})
    assert Settings().link_bandwidth is None


def test_link_from_timings_inverts_the_ring_model() -> None:
    """Times made with the ring model's formula give back its bandwidth and latency."""
    ranks, rate, latency, nbytes = 8, 1.25e9, 15e-6, 1 << 20
    tiny = 2 * (ranks - 1) * latency
    big = tiny + 2 * (ranks - 1) / ranks * nbytes / rate
    assert link_from_timings(ranks, tiny, big, nbytes) == pytest.approx((rate, latency))


@pytest.mark.parametrize("scenario", ["measured", "given", "explicit"])
def test_init_applies_the_rule_the_same_on_every_rank(scenario: str) -> None:
    """Under MPI: measured or given link, the same sizes on every rank, explicit settings untouched."""
    pytest.importorskip("mpi4py")
    env = {"PYTHONPATH": str(ROOT)}
    if scenario == "given":
        env |= {"COMMSCHED_LINK_BANDWIDTH": "10gbit", "COMMSCHED_LINK_LATENCY": "20us"}
    if scenario == "explicit":
        env |= {"COMMSCHED_PARTITION_BYTES": "128KiB"}
    result = run_ranks(3, "link_defaults.py", scenario, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("LINK-OK") == 3, result.stdout


def test_the_simulator_scales_the_link_defaults_with_the_model() -> None:
    """A model shrunk by --scale gets the full model's link defaults divided by the same factor."""
    from commsched.bench import schedule, sim_cli

    layers = schedule.timed_layers(schedule.load_model("resnet50"), 1.0, 16.0, 1.0)
    spec = schedule.sim_layers(layers)
    rows = sim_cli.predict(
        spec, 4, 1.25e8, 48e-6, {"cycle_time": 0.001}, ["priority"], ["overlap"], scale=16.0
    )
    full = default_sizes(4, 1.25e8, 48e-6)
    assert {name: rows[0][name] for name in full} == {name: full[name] // 16 for name in full}
    given = sim_cli.predict(
        spec,
        4,
        1.25e8,
        48e-6,
        {"cycle_time": 0.001, "partition_bytes": 65536},
        ["priority"],
        ["overlap"],
        scale=16.0,
    )
    # A given (scaled) partition is kept; the credit counts whole partitions of it.
    assert given[0]["partition_bytes"] == 65536
    assert (
        given[0]["credit_bytes"]
        == default_sizes(4, 1.25e8, 48e-6, partition_bytes=65536 * 16)["credit_bytes"] // 16
    )


def test_the_replay_scales_the_link_defaults_and_keeps_a_given_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """commsched-bench schedule: unset sizes are the full model's link defaults / --scale; a partition
    given by flag or variable is kept and the credit counts whole ones of it."""
    import argparse

    from commsched.bench.schedule import _replay_sizes

    monkeypatch.delenv("COMMSCHED_PARTITION_BYTES", raising=False)
    args = argparse.Namespace(
        partition_bytes=None, credit_bytes=None, fusion_bytes=None, inline_bytes=None, scale=16.0
    )
    full = default_sizes(4, 1.2e8, 40e-6)
    full["inline_bytes"] = default_inline_bytes(4, 1.2e8, 40e-6, full["credit_bytes"])
    assert _replay_sizes(args, 4, 1.2e8, 40e-6) == {name: full[name] // 16 for name in full}
    monkeypatch.setenv("COMMSCHED_PARTITION_BYTES", "64KiB")
    sizes = _replay_sizes(args, 4, 1.2e8, 40e-6)
    assert sizes["partition_bytes"] is None  # init() reads the variable
    assert (
        sizes["credit_bytes"]
        == default_sizes(4, 1.2e8, 40e-6, partition_bytes=16 * 65536)["credit_bytes"] // 16
    )
    assert sizes["credit_bytes"] % 65536 == 0
    args.partition_bytes, args.credit_bytes = "32KiB", "96KiB"
    assert _replay_sizes(args, 4, 1.2e8, 40e-6)["credit_bytes"] == "96KiB"


@pytest.mark.parametrize(
    ("ranks", "rate", "latency", "algorithm", "credit", "expected"),
    [
        (2, 1.2e8, 45e-6, "ring", 0, 65536),  # a ring moves as many bytes as the round: the cap
        (2, 2.6e9, 2.7e-6, "mpich", 0, 65536),  # MPI's shared memory
        (4, 1.2e8, 45e-6, "ring", 8 << 20, 65536),  # the rig: 96 KiB added < the 8 MiB credit
        (4, 1.2e8, 45e-6, "ring", 0, 16384),  # no credit: 1.5 x 16 KiB added <= 32.4 KB of latency
        (3, 1.2e8, 30e-6, "ring", 0, 16384),  # 0.67 x 16 KiB added <= 14.4 KB of latency
        (4, 1.2e8, 10e-6, "ring", 0, 4096),  # 1.5 x 8 KiB added > 7.2 KB of latency >= 1.5 x 4 KiB
        (4, 1.2e8, 6e-6, "ring", 0, 4096),  # even 4 KiB adds more than 4.3 KB: the floor
        (4, 1.2e8, 6e-6, "ring", 24000, 16384),  # 24.6 KB added <= 4.3 KB + 24 KB; 32 KiB adds 49 KB
        (8, 1.25e10, 20e-6, "nccl", 0, 32768),  # the core's cap at 8 ranks (256 KiB / 8)
        (64, 1.25e9, 2e-6, "ring", 0, 4096),
        (1024, 1.25e10, 5e-6, "mpich", 16 << 20, 256),  # the cap is below the floor
        (300_000, 1.25e10, 5e-6, "ring", 16 << 20, 0),  # under one byte each: nothing rides inline
    ],
)
def test_the_inline_limit_is_the_largest_power_of_two_whose_added_bytes_cost_no_more_than_they_save(
    ranks: int, rate: float, latency: float, algorithm: str, credit: int, expected: int
) -> None:
    """Inline, (ranks - 1) copies of a tensor arrive at every rank in a round that runs anyway; the limit
    is the largest power of two within the core's cap whose bytes beyond the collective's own take no
    longer than the latencies of the collective it avoids plus the credit's bytes it would queue behind,
    and at least 4 KiB where the cap allows."""
    from commsched import collective_model
    from commsched.link_defaults import inline_cap_bytes

    assert default_inline_bytes(ranks, rate, latency, credit, algorithm) == expected
    assert expected <= inline_cap_bytes(ranks) <= min(65536, 262144 // ranks)
    if expected == 0:
        return
    concrete = collective_model.resolve(algorithm, expected, ranks, rate, latency)
    added = (ranks - 1) * expected - collective_model.wire_bytes(concrete, expected, ranks)
    saved = collective_model.steps(concrete, ranks) * latency * rate + credit
    assert added <= saved or expected == 4096
    if expected < inline_cap_bytes(ranks):  # the next power of two up costs more than it saves
        doubled = 2 * expected
        concrete = collective_model.resolve(algorithm, doubled, ranks, rate, latency)
        added = (ranks - 1) * doubled - collective_model.wire_bytes(concrete, doubled, ranks)
        assert added > collective_model.steps(concrete, ranks) * latency * rate + credit


def test_commsched_s_cost_per_collective_sets_a_floor_under_partition_and_fusion() -> None:
    """On a fast link the fixed cost per collective, not the wire, bounds the partition from below:
    at 2 GB/s and 80 us a partition must carry 32 x 160 KB; fusion rises with it only as far as a
    fused tensor's copies are worth a collective (512 KiB); a slow link keeps the fitted sizes."""
    from commsched.link_defaults import OVERHEAD_FLOOR_FACTOR, fusion_copy_cap_bytes, overhead_floor_bytes

    fitted = default_sizes(2, 2e9, 2e-6)
    floored = default_sizes(2, 2e9, 2e-6, collective_overhead_s=80e-6)
    floor = overhead_floor_bytes(2e9, 80e-6)
    assert floor >= OVERHEAD_FLOOR_FACTOR * 2e9 * 80e-6 / 2**0.5  # nearest power of two, in log scale
    assert floored["partition_bytes"] == max(fitted["partition_bytes"], floor) > fitted["partition_bytes"]
    assert floored["fusion_bytes"] == min(max(4 * MIB, floor), fusion_copy_cap_bytes(80e-6)) == 512 * 1024
    # The credit still spans as many partitions as the rule gave.
    ratio = fitted["credit_bytes"] // fitted["partition_bytes"]
    assert floored["credit_bytes"] == floored["partition_bytes"] * ratio
    # A partition the user gave is kept; no cost, or a slow link, leaves the rule alone.
    assert (
        default_sizes(2, 2e9, 2e-6, partition_bytes=65536, collective_overhead_s=80e-6)["partition_bytes"]
        == 65536
    )
    assert default_sizes(2, 2e9, 2e-6, collective_overhead_s=0.0) == fitted
    assert default_sizes(4, 1.2e8, 40e-6, collective_overhead_s=20e-6) == default_sizes(4, 1.2e8, 40e-6)


def test_the_replay_counts_the_cost_per_collective_at_full_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """At --scale 16 a collective carries 1/16 of the full model's bytes at the same fixed cost, so the
    floor the replay applies is the one for 16 x that cost at full size, divided by 16."""
    import argparse

    from commsched.bench.schedule import _replay_sizes

    for name in ("PARTITION", "CREDIT", "FUSION", "INLINE"):
        monkeypatch.delenv(f"COMMSCHED_{name}_BYTES", raising=False)
    args = argparse.Namespace(
        partition_bytes=None, credit_bytes=None, fusion_bytes=None, inline_bytes=None, scale=16.0
    )
    full = default_sizes(2, 2e9, 2e-6, collective_overhead_s=16 * 20e-6)
    sizes = _replay_sizes(args, 2, 2e9, 2e-6, 20e-6)
    assert sizes["partition_bytes"] == full["partition_bytes"] // 16
    assert sizes["partition_bytes"] > _replay_sizes(args, 2, 2e9, 2e-6)["partition_bytes"]


def test_fusion_stops_where_its_copies_cost_more_than_a_collective() -> None:
    """On links of 10 Gbit/s and more a fused tensor's copies in and out cost about what its wire
    time does: fusion stops at the size whose two copies at 10 GB/s take the cost per collective
    (20 us: 100 KB, 128 KiB), below the rule's 4 MiB, and grows with that cost. Partitions and credit
    are not touched; slower links, and no cost per collective, keep the rule's fusion."""
    from commsched.link_defaults import COPY_CAPPED_LINK_BYTES_PER_S, fusion_copy_cap_bytes

    assert fusion_copy_cap_bytes(20e-6) == 128 * 1024
    assert fusion_copy_cap_bytes(80e-6) == 512 * 1024
    assert fusion_copy_cap_bytes(1.0) == 64 * MIB  # never past the largest partition
    one_host = default_sizes(2, 4e9, 1e-6)
    for overhead, fusion in ((20e-6, 128 * 1024), (80e-6, 512 * 1024)):
        capped = default_sizes(2, 4e9, 1e-6, collective_overhead_s=overhead)
        assert capped["fusion_bytes"] == fusion < DEFAULT_RULE.fusion_bytes
        assert capped["partition_bytes"] >= one_host["partition_bytes"]
    assert default_sizes(2, 4e9, 1e-6, collective_overhead_s=0.0) == one_host
    # The threshold is the wire rate: just under 10 Gbit/s the rule's fusion stays.
    below = default_sizes(2, 0.99 * COPY_CAPPED_LINK_BYTES_PER_S, 30e-6, collective_overhead_s=20e-6)
    at = default_sizes(2, COPY_CAPPED_LINK_BYTES_PER_S, 30e-6, collective_overhead_s=20e-6)
    assert below["fusion_bytes"] == DEFAULT_RULE.fusion_bytes and at["fusion_bytes"] == 128 * 1024
    # Fused buffers on a GPU (a CUDA-aware MPI) copy at the device's memory rate: not capped.
    on_device = default_sizes(2, 4e9, 1e-6, collective_overhead_s=20e-6, fused_in_host_memory=False)
    assert on_device["fusion_bytes"] == DEFAULT_RULE.fusion_bytes
    # The rig's 1 Gbit/s links are not touched.
    assert (
        default_sizes(4, 1.25e8, 40e-6, collective_overhead_s=20e-6)["fusion_bytes"]
        == DEFAULT_RULE.fusion_bytes
    )


def test_the_replay_caps_fusion_as_the_full_size_model_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """At --scale 16 the replay's fusion is the full-size cap for 16 x the cost per collective, / 16:
    the copies shrink with the bytes, the cost per collective does not."""
    import argparse

    from commsched.bench.schedule import _replay_sizes
    from commsched.link_defaults import fusion_copy_cap_bytes

    for name in ("PARTITION", "CREDIT", "FUSION", "INLINE"):
        monkeypatch.delenv(f"COMMSCHED_{name}_BYTES", raising=False)
    args = argparse.Namespace(
        partition_bytes=None, credit_bytes=None, fusion_bytes=None, inline_bytes=None, scale=16.0
    )
    sizes = _replay_sizes(args, 2, 4e9, 1e-6, 20e-6)
    assert sizes["fusion_bytes"] == fusion_copy_cap_bytes(16 * 20e-6) // 16 == 128 * 1024
