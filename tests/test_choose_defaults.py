"""benchmarks/choose_defaults.py and benchmarks/sim_defaults_table.py: the fitted rule and its table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from commsched.link_defaults import DefaultRule, default_sizes

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_fit_picks_the_rule_with_the_smallest_worst_case(tmp_path: Path) -> None:
    """A short sweep: the reported worst case is the rule's own rows recomputed, and no row beats the ideal."""
    out = tmp_path / "rule.json"
    _run(
        "choose_defaults.py",
        "--ranks", "2,64",
        "--bandwidths", "10gbit",
        "--latencies", "20us",
        "--models", "resnet50",
        "--iterations", "2",
        "--json", str(out),
    )  # fmt: skip
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert sorted((r["ranks"], r["model"], r["regime"]) for r in rows) == [
        (n, "resnet50", regime) for n in (2, 64) for regime in ("balanced", "device")
    ]
    rule = DefaultRule(**document["rule"])
    for row in rows:
        assert (
            default_sizes(row["ranks"], row["bandwidth_bytes_per_s"], row["latency_s"], rule=rule)
            == row["defaults"]
        )
        # The rule's setting is one of the grid's, so the grid's best is no slower.
        assert 0 < row["grid_best_vs_best"] <= row["defaults_vs_best"]
    worst = max(r["defaults_vs_best"] / r["grid_best_vs_best"] for r in rows)
    assert document["worst_vs_grid_best"] == pytest.approx(worst)
    assert document["command"].startswith("python benchmarks/choose_defaults.py --ranks 2,64")
    assert document["rounds"] == "channel"


def test_the_table_compares_the_defaults_old_defaults_and_fifo(tmp_path: Path) -> None:
    """A short table at 8 and 1024 ranks: each schedule over the ideal, the defaults the rule's."""
    out = tmp_path / "table.json"
    proc = _run(
        "sim_defaults_table.py",
        "--ranks", "8,1024",
        "--bandwidths", "100gbit",
        "--latencies", "20us",
        "--models", "resnet50,bert-base",
        "--iterations", "3",
        "--warmup", "1",
        "--json", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and proc.stdout.count("\n| ") == 4  # one line per row after the header
    for row in rows:
        assert row["defaults"] == default_sizes(row["ranks"], 12.5e9, 20e-6)
        assert row["defaults_rounds_on_data"] == default_sizes(row["ranks"], 12.5e9, 20e-6, rounds="data")
        # Rounds travel on the control channel unless --rounds data; the defaults with rounds queued
        # behind the data stand alongside.
        assert row["rounds"] == "channel"
        for name in ("defaults", "old_defaults", "fifo", "defaults_rounds_on_data"):
            assert row[f"{name}_vs_best"] == pytest.approx(row[f"{name}_s"] / row["best_s"])
        # The defaults are a setting of the grid, so the grid's best is no slower.
        assert row["grid_best_s"] <= row["defaults_s"] * (1 + 1e-12)
        # Every reduction pays at least one ring latency (2 x 1023 x 20 us) past the last backward.
        assert row["best_s"] > 2 * 1023 * 20e-6 if row["ranks"] == 1024 else math.isfinite(row["best_s"])
