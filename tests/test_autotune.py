"""Auto-tuner logic on one process: a fake runtime and a virtual clock stand in for the ranks.

The "true" iteration time of a setting is the simulator's prediction for a network whose
per-message latency is ten times what the tuner's probes report, so the tuner's own
simulator is wrong in a known way and only the measured trials can close the gap.
"""

from __future__ import annotations

import csv
import itertools
import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("optuna")

from commsched._core import simulate

import commsched
from commsched import autotune
from commsched.autotune_seed import FIELDS, Link, Space, Submission, sim_layers
from commsched.config import SettingError, resolve, user_given

# A small VGG-like model: (forward s, backward s, [bytes]) per layer, forward order.
LAYERS = [
    ("conv1", 0.004, 0.008, [6912, 256]),
    ("conv2", 0.010, 0.020, [147456, 256]),
    ("conv3", 0.010, 0.020, [589824, 512]),
    ("conv4", 0.012, 0.024, [2359296, 1024]),
    ("fc1", 0.006, 0.012, [4194304 * 2, 4096]),
    ("fc2", 0.002, 0.004, [1048576, 1024]),
]
BANDWIDTH = 125e6  # 1 Gbit/s
PROBED_LATENCY = 50e-6
TRUE_LATENCY = 500e-6


def true_time(settings: dict[str, Any]) -> float:
    """What a setting really costs on the pretend cluster."""
    result = simulate(
        [(n, f, b, list(p)) for n, f, b, p in LAYERS],
        2,
        BANDWIDTH,
        TRUE_LATENCY,
        settings["policy"],
        int(settings["partition_bytes"]),
        int(settings["credit_bytes"]),
        int(settings["fusion_bytes"]),
        "overlap",
        0.001,
        -1.0,
        4,
        2,
        "fifo",
    )
    return float(result["iteration_s"])


class FakeClock:
    """Virtual seconds that the test loop advances."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRuntime:
    """One rank: collectives are identities, probes follow the link model, reconfigure is recorded."""

    rank = 0
    size = 2  # the other rank measures exactly the same
    transport = "mpi"

    def __init__(self, clock: FakeClock, settings: dict[str, Any]) -> None:
        self.clock = clock
        self.current = dict(settings)
        self.switches: list[dict[str, Any]] = []

    def gather(self, values: Any) -> np.ndarray:
        return np.asarray([list(values)] * self.size, np.float64)

    def share(self, values: Any) -> list[int]:
        return [int(v) for v in values]

    def drain(self) -> None:
        pass

    def probe(self, nbytes: int) -> float:
        # As a 2-rank ring sees it: one exchange and 2(n-1)=2 messages of latency, then the bytes.
        return 3 * PROBED_LATENCY + nbytes / BANDWIDTH

    def reconfigure(self, settings: dict[str, Any]) -> None:
        self.current = {name: settings[name] for name in FIELDS}
        self.switches.append(dict(self.current))

    def settings(self) -> dict[str, Any]:
        return dict(self.current, cycle_time=0.001, transport=self.transport)


class PendingHandle:
    """A collective still in flight at the iteration boundary, as in an overlap loop."""

    def done(self) -> bool:
        return False


DEFAULTS = {
    "policy": "priority",
    "partition_bytes": 4 << 20,
    "credit_bytes": 16 << 20,
    "fusion_bytes": 1 << 20,
}


def run_training(
    tuner: autotune.Tuner, runtime: FakeRuntime, clock: FakeClock, iterations: int
) -> list[float]:
    """Drives the tuner like a training loop; returns each iteration's true time."""
    times = []
    for _ in range(iterations):
        period = true_time(runtime.current)
        start = clock.now
        clock.now += sum(f for _, f, _, _ in LAYERS)
        for name, _, backward, sizes in reversed(LAYERS):
            clock.now += backward
            for index, nbytes in enumerate(sizes):
                tuner.observe(f"{name}.{index}", nbytes // 4, "float32", 0, PendingHandle())
        clock.now = start + period
        times.append(period)
        tuner.step()
    return times


def search_space() -> Space:
    """The space the tuner derives for LAYERS."""
    sizes = [b for _, _, _, p in LAYERS for b in p]
    return Space.for_model({}, max(sizes), sum(sizes))


def test_search_reaches_the_grid_best_within_100_iterations(tmp_path):
    clock = FakeClock()
    runtime = FakeRuntime(clock, DEFAULTS)
    log_path = tmp_path / "trials.csv"
    tuner = autotune.Tuner(runtime, {}, autotune.Options(log_path=str(log_path), report=False), clock=clock)
    times = run_training(tuner, runtime, clock, 110)
    grid = {tuple(s[n] for n in FIELDS): true_time(s) for s in search_space().grid()}
    best = min(grid.values())
    assert true_time(DEFAULTS) > 1.10 * best, (
        "the defaults must be clearly off for this test to mean anything"
    )
    assert not tuner.active and tuner.result is not None
    assert tuner.iteration <= 100
    chosen = {name: tuner.result[name] for name in FIELDS}
    assert runtime.current == chosen
    assert true_time(chosen) <= 1.05 * best
    assert times[-1] == pytest.approx(true_time(chosen))
    with open(log_path) as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["phase"] == "default" and rows[-1]["phase"] == "final"
    assert {r["phase"] for r in rows} >= {"seed", "search"}
    assert [int(r["trial"]) for r in rows[1:-1]] == list(range(1, len(rows) - 1))
    # Every trial's logged time is what that setting costs (a fake clock has no noise).
    for row in rows[1:-1]:
        settings = {n: row[n] if n == "policy" else int(row[n]) for n in FIELDS}
        assert float(row["iteration_s"]) == pytest.approx(true_time(settings), rel=1e-4)


def test_seeds_come_from_the_simulator():
    clock = FakeClock()
    runtime = FakeRuntime(clock, DEFAULTS)
    tuner = autotune.Tuner(runtime, {}, autotune.Options(report=False), clock=clock)
    run_training(tuner, runtime, clock, 7)  # skip 1, observe 3, profile 1, then the first trial
    first_trial = runtime.switches[0]
    # Reference: the best of the simulator's own predictions (probed latency) over the whole grid.
    link = Link(2, BANDWIDTH, PROBED_LATENCY, 0.001)
    layers = [(n, f, b, list(p)) for n, f, b, p in LAYERS]
    from commsched.autotune_seed import predict

    predictions = [(predict(layers, link, "overlap", s), s) for s in search_space().grid()]
    best_predicted = min(t for t, _ in predictions)
    assert predict(layers, link, "overlap", first_trial) <= best_predicted * 1.01
    assert tuner.link is not None
    # The tiny probe's 4 bytes count as latency; the big probe's bandwidth is net of the tiny one.
    assert tuner.link.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=1e-5)
    assert tuner.link.latency_s == pytest.approx(PROBED_LATENCY + 4 / BANDWIDTH / 3, rel=1e-9)


@pytest.mark.parametrize(
    "fixed", [{"fusion_bytes": 3 << 20}, {"policy": "priority", "credit_bytes": 1 << 20}]
)
def test_fixed_settings_stay_out_of_the_search(fixed, tmp_path):
    clock = FakeClock()
    runtime = FakeRuntime(clock, dict(DEFAULTS, **fixed))
    options = autotune.Options(budget_iterations=40, log_path=str(tmp_path / "log.csv"), report=False)
    tuner = autotune.Tuner(runtime, fixed, options, clock=clock)
    run_training(tuner, runtime, clock, 45)
    assert runtime.switches, "the tuner must have tried something"
    for switch in runtime.switches:
        for name, value in fixed.items():
            assert switch[name] == value
    assert tuner.result is not None
    assert all(tuner.result[name] == value for name, value in fixed.items())
    free = {name for name in FIELDS if name not in fixed}
    assert any(switch[name] != DEFAULTS[name] for switch in runtime.switches for name in free)


def test_search_ends_once_every_setting_was_measured(tmp_path):
    """Only the policy free: after both policies, more trials would only repeat one of them."""
    fixed = {name: DEFAULTS[name] for name in FIELDS if name != "policy"}
    clock = FakeClock()
    runtime = FakeRuntime(clock, DEFAULTS)
    log_path = tmp_path / "log.csv"
    options = autotune.Options(log_path=str(log_path), report=False)
    tuner = autotune.Tuner(runtime, fixed, options, clock=clock)
    run_training(tuner, runtime, clock, 110)
    assert not tuner.active and tuner.result is not None
    with open(log_path) as handle:
        rows = list(csv.DictReader(handle))
    tried = [(r["policy"], r["partition_bytes"]) for r in rows if r["phase"] in ("default", "seed", "search")]
    assert len(tried) == len(set(tried)) <= 2, rows
    assert tuner.iteration < options.budget_iterations // 2, "the search should end when its space is spent"


def test_nccl_searches_fusion_like_host_transports():
    """GPU tensors fuse in a device buffer, so on NCCL the search tries fusion sizes too."""
    clock = FakeClock()
    runtime = FakeRuntime(clock, DEFAULTS)
    runtime.transport = "nccl"
    tuner = autotune.Tuner(runtime, {}, autotune.Options(report=False), clock=clock)
    run_training(tuner, runtime, clock, 110)
    assert tuner.result is not None and runtime.switches
    assert any(switch["fusion_bytes"] != DEFAULTS["fusion_bytes"] for switch in runtime.switches), (
        runtime.switches
    )


def test_start_tunes_given_sizes_named_as_starting_points():
    """A size given to init() is fixed unless start() is told it is only where the search begins."""
    commsched.init(transport="loopback", partition_bytes="256KiB", credit_bytes="1MiB")
    try:
        assert autotune.start().fixed == {"partition_bytes": 256 << 10, "credit_bytes": 1 << 20}
        assert autotune.start(starting=["credit_bytes"]).fixed == {"partition_bytes": 256 << 10}
        assert autotune.start(starting="partition_bytes").fixed == {"credit_bytes": 1 << 20}
        with pytest.raises(ValueError, match="cycle_time"):
            autotune.start(starting=["cycle_time"])
    finally:
        commsched.shutdown()


def test_everything_fixed_means_no_tuning():
    clock = FakeClock()
    runtime = FakeRuntime(clock, DEFAULTS)
    tuner = autotune.Tuner(runtime, dict(DEFAULTS), autotune.Options(report=False), clock=clock)
    run_training(tuner, runtime, clock, 20)
    assert not tuner.active and runtime.switches == []


def test_sim_layers_recovers_the_profile():
    # Submissions as a barrier loop produces them: forward, then backward last layer first.
    forward_total = sum(f for _, f, _, _ in LAYERS)
    t = forward_total
    subs = []
    for name, _, backward, sizes in reversed(LAYERS):
        t += backward
        for index, nbytes in enumerate(sizes):
            subs.append(Submission(f"{name}.{index}", nbytes, 0, t + index * 1e-6))
    layers = sim_layers(subs)
    assert [p for _, _, _, p in layers] == [p for _, _, _, p in LAYERS]
    assert [b for _, _, b, _ in layers] == pytest.approx([b for _, _, b, _ in LAYERS], abs=1e-9)
    # LAYERS follows the FLOP convention (forward = half the backward), so forward comes back too.
    assert [f for _, f, _, _ in layers] == pytest.approx([f for _, f, _, _ in LAYERS], abs=1e-9)


def test_sim_layers_orders_by_priority():
    subs = [Submission("b", 8, 0, 0.01), Submission("a", 4, 1, 0.02), Submission("c", 16, 2, 0.03)]
    assert [n for n, _, _, _ in sim_layers(subs)] == ["b", "a", "c"]
    tied = [Submission("b", 8, 0, 0.01), Submission("a", 4, 0, 0.02)]
    assert [n for n, _, _, _ in sim_layers(tied)] == ["a", "b"]


def test_space_round_trip_and_bounds():
    space = Space.for_model({"fusion_bytes": 123}, largest_bytes=3_000_000, total_bytes=20_000_000)
    assert space.free() == ["policy", "partition_bytes", "credit_bytes"]
    assert space.bounds["partition_bytes"] == (15, 22)  # 2**22 >= 3 MB: larger partitions cut nothing
    assert space.bounds["credit_bytes"] == (16, 25)
    settings = {"policy": "fifo", "partition_bytes": 1 << 18, "credit_bytes": 1 << 20, "fusion_bytes": 123}
    assert space.from_params(space.to_params(settings)) == settings
    # Partitioning off behaves as the top bound; out-of-range sizes clamp.
    assert space.to_params(dict(settings, partition_bytes=0))["partition_bytes"] == 22
    assert space.to_params(dict(settings, credit_bytes=1 << 30))["credit_bytes"] == 25
    grid = space.grid()
    assert all(s["fusion_bytes"] == 123 for s in grid)
    assert len([s for s in grid if s["policy"] == "priority"]) == 8 * 10
    assert len([s for s in grid if s["policy"] == "fifo"]) == 1


def test_env_line_reproduces_settings():
    settings = {
        "policy": "priority",
        "partition_bytes": 1 << 20,
        "credit_bytes": 3 << 10,
        "fusion_bytes": 1000,
    }
    line = autotune.env_line(settings)
    assert line == (
        "COMMSCHED_POLICY=priority COMMSCHED_PARTITION_BYTES=1MiB COMMSCHED_CREDIT_BYTES=3KiB "
        "COMMSCHED_FUSION_BYTES=1000"
    )
    environ = dict(pair.split("=", 1) for pair in line.split())
    resolved = resolve({}, environ=environ)
    assert {name: getattr(resolved, name) for name in FIELDS} == settings


def test_config_knows_what_the_user_gave():
    given = user_given({"partition_bytes": "1MiB", "policy": None}, {"COMMSCHED_FUSION_BYTES": "2MiB"})
    assert {"partition_bytes", "fusion_bytes"} <= given
    assert "policy" not in given and "credit_bytes" not in given
    resolved = resolve({}, environ={"COMMSCHED_AUTOTUNE": "1", "COMMSCHED_AUTOTUNE_LOG": "/tmp/x.csv"})
    assert resolved.autotune is True and resolved.autotune_log == "/tmp/x.csv"
    assert resolve({"autotune": False}, environ={"COMMSCHED_AUTOTUNE": "yes"}).autotune is False
    with pytest.raises(SettingError, match="COMMSCHED_AUTOTUNE"):
        resolve({}, environ={"COMMSCHED_AUTOTUNE": "maybe"})


def test_tuner_is_cheap_when_off_and_stops_at_close():
    clock = FakeClock()
    runtime = FakeRuntime(clock, DEFAULTS)
    tuner = autotune.Tuner(runtime, {}, autotune.Options(report=False), clock=clock)
    run_training(tuner, runtime, clock, 3)
    tuner.close()
    before = list(runtime.switches)
    run_training(tuner, runtime, clock, 30)
    assert runtime.switches == before and not tuner.recording


def test_grid_is_exhaustive_over_the_space():
    space = Space(fixed={"policy": "priority"}, bounds={n: (10, 12) for n in FIELDS[1:]})
    keys = {tuple(s[n] for n in FIELDS) for s in space.grid()}
    expected = set(itertools.product(["priority"], *[[1024, 2048, 4096]] * 3))
    assert keys == expected
    assert math.isclose(len(keys), 27)
