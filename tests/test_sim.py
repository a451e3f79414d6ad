"""The simulator against closed-form timelines worked out by hand for small profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commsched import _core

MiB = 1 << 20


def sim(
    layers,
    policy="fifo",
    mode="barrier",
    ranks=2,
    bw=1e8,
    latency=1e-4,
    exchange=3e-4,
    partition=4 * MiB,
    credit=8 * MiB,
    fusion=MiB,
    cycle=1.0,
    link="fifo",
    size_costs=(),
    rounds="data",
):
    # A 1 s cycle keeps idle agreement rounds out of these short timelines unless a test asks for them.
    return _core.simulate(
        layers,
        ranks,
        bw,
        latency,
        policy,
        partition,
        credit,
        fusion,
        mode,
        cycle,
        exchange,
        4,
        2,
        link,
        list(size_costs),
        rounds=rounds,
    )


def ring_s(nbytes: int, ranks: int, bw: float, latency: float) -> float:
    # Written out here rather than taken from the module: 2(n-1)/n of the bytes, 2(n-1) latencies.
    return 2 * (ranks - 1) / ranks * nbytes / bw + 2 * (ranks - 1) * latency


@pytest.mark.parametrize("policy", ["fifo", "priority"])
@pytest.mark.parametrize("mode", ["barrier", "overlap"])
@pytest.mark.parametrize("ranks", [2, 4, 1024])
def test_one_tensor_costs_compute_exchange_and_ring(policy, mode, ranks):
    layers = [("l0", 0.01, 0.02, [1_000_000])]
    result = sim(layers, policy, mode, ranks=ranks)
    expected = 0.01 + 0.02 + 3e-4 + ring_s(1_000_000, ranks, 1e8, 1e-4)
    assert result["iteration_s"] == pytest.approx(expected, rel=1e-9)
    assert result["compute_s"] == pytest.approx(0.03)
    assert result["communication_s"] == pytest.approx(ring_s(1_000_000, ranks, 1e8, 1e-4))


@pytest.mark.parametrize(("ranks", "steps"), [(2, 1), (8, 1), (9, 4), (1024, 10)])
def test_default_exchange_is_one_message_up_to_8_ranks_then_an_allgather(ranks, steps):
    # As the MPI transport runs it: direct messages to every peer, or log2(n) allgather steps.
    layers = [("l0", 0.01, 0.02, [1_000_000])]
    result = sim(layers, ranks=ranks, exchange=-1.0)
    expected = 0.03 + steps * 1e-4 + ring_s(1_000_000, ranks, 1e8, 1e-4)
    assert result["iteration_s"] == pytest.approx(expected, rel=1e-9)


def test_collectives_in_flight_share_the_link_equally_when_fair():
    # Fusion off: the two tensors go as two collectives at once and each gets half the link.
    nbytes = 2_000_000
    result = sim([("l0", 0.01, 0.02, [nbytes, nbytes])], fusion=0, link="fair")
    assert result["launches"] == 6 * 2
    expected = 0.03 + 3e-4 + 2 * 1e-4 + 2 * nbytes / 1e8
    assert result["iteration_s"] == pytest.approx(expected, rel=1e-9)


def test_credit_waits_for_the_agreed_completion():
    # Credit of one tensor: the second launches only after the round that reports the first done.
    nbytes = 2_000_000
    result = sim(
        [("l0", 0.01, 0.02, [nbytes, nbytes])], policy="priority", partition=0, credit=nbytes, fusion=0
    )
    one = ring_s(nbytes, 2, 1e8, 1e-4)
    assert result["iteration_s"] == pytest.approx(0.03 + 2 * (3e-4 + one), rel=1e-9)
    assert result["max_bytes_in_flight"] == nbytes


def test_fusion_pays_the_latency_once():
    small = 1000
    # No compute: each iteration pays one exchange, one latency phase and the bytes, fused or not (the
    # ten unfused collectives share the latency phase and go in start order; a completion is not news).
    fused = sim([("l0", 0.0, 0.0, [small] * 10)], fusion=MiB, latency=1e-3)
    assert fused["iteration_s"] == pytest.approx(3e-4 + 2e-3 + 10 * small / 1e8, rel=1e-9)
    unfused = sim([("l0", 0.0, 0.0, [small] * 10)], fusion=0, latency=1e-3)
    assert unfused["iteration_s"] == pytest.approx(3e-4 + 2e-3 + 10 * small / 1e8, rel=1e-9)
    assert fused["launches"] == 6 and unfused["launches"] == 60


# Two layers, 1 s of forward and of backward each; on 2 ranks at 1 MB/s a tensor of b bytes takes b us.
# Worked by hand: the big gradient of layer 1 (2 s on the wire) is ready at t=3, the small one of layer 0
# (0.5 s) at t=4. Preemptive priority sends layer 0 first at t=4: the next forward starts 4.5 s apart.
# FIFO launches layer 0 at t=4 behind layer 1 (no credit): on a link served in start order it ends at
# t=5.5 (period 5.5 s); on a fairly shared link it takes half the rate from t=4 and ends at t=5.
TWO_LAYERS = [("first", 1.0, 1.0, [500_000]), ("second", 1.0, 1.0, [2_000_000])]


def test_ideal_schedule_preempts_for_the_first_layer():
    best = _core.simulate_ideal(TWO_LAYERS, 2, 1e6, 4, 2)
    assert best["iteration_s"] == pytest.approx(4.5, rel=1e-9)
    assert best["iteration_starts_s"][:3] == pytest.approx([0.0, 4.5, 9.0])
    assert best["bound_s"] == pytest.approx(4.0)


def test_ideal_schedule_pays_one_ring_latency_per_reduction():
    # 2 ranks, 0.1 s per message: each reduction becomes visible 2(n-1) x 0.1 = 0.2 s after its last
    # byte. Layer 0's gradient is served 4-4.5 and seen at 4.7; layer 1's finishes at 5.5, seen at 5.7,
    # just when the next forward reaches layer 1 (4.7 + 1 s): the period is 4.5 + 0.2 s.
    best = _core.simulate_ideal(TWO_LAYERS, 2, 1e6, 4, 2, latency_s=0.1)
    assert best["iteration_s"] == pytest.approx(4.7, rel=1e-9)
    assert best["iteration_starts_s"][:3] == pytest.approx([0.0, 4.7, 9.4])
    # No real schedule beats it: the scheduler itself with fine chunks lands above.
    real = sim(
        TWO_LAYERS, "priority", "overlap", bw=1e6, latency=0.1, exchange=1e-6, cycle=1e-4, partition=100_000
    )
    assert real["iteration_s"] >= best["iteration_s"]


def test_real_scheduler_approaches_the_ideal_with_fine_partitions():
    kwargs = {"bw": 1e6, "latency": 1e-6, "exchange": 1e-6, "cycle": 1e-4, "credit": 20_000, "fusion": 0}
    priority = sim(TWO_LAYERS, "priority", "overlap", partition=10_000, **kwargs)
    fifo = sim(TWO_LAYERS, "fifo", "overlap", partition=10_000, **kwargs)
    fifo_fair = sim(TWO_LAYERS, "fifo", "overlap", partition=10_000, link="fair", **kwargs)
    assert priority["iteration_s"] == pytest.approx(4.5, rel=0.02)
    assert fifo["iteration_s"] == pytest.approx(5.5, rel=0.01)
    assert fifo_fair["iteration_s"] == pytest.approx(5.0, rel=0.01)


def test_submission_during_an_idle_exchange_waits_for_it():
    # A 4.7 ms cycle with 3 ms exchanges; quiet rounds of an idle rank double the heartbeat, so
    # idle rounds run 4.7-7.7 and then 17.1-20.1. The gradient ready at t=18 arrives mid-round and
    # is agreed in the round of 20.1-23.1; its bytes cross the link from 23.3 to 33.3. With data in
    # flight the heartbeat is back to one cycle: the round at 27.8 queues behind the 0.55 MB still
    # on the link and ends at 36.3, and only then is the completion seen.
    layers = [("l0", 0.008, 0.010, [1_000_000])]
    result = sim(layers, exchange=3e-3, cycle=4.7e-3)
    first_period = result["iteration_starts_s"][1]
    assert first_period == pytest.approx(0.0278 + 3e-3 + 0.0055, rel=1e-9)


def test_an_agreement_round_queues_behind_data_on_a_fifo_link():
    # l1's 1 MB is agreed at 0.101 s and takes 1 s on the wire. l0's round starts at 0.6 s behind
    # the 0.501 MB still queued, so it ends at 1.102 s, and l0's 4 bytes follow. Shared fairly,
    # the round waits behind nothing and l0's bytes finish right after l1's.
    layers = [("l0", 0.0, 0.5, [4]), ("l1", 0.0, 0.1, [1_000_000])]
    kwargs = {"bw": 1e6, "latency": 0.0, "exchange": 1e-3, "fusion": 0}
    assert sim(layers, **kwargs)["iteration_s"] == pytest.approx(0.6 + 1e-3 + 0.501 + 4e-6, rel=1e-9)
    assert sim(layers, link="fair", **kwargs)["iteration_s"] == pytest.approx(1.101 + 4e-6, rel=1e-9)


def test_an_agreement_round_on_its_own_channel_waits_behind_no_data():
    # As above, but the round travels on the control channel: it ends at 0.601 s, not behind the
    # 0.501 MB still queued. l0's 4 bytes then queue behind l1's on the FIFO link (l1 ends at 1.101 s),
    # so l0 is done at 1.101 s + 4 us, as on a fair link. With l1 already done when l0 is agreed
    # (its backward 1.2 s), the channel's round costs just its exchange, as the data round then does.
    layers = [("l0", 0.0, 0.5, [4]), ("l1", 0.0, 0.1, [1_000_000])]
    kwargs = {"bw": 1e6, "latency": 0.0, "exchange": 1e-3, "fusion": 0}
    assert sim(layers, rounds="channel", **kwargs)["iteration_s"] == pytest.approx(1.101 + 4e-6, rel=1e-9)
    late = [("l0", 0.0, 1.2, [4]), ("l1", 0.0, 0.1, [1_000_000])]
    expected = 1.3 + 1e-3 + 4e-6
    assert sim(late, rounds="channel", **kwargs)["iteration_s"] == pytest.approx(expected, rel=1e-9)
    assert sim(late, **kwargs)["iteration_s"] == pytest.approx(expected, rel=1e-9)


def test_rounds_must_name_where_they_travel():
    with pytest.raises(ValueError, match="rounds must be 'data' or 'channel'"):
        sim([("l0", 0.0, 0.1, [4])], rounds="tcp")


def test_quiet_rounds_stretch_the_heartbeat():
    # Six simulated seconds (4 warm-up and 2 timed iterations of 1 s) with one tensor each:
    # after the ramp 1, 2, 4, ... 32 ms, a round every 32 ms (~190), not one per ms (~6000).
    layers = [("l0", 0.5, 0.5, [4])]
    cycles = sim(layers, exchange=1e-5, cycle=1e-3)["cycles"]
    assert 150 < cycles < 260


def test_size_costs_scale_each_collective_by_its_size():
    # Two 1 MB tensors partitioned into 250 kB chunks: a factor measured at that size applies.
    # Factors are read linearly in log(size) between the measured sizes and flat outside them.
    layers = [("l0", 0.01, 0.02, [1_000_000])]
    chunked = {"policy": "priority", "partition": 250_000, "credit": 250_000 * 8}
    plain = sim(layers, **chunked)
    assert plain["launches"] == 4 * 6
    wire = ring_s(1_000_000, 2, 1e8, 0)  # the bytes' share of the ring allreduces
    cheap = sim(layers, **chunked, size_costs=[(1_000, 0.5), (250_000, 0.5)])
    assert plain["iteration_s"] - cheap["iteration_s"] == pytest.approx(wire / 2, rel=1e-6)
    between = sim(layers, **chunked, size_costs=[(25_000, 0.25), (2_500_000, 0.75)])
    assert plain["iteration_s"] - between["iteration_s"] == pytest.approx(wire / 2, rel=1e-6)
    above = sim(layers, **chunked, size_costs=[(1_000, 2.0), (2_000, 0.5)])
    assert plain["iteration_s"] - above["iteration_s"] == pytest.approx(wire / 2, rel=1e-6)
    # The whole-gradient figure takes its own size's factor.
    assert between["communication_s"] > cheap["communication_s"]
    assert cheap["communication_s"] == pytest.approx(ring_s(1_000_000, 2, 1e8, 1e-4) - wire / 2)


@pytest.mark.parametrize("costs", [[(0, 1.0)], [(10, 0.0)], [(10, 1.0), (10, 2.0)], [(20, 1.0), (10, 1.0)]])
def test_bad_size_costs_are_refused(costs):
    with pytest.raises(ValueError, match="size costs"):
        sim([("l0", 0.1, 0.1, [4])], size_costs=costs)


def test_size_costs_parse_from_the_command_line():
    from commsched.bench.sim_cli import parse_size_costs

    assert parse_size_costs("1MiB:0.8, 64KiB:0.6") == [(65536, 0.6), (1 << 20, 0.8)]
    assert parse_size_costs("") == []
    for bad in ("64KiB", "64KiB:zero", "0:1", "1KiB:-1", "1KiB:1,1024:2"):
        with pytest.raises(ValueError, match="size cost|twice"):
            parse_size_costs(bad)


def test_no_gradients_means_compute_only():
    layers = [("a", 0.1, 0.2, []), ("b", 0.3, 0.4, [])]
    assert sim(layers)["iteration_s"] == pytest.approx(1.0)
    assert _core.simulate_ideal(layers, 8, 1e9, 3, 1)["iteration_s"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "change",
    [{"ranks": 1}, {"bw": 0.0}, {"latency": -1.0}, {"cycle": 0.0}],
)
def test_bad_inputs_are_refused(change):
    with pytest.raises(ValueError):
        sim([("l0", 0.1, 0.1, [4])], **change)


def test_empty_profile_is_refused():
    with pytest.raises(ValueError, match="no layers"):
        sim([])


# -- commsched-sim, the command ------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def _guide_command(flag: str) -> list[str]:
    """The arguments of the commsched-sim line in docs/guide.md that uses `flag`."""
    guide = GUIDE
    lines = [
        line for line in guide.read_text().splitlines() if line.startswith("commsched-sim ") and flag in line
    ]
    assert len(lines) == 1, lines
    return lines[0].split()[1:]


def test_the_guides_size_costs_example_has_consistent_columns(tmp_path):
    """The guide's --size-costs example: every row's iteration is at least the best schedule, which is at
    least max(c, m), m moving every byte at the smallest factor; the figures the guide quotes are these."""
    from commsched.bench import schedule, sim_cli

    out = tmp_path / "sim.json"
    assert sim_cli.main(_guide_command("--size-costs") + ["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    layers = schedule.timed_layers(schedule.load_model(data["model"]), schedule.DEFAULT_DEVICE_TFLOPS)
    total, ranks = schedule.gradient_bytes(layers), 8
    rate, latency = 25e9 / 8, 20e-6
    least = 2 * (ranks - 1) / ranks * total * 0.4 / rate + 2 * (ranks - 1) * latency
    one_allreduce = 2 * (ranks - 1) / ranks * total * 0.94 / rate + 2 * (ranks - 1) * latency
    for row in data["results"]:
        assert row["iteration_s"] >= row["best_s"] >= row["bound_s"] * (1 - 1e-12), row
        assert row["communication_s"] == pytest.approx(least, rel=1e-9)
        assert row["bound_s"] == pytest.approx(max(row["compute_s"], least), rel=1e-9)
        assert row["sum_s"] == pytest.approx(row["compute_s"] + least, rel=1e-9)
        assert 0.0 <= row["hidden"] <= 1.0
    first = data["results"][0]
    assert (first["policy"], first["mode"]) == ("priority", "overlap")
    guide = GUIDE.read_text()
    quoted = (
        f"takes {one_allreduce * 1e3:.1f} ms where m is {least * 1e3:.1f} ms",
        f"(iter {first['iteration_s'] * 1e3:.1f} ms)",
    )
    for text in quoted:
        assert text in " ".join(guide.split()), text


def test_json_to_stdout_is_only_json(capsys):
    """--json - writes the JSON alone to stdout; the header and the table go to stderr."""
    from commsched.bench import sim_cli

    argv = ["--model", "resnet50", "--ranks", "8", "--policies", "priority", "--modes", "overlap"]
    assert sim_cli.main(argv + ["--json", "-"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert [row["ranks"] for row in data["results"]] == [8]
    assert "max(c,m) ms" in captured.err and captured.err.startswith("# resnet50:")
    assert sim_cli.main(argv) == 0
    assert "max(c,m) ms" in capsys.readouterr().out  # without --json - the table stays on stdout


def test_compute_over_comm_sets_compute_to_that_multiple_of_communication(tmp_path):
    """--compute-over-comm R picks the rate at which compute is R times one ring allreduce of all
    gradients (its bandwidth term), as in commsched-bench schedule; R = 4 leaves a quarter."""
    from commsched.bench import sim_cli

    out = tmp_path / "sim.json"
    argv = ["--model", "resnet50", "--ranks", "2,16", "--latency", "0", "--compute-over-comm", "4"]
    assert sim_cli.main(argv + ["--modes", "overlap", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for row in data["results"]:
        n = row["ranks"]
        communication = 2 * (n - 1) / n * data["gradient_bytes"] / row["bandwidth_bytes_per_s"]
        assert data["compute_s"] == pytest.approx(4 * communication, rel=1e-9)
        assert row["communication_s"] == pytest.approx(communication, rel=1e-9)  # no size costs, no latency


def test_the_old_compute_flag_is_refused_with_its_new_name(capsys):
    from commsched.bench import sim_cli

    with pytest.raises(SystemExit) as exited:
        sim_cli.main(["--model", "resnet50", "--compute-ratio", "2"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--compute-ratio was renamed --compute-over-comm" in error
    assert "compute = R x communication" in error and "--compute-over-comm 2" in error
    with pytest.raises(SystemExit):
        sim_cli.main(["--model", "resnet50", "--compute-over-comm", "0"])
    assert "not a number above 0" in capsys.readouterr().err
