"""benchmarks/choose_defaults.py: the simulator's sweep of partition, credit and fusion sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "choose_defaults.py"


def test_sweep_on_a_replays_measured_link(tmp_path):
    """--replays sweeps at a replay's scale and link and reports full-scale sizes, defaults marked."""
    header = {
        "model": "resnet50",
        "ranks": 2,
        "scale": 16.0,
        "device_tflops": 100.0,
        "time_scale": 100.0,
        "bandwidth_bytes_per_s": 120e6,
        "latency_s": 30e-6,
        "size_costs": [[16384, 1.1], [1048576, 1.0]],
    }
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"run": header, "results": []}))
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--replays", str(replay), "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 6 * 5 * 3  # partitions x credits (4 multiples, per rank) x fusions
    assert {row["partition_bytes"] for row in rows} == {m << 19 for m in (1, 2, 4, 8, 16, 32)}
    assert all(row["ranks"] == 2 and row["vs_best"] >= 0.99 for row in rows)
    assert "(the defaults)" in proc.stdout
    # The grid's best is listed first, no worse than the defaults.
    lines = proc.stdout.splitlines()
    assert float(lines[1].split()[3]) <= float(next(l for l in lines if "defaults" in l).split()[3])
