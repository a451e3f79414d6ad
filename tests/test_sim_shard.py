"""The simulator's and the replay's ZeRO-2 split (--shard): reduce-scatter in backward, all-gather after the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bench_schedule import DRIVER  # tests/ is on sys.path (conftest.py)

from commsched import _core
from commsched.bench import cli, sim_cli

MiB = 1 << 20
MB = 1_000_000


def sim(layers, policy="fifo", mode="barrier", ranks=2, shard=True, credit=8 * MiB):
    # A 1 s cycle keeps idle agreement rounds out of these short timelines.
    return _core.simulate(
        layers, ranks, 1e8, 1e-4, policy, 4 * MiB, credit, MiB, mode, 1.0, 3e-4, 4, 2, shard=shard
    )


def half_ring_s(nbytes: int, ranks: int) -> float:
    # Written out: a ring reduce-scatter (or all-gather) moves (n-1)/n of the bytes in n-1 steps.
    return (ranks - 1) / ranks * nbytes / 1e8 + (ranks - 1) * 1e-4


@pytest.mark.parametrize("policy", ["fifo", "priority"])
@pytest.mark.parametrize("mode", ["barrier", "overlap"])
@pytest.mark.parametrize("ranks", [2, 5])
def test_one_tensor_pays_a_reduce_scatter_then_an_all_gather(policy, mode, ranks):
    layers = [("l0", 0.01, 0.02, [1_000_000])]
    result = sim(layers, policy, mode, ranks)
    # Each collective waits for one agreement exchange (3e-4 s) and then crosses the ring.
    expected = 0.03 + 2 * (3e-4 + half_ring_s(1_000_000, ranks))
    assert result["iteration_s"] == pytest.approx(expected, rel=1e-9)
    ideal = _core.simulate_ideal(layers, ranks, 1e8, 4, 2, 1e-4, "ring", True)
    assert ideal["iteration_s"] == pytest.approx(0.03 + 2 * half_ring_s(1_000_000, ranks), rel=1e-9)


def test_without_shard_the_same_tensor_is_one_allreduce():
    layers = [("l0", 0.01, 0.02, [1_000_000])]
    result = sim(layers, shard=False)
    assert result["iteration_s"] == pytest.approx(0.03 + 3e-4 + 2 * half_ring_s(1_000_000, 2), rel=1e-9)


def test_a_first_layer_gather_preempts_the_late_reduce_scatters():
    # The last layer's gradients are reduce-scattered first, more than the 2 MiB credit lets out at
    # once; in fifo order the first layer's reduce-scatter and gather queue behind them, by priority
    # they pass the queued ones and the next forward starts sooner.
    layers = [("l0", 0.002, 0.002, [100_000]), ("l1", 0.01, 0.01, [100_000]), ("l2", 0.002, 0.002, [MB] * 4)]
    fifo = sim(layers, "fifo", "overlap", credit=2 * MiB)["iteration_s"]
    priority = sim(layers, "priority", "overlap", credit=2 * MiB)["iteration_s"]
    barrier = sim(layers, "priority", "barrier", credit=2 * MiB)["iteration_s"]
    ideal = _core.simulate_ideal(layers, 2, 1e8, 4, 2, 1e-4, "ring", True)["iteration_s"]
    assert ideal <= priority < fifo
    assert priority < barrier


def run_cli(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "sim.json"
    assert sim_cli.main([*flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("model", ["vgg16", "bert-base"])
def test_priority_overlap_beats_fifo_and_nothing_beats_the_best(tmp_path, model):
    data = run_cli(tmp_path, "--model", model, "--ranks", "2,4", "--shard", "--compute-over-comm", "1")
    assert data["shard"] is True
    rows = {(r["ranks"], r["policy"], r["mode"]): r for r in data["results"]}
    assert len(rows) == 8
    for row in rows.values():
        assert row["bound_s"] <= row["best_s"] * (1 + 1e-9) <= row["iteration_s"] * (1 + 1e-9)
    for ranks in (2, 4):
        priority = rows[(ranks, "priority", "overlap")]["iteration_s"]
        assert priority < rows[(ranks, "fifo", "overlap")]["iteration_s"]
        assert priority < rows[(ranks, "fifo", "barrier")]["iteration_s"]


def test_one_rank_moves_nothing(tmp_path):
    data = run_cli(tmp_path, "--model", "resnet50", "--ranks", "1,2", "--shard")
    one = [r for r in data["results"] if r["ranks"] == 1]
    two = [r for r in data["results"] if r["ranks"] == 2]
    assert len(one) == 4 and all(r["iteration_s"] == pytest.approx(data["compute_s"]) for r in one)
    assert all(r["launches"] == 0 and r["speedup"] == pytest.approx(1.0) for r in one)
    assert all(r["iteration_s"] > data["compute_s"] for r in two)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ranks", "1"], "2 or more ranks"),
        (["--ranks", "0", "--shard"], "1 or more ranks in each count with --shard"),
        (["--shard", "--algorithm", "tree"], "use --algorithm ring or halving-doubling"),
    ],
)
def test_bad_flag_combinations_are_refused(capsys, flags, message):
    assert sim_cli.main(["--model", "vgg16", *flags]) == 2
    assert message in capsys.readouterr().err


def test_schedule_refuses_shard_with_autotune(capsys):
    args = cli._parser().parse_args(["schedule", "--model", "vgg16", "--shard", "--autotune"])
    assert cli.schedule.run(args) == 2
    assert "--shard replays fixed settings; drop --autotune" in capsys.readouterr().err


MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_schedule_shard_replay_on_two_ranks(tmp_path):
    pytest.importorskip("mpi4py")
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
    argv += ["--device-tflops", "1", "--iterations", "3", "--rounds", "1", "--warmup", "1", "--shard"]
    argv += ["--no-size-costs", "--calibration-repeats", "1", "--json", "-"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all-gather after the step (ZeRO-2)" in proc.stderr
    data = json.loads(proc.stdout)
    run, rows = data["run"], data["results"]
    assert run["shard"] is True
    assert {(r["policy"], r["mode"]) for r in rows} == {
        (p, m) for p in ("priority", "fifo") for m in ("overlap", "barrier")
    }
    for row in rows:
        assert len(row["iterations_s"]) == 3
        # Sleeping compute is a floor no replay gets under; the best for the split is a floor too.
        assert row["iteration_s"] >= run["compute_s"] * 0.99
        assert row["bound_s"] <= row["best_s"] * (1 + 1e-9)
        assert row["sim_s"] >= row["best_s"] * (1 - 1e-9)


class _Handle:
    """A collective that completes only when waited for, as a slow link would have it."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.finished = log, name, False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> str:
        self.finished = True
        self.log.append(f"wait {self.name}")
        return self.name


@pytest.mark.parametrize("mode", ["overlap", "barrier"])
@pytest.mark.parametrize("bucket_bytes", [0, None])
def test_the_split_replay_leaves_nothing_in_flight(monkeypatch, mode, bucket_bytes):
    # Every rank must submit the same collectives: each reduce-scatter is stepped and gathered
    # before the replay returns, the last iteration's included, whatever was done by then.
    import commsched
    from commsched.bench.replay import TimedLayer, replay_shard

    log: list[str] = []
    handles: list[_Handle] = []

    def start(kind: str):
        def submit(array, name, priority):
            log.append(f"{kind} {name} {priority}")
            handles.append(_Handle(log, name))
            return handles[-1]

        return submit

    monkeypatch.setattr(commsched, "reducescatter_async", start("scatter"), raising=False)
    monkeypatch.setattr(commsched, "allgather_async", start("gather"), raising=False)
    monkeypatch.setattr(commsched, "size", lambda: 2)
    # Buckets off (0) sends each tensor alone; by default a bucket holds up to a partition (24 B:
    # one layer's 4 + 2 float32 elements).
    monkeypatch.setattr(commsched, "config", lambda: {"bucket_bytes": bucket_bytes, "partition_bytes": 24})
    layers = [TimedLayer(f"l{i}", 1e-4, 1e-4, [(f"l{i}.w", 4), (f"l{i}.b", 2)]) for i in range(3)]
    grads = [np.ones(count, dtype=np.float32) for layer in layers for _, count in layer.params]
    periods = replay_shard(layers, grads, mode, iterations=2, warmup=1)
    assert len(periods) == 2 and all(handle.finished for handle in handles)
    scatters = [line for line in log if line.startswith("scatter")]
    gathers = [line for line in log if line.startswith("gather")]
    per_iteration = 6 if bucket_bytes == 0 else 3
    assert len(scatters) == len(gathers) == 3 * per_iteration
    # Backward order: the last layer's gradients first; every gather carries its forward position.
    first = ["scatter l2.b.grad 5", "scatter l2.w.grad 4"] if bucket_bytes == 0 else ["scatter l2.w.grad 4"]
    assert scatters[: len(first)] == first
    positions = range(6) if bucket_bytes == 0 else (0, 2, 4)
    assert sorted({line.split()[2] for line in gathers}) == [str(p) for p in positions]


@pytest.mark.parametrize("whole", [False, True])
def test_the_split_replay_cuts_big_parameters_as_training_does(monkeypatch, whole):
    # A 10-element weight over the 24-byte bucket limit goes as pieces of 6 and 4 elements (a multiple
    # of the 2 ranks), the second bucketed with the bias; --whole-params sends it whole, as before.
    import commsched
    from commsched.bench.replay import TimedLayer, replay_shard

    sizes: list[int] = []
    handles: list[_Handle] = []

    def submit(array, name, priority):
        sizes.append(len(array))
        handles.append(_Handle([], name))
        return handles[-1]

    monkeypatch.setattr(commsched, "reducescatter_async", submit, raising=False)
    monkeypatch.setattr(commsched, "allgather_async", lambda *a, **k: _Handle([], "g"), raising=False)
    monkeypatch.setattr(commsched, "size", lambda: 2)
    monkeypatch.setattr(commsched, "config", lambda: {"bucket_bytes": None, "partition_bytes": 24})
    layers = [TimedLayer("l0", 1e-4, 1e-4, [("l0.w", 10), ("l0.b", 2)])]
    grads = [np.arange(10, dtype=np.float32), np.arange(2, dtype=np.float32)]
    replay_shard(layers, grads, "overlap", iterations=1, warmup=0, whole=whole)
    assert sorted(sizes[:2]) == ([2, 10] if whole else [6, 6])


def test_schedule_refuses_cut_at_partition_naming_whole_params(capsys):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["schedule", "--model", "vgg16", "--shard", "--cut-at-partition"])
    assert "--whole-params replays them whole" in capsys.readouterr().err
