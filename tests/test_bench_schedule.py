"""`commsched-bench schedule` replaying a tiny profile on 2 MPI ranks."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from commsched.link_defaults import DEFAULT_RULE, default_sizes

pytest.importorskip("mpi4py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"

DRIVER = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace as NS
    from commsched.bench import cli, schedule

    # 3 layers, 30 ms of compute at 1 TFLOP/s, 0.3 MB of gradients: quick on any machine.
    layers = [NS(name=f"l{i}", params=[(f"l{i}.w", (256, 100)), (f"l{i}.b", (256,))],
                 forward_flops=3e9, backward_flops=7e9) for i in range(3)]
    schedule.load_model = lambda name: NS(name="tiny", layers=layers, batch_size=1)
    sys.exit(cli.main(sys.argv[1:]))
    """
)


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_schedule_replay_on_two_ranks(tmp_path):
    """The replay's JSON, written to stdout with --json - (the header and table then go to stderr)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    argv = [
        str(MPIEXEC),
        "-n",
        "2",
        sys.executable,
        str(driver),
        "schedule",
        "--model",
        "tiny",
        "--scale",
        "1",
    ]
    # 3 iterations in 2 interleaved rounds: 2 in the first, 1 in the second, all reported.
    argv += ["--device-tflops", "1", "--iterations", "3", "--rounds", "2", "--warmup", "1", "--json", "-"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert "max(c,m) ms" in proc.stderr and "# model tiny on 2 ranks" in proc.stderr
    run, rows = data["run"], data["results"]
    assert run["gradient_bytes"] == 3 * 4 * (256 * 100 + 256)
    assert run["compute_s"] == pytest.approx(3 * 10e9 / 1e12)
    # The simulator's size costs: measured from 16 KiB up in steps of 4, ending at all gradients.
    sizes = [size for size, _ in run["size_costs"]]
    assert sizes == [16 << 10, 64 << 10, 256 << 10, run["gradient_bytes"]]
    assert all(factor > 0 for _, factor in run["size_costs"])
    assert {(r["policy"], r["mode"]) for r in rows} == {
        (p, m) for p in ("priority", "fifo") for m in ("overlap", "barrier")
    }
    baseline = next(r for r in rows if (r["policy"], r["mode"]) == ("fifo", "barrier"))["iteration_s"]
    for row in rows:
        # Compute is slept for, so no schedule can finish an iteration faster than it.
        assert row["iteration_s"] >= run["compute_s"] * 0.99
        assert row["median_iteration_s"] <= row["slowest_iteration_s"]
        assert row["iteration_s"] <= row["slowest_iteration_s"] * 1.000001
        assert max(row["iterations_s"]) == pytest.approx(row["slowest_iteration_s"])
        # Per iteration the slowest rank: never faster on average than the slowest rank's mean.
        assert len(row["iterations_s"]) == run["iterations"]
        assert sum(row["iterations_s"]) / run["iterations"] >= row["iteration_s"] * 0.999999
        # m: every byte at the best cost per byte measured, as the best schedule moves them; the raw
        # allreduce of all gradients stays in the header.
        assert row["communication_s"] == pytest.approx(run["least_communication_s"])
        assert row["bound_s"] == pytest.approx(max(run["compute_s"], row["communication_s"]))
        assert row["sum_s"] == pytest.approx(run["compute_s"] + row["communication_s"])
        assert row["bound_s"] <= row["best_s"] * (1 + 1e-9)
        assert row["speedup"] == pytest.approx(baseline / row["iteration_s"])
        assert 0.0 <= row["hidden"] <= 1.0


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_autotuned_replay_tunes_the_scaled_defaults(tmp_path):
    """--autotune starts from commsched's defaults / scale and may move them; it reports its choice."""
    pytest.importorskip("optuna")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out, trials = tmp_path / "schedule.json", tmp_path / "trials.csv"
    argv = [str(MPIEXEC), "-n", "2", sys.executable, str(driver), "schedule", "--model", "tiny"]
    argv += ["--scale", "16", "--device-tflops", "1", "--policies", "fifo", "--autotune"]
    argv += ["--iterations", "2", "--warmup", "110", "--no-size-costs", "--json", str(out)]
    env = dict(os.environ, COMMSCHED_AUTOTUNE_LOG=str(trials))
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["run"]["settings"]["policy"] == "fifo"  # the header shows the first run's settings
    rows = data["results"]
    assert [(r["policy"], r["mode"]) for r in rows] == [
        ("fifo", "overlap"),
        ("fifo", "barrier"),
        ("autotune", "overlap"),
        ("autotune", "barrier"),
    ]
    row = rows[2]
    assert row["speedup"] == pytest.approx(rows[1]["iteration_s"] / row["iteration_s"])
    assert set(row["settings"]) == {
        "policy",
        "partition_bytes",
        "credit_bytes",
        "fusion_bytes",
    }
    assert "# autotune chose for overlap:" in proc.stdout
    with open(trials) as handle:
        rows = list(csv.DictReader(handle))
    # The defaults the link rule fits to the measured link, divided by --scale.
    run = data["run"]
    # On a fast link the transport's rate and fixed cost at 1-16 MiB join commsched's own cost.
    rate, fixed_s = run["message_cost"] or (None, 0.0)
    fitted = default_sizes(
        2,
        run["bandwidth_bytes_per_s"],
        run["latency_s"],
        collective_overhead_s=(run["collective_overhead_s"] + fixed_s) * 16,
        message_bandwidth_bytes_per_s=rate,
    )
    partition = fitted["partition_bytes"] // 16
    assert rows[0]["phase"] == "default" and int(rows[0]["partition_bytes"]) == partition, (rows[0], run)
    # Scaled defaults given to init() are starting points: fixed, every trial would keep them.
    assert any(int(r["partition_bytes"]) != partition for r in rows), rows
    # The credit the link rule gives for that partition: a whole power of two of partitions.
    credit = int(rows[0]["credit_bytes"])
    assert credit == fitted["credit_bytes"] // 16, (rows[0], fitted)
    partitions = credit // partition
    assert credit % partition == 0 and partitions & (partitions - 1) == 0, rows[0]
    assert DEFAULT_RULE.min_credit_partitions <= partitions <= DEFAULT_RULE.max_credit_partitions, rows[0]
    assert any(int(r["credit_bytes"]) != credit for r in rows), rows


def test_replay_compute_does_not_pile_up_sleep_overshoot():
    """Hundreds of short layers replay in their planned compute time, not plus a wake-up delay each."""
    import numpy as np

    import commsched
    from commsched.bench.schedule import TimedLayer, compute_s, replay

    layers = [TimedLayer(f"l{i}", 40e-6, 80e-6, [(f"p{i}", 4)]) for i in range(300)]
    grads = [np.ones(4, np.float32) for _ in layers]
    commsched.init(transport="loopback")
    try:
        periods = replay(layers, grads, "overlap", iterations=5, warmup=1)
    finally:
        commsched.shutdown()
    # A 50 us overshoot per sleep would add 30 ms to every one of these 36 ms iterations; the
    # fastest is taken, since a busy host may stall the core's thread in one of them (a 116 ms
    # mean over three is possible on a loaded host).
    assert min(periods) < 1.15 * compute_s(layers), (periods, compute_s(layers))


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_raw_stalls_times_raw_mpi_iterations(tmp_path):
    """benchmarks/raw_stalls.py moves a profile's gradients with raw MPI and reports their spread."""
    out = tmp_path / "stalls.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "raw_stalls.py"
    argv = [str(MPIEXEC), "-n", "2", sys.executable, str(script), "--model", "resnet50", "--scale", "64"]
    argv += ["--iterations", "6", "--gap", "0.001", "--json", str(out)]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and data["iterations"] == 6
    assert 0 < data["median_s"] <= data["slowest_s"] and data["mean_s"] <= data["slowest_s"]
    assert 0 <= data["stalled"] < 6
    assert "nonblocking allreduces, 2 ranks" in proc.stdout


def test_rounds_spread_the_iterations_and_refuse_nonsense():
    """Every measured iteration lands in one round, the first rounds taking the remainder."""
    from commsched.bench import cli
    from commsched.bench.replay import round_share

    assert [round_share(7, 3, r) for r in range(3)] == [3, 2, 2]
    assert [round_share(2, 3, r) for r in range(3)] == [1, 1, 0]
    assert sum(round_share(101, 4, r) for r in range(4)) == 101
    parser = cli._parser()
    assert parser.parse_args(["schedule", "--model", "vgg16"]).rounds == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["schedule", "--model", "vgg16", "--rounds", bad])
