"""Unit checks of the benchmark helpers against values worked out independently."""

from __future__ import annotations

import argparse
import json
import math
import sys
from types import SimpleNamespace

import pytest

from commsched.bench import allreduce, calibration, report, schedule, sim_cli
from commsched.bench.report import human_size
from commsched.link_defaults import default_sizes


def test_sizes_double_from_4_bytes_to_256_mib():
    assert allreduce.sizes(4, 256 << 20, 2.0, 0) == [4 << k for k in range(27)]


def test_sizes_by_fixed_step():
    assert allreduce.sizes(1024, 4096, 1.0, 1024) == [1024, 2048, 3072, 4096]


@pytest.mark.parametrize("ranks, expected", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_bus_bandwidth_is_nccl_tests_factor(ranks, expected):
    assert allreduce.bus_bandwidth(1.0, ranks) == pytest.approx(expected)


def test_iterations_shrink_for_big_messages():
    assert allreduce.iterations_for(4, 20, 1 << 30) == 20
    assert allreduce.iterations_for(256 << 20, 20, 1 << 30) == 4
    assert allreduce.iterations_for(1 << 30, 20, 1 << 30) == 2


@pytest.mark.parametrize(
    "text, bytes_per_s", [("10gbit", 1.25e9), ("400mbit", 5e7), ("1.25GBps", 1.25e9), ("1gbps", 1e9)]
)
def test_parse_rate(text, bytes_per_s):
    assert sim_cli.parse_rate(text) == pytest.approx(bytes_per_s)


def test_parse_rate_refuses_nonsense():
    with pytest.raises(argparse.ArgumentTypeError):
        sim_cli.parse_rate("fast")


def test_table_aligns_and_marks_missing():
    text = report.format_table([("a", "A", "d"), ("b", "bee", ".2f")], [{"a": 5, "b": 1.234}, {"a": 123}])
    lines = text.splitlines()
    assert lines[0] == "  A   bee"
    assert lines[2] == "  5  1.23"
    assert lines[3] == "123     -"
    assert len({len(line) for line in lines}) == 1


def test_human_size():
    assert [report.human_size(n) for n in (4, 2048, 1536 << 10, 3 << 30)] == ["4B", "2KiB", "1.5MiB", "3GiB"]


def _profile():
    layer = SimpleNamespace
    return SimpleNamespace(
        name="tiny",
        batch_size=1,
        layers=[
            layer(
                name="a", params=[("a.w", (64, 32)), ("a.b", (64,))], forward_flops=2e12, backward_flops=4e12
            ),
            layer(name="b", params=[("b.w", (10, 64))], forward_flops=1e12, backward_flops=2e12),
        ],
    )


def test_timed_layers_turn_flops_into_seconds_and_scale_both():
    layers = schedule.timed_layers(_profile(), device_tflops=100.0, scale=4, time_scale=2.0)
    # 2e12 FLOPs at 100 TFLOP/s is 20 ms; /4 for the scale, *2 for the time scale.
    assert layers[0].forward_s == pytest.approx(0.02 / 4 * 2)
    assert layers[0].backward_s == pytest.approx(0.04 / 4 * 2)
    assert layers[0].params == [("a.w", 64 * 32 // 4), ("a.b", 16)]
    assert schedule.gradient_bytes(layers) == 4 * (512 + 16 + 160)
    assert schedule.compute_s(layers) == pytest.approx((0.06 + 0.03) / 2)
    assert schedule.sim_layers(layers)[1] == ("b", layers[1].forward_s, layers[1].backward_s, [640])


def test_predict_rows_relate_to_each_other():
    layers = schedule.sim_layers(schedule.timed_layers(_profile(), 100.0))
    settings = {"partition_bytes": 1024, "credit_bytes": 4096, "fusion_bytes": 0, "cycle_time": 0.001}
    rows = sim_cli.predict(layers, 4, 1e6, 1e-5, settings, ["priority", "fifo"], ["overlap", "barrier"])
    assert [(r["policy"], r["mode"]) for r in rows] == [
        ("priority", "overlap"),
        ("priority", "barrier"),
        ("fifo", "overlap"),
        ("fifo", "barrier"),
    ]
    fifo_barrier = rows[3]["iteration_s"]
    for row in rows:
        assert row["speedup"] == pytest.approx(fifo_barrier / row["iteration_s"])
        assert row["iteration_s"] >= row["best_s"] * (1 - 1e-9) >= row["bound_s"] * (1 - 1e-9)
        assert 0.0 <= row["hidden"] <= 1.0


def test_sim_cli_prints_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(schedule, "load_model", lambda name: _profile())
    out = tmp_path / "sim.json"
    assert (
        sim_cli.main(["--model", "tiny", "--ranks", "2,1024", "--bandwidth", "1gbit", "--json", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "priority" in printed and "fifo" in printed
    data = json.loads(out.read_text())
    assert {row["ranks"] for row in data["results"]} == {2, 1024}
    # Unset sizes are commsched's for each link: 1 Gbit/s and the default 20 us per message.
    for row in data["results"]:
        expected = default_sizes(row["ranks"], 1.25e8, 20e-6)
        assert {name: row[name] for name in expected} == expected
        assert "/".join(human_size(v) for v in expected.values()) + f" at {row['ranks']} ranks" in printed
    # Communication of one ring allreduce of every gradient at 1 Gbit/s, written out by hand.
    total = 4 * (64 * 32 + 64 + 10 * 64)
    row = next(r for r in data["results"] if r["ranks"] == 1024)
    expected = 2 * 1023 / 1024 * total / 1.25e8 + 2 * 1023 * 20e-6
    assert row["communication_s"] == pytest.approx(expected)
    assert math.isclose(data["compute_s"], 0.09)


def test_size_cost_calibration_keeps_in_flight_bounded(monkeypatch):
    """As many messages in flight as the credit allows, but never hundreds (MPICH hung at 512)."""
    calls = []

    def fake_raw(comm, nbytes, count, in_flight, repeats):
        calls.append((nbytes, count, in_flight))
        return 1e-3 * nbytes / (1 << 20)

    monkeypatch.setattr(calibration, "raw_iallreduce_s", fake_raw)
    costs = calibration.measure_size_costs(None, 32 << 20, 8 << 20, 32e-3, 1e-5, 3)
    assert [size for size, _ in costs] == [
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
        32 << 20,
    ]
    assert all(1 <= in_flight <= 64 for _, _, in_flight in calls), calls
    assert {nbytes: in_flight for nbytes, _, in_flight in calls}[4 << 20] == 2  # credit / size
    assert all(factor == pytest.approx(1.0, rel=1e-2) for _, factor in costs)  # linear fake: flat costs


def test_schedule_takes_compute_over_comm_and_refuses_the_old_flag(capsys):
    """compute = R x communication under one name in both tools; the old name is refused, naming the new."""
    from commsched.bench import cli

    parser = cli._parser()
    args = parser.parse_args(["schedule", "--model", "vgg16", "--compute-over-comm", "10"])
    assert args.compute_over_comm == 10.0
    assert parser.parse_args(["schedule", "--model", "vgg16"]).compute_over_comm is None
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["schedule", "--model", "vgg16", "--compute-ratio", "10"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--compute-ratio was renamed --compute-over-comm (compute = R x communication" in error
    assert "e.g. --compute-over-comm 10" in error


def _replay_header_and_rows():
    header = {
        "model": "tiny",
        "ranks": 2,
        "scale": 1.0,
        "gradient_bytes": 1 << 20,
        "compute_s": 0.01,
        "device_tflops": 1.0,
        "time_scale": 1.0,
        "communication_s": 0.012,
        "least_communication_s": 0.009,
        "bandwidth_bytes_per_s": 1.25e8,
        "latency_s": 2e-5,
        "size_costs": [(16384, 0.75), (1 << 20, 1.0)],
        "settings": {"partition_bytes": 1 << 18, "credit_bytes": 1 << 20, "fusion_bytes": 1 << 20},
    }
    row = {
        "policy": "priority",
        "mode": "overlap",
        "iteration_s": 0.0125,
        "slowest_iteration_s": 0.013,
        "bound_s": 0.01,
        "best_s": 0.011,
        "sum_s": 0.019,
        "hidden": 0.7,
        "vs_best": 1.1,
        "speedup": None,
        "sim_s": 0.012,
        "sim_error": -0.04,
    }
    return header, [row]


def test_text_goes_to_stderr_when_json_takes_stdout(capsys):
    """With --json - the header and table go to stderr, so stdout holds the JSON alone."""
    assert report.text_stream("-") is sys.stderr
    assert report.text_stream("out.json") is sys.stdout and report.text_stream(None) is sys.stdout
    header, rows = _replay_header_and_rows()
    schedule.print_schedule(header, rows, report.text_stream("-"))
    args = SimpleNamespace(transport="mpi", policy="priority", repeats=3)
    table = [{"size": 4, "count": 1, "type": "float", "redop": "sum", "time_us": 2.0}]
    allreduce.print_table(args, {"size": 2, "transport": "mpi"}, table, None, report.text_stream("-"))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "# model tiny on 2 ranks" in captured.err and "max(c,m) ms" in captured.err
    assert "# m: every gradient byte at the best cost per byte" in captured.err
    assert "# commsched allreduce on 2 ranks over mpi" in captured.err and "busbw" in captured.err
