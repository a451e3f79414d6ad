"""Auto-tuning on 2 real ranks: sums stay exact across setting changes and a fixed setting stays."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")
pytest.importorskip("optuna")
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SCRIPT = Path(__file__).resolve().parent / "autotune_ranks" / "train.py"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec")
def test_autotune_on_two_ranks_keeps_sums_and_fixed_fusion(tmp_path):
    log_path = tmp_path / "trials.csv"
    env = dict(os.environ)
    env = {k: v for k, v in env.items() if not k.startswith("COMMSCHED_")}
    env.update(
        COMMSCHED_AUTOTUNE="1",
        COMMSCHED_AUTOTUNE_LOG=str(log_path),
        COMMSCHED_FUSION_BYTES="64KiB",
        PYTHONWARNINGS="ignore::FutureWarning",
    )
    argv = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", str(SCRIPT), "110"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mpiexec may glue the ranks' lines together, so decode each report where it starts.
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(proc.stdout)) if proc.stdout.startswith('{"rank"', i)]
    reports = sorted((decoder.raw_decode(proc.stdout, i)[0] for i in starts), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["mismatches"] == []
        assert report["final_everywhere_same"]
        assert all(seen[3] == 64 * 1024 for seen in report["seen"]), "the user's fusion size must stay"
        assert len(report["seen"]) > 2, "the tuner must have switched settings"
        result = report["result"]
        assert result is not None and result["iterations"] <= 100
        assert report["final"] == [
            result[k] for k in ("policy", "partition_bytes", "credit_bytes", "fusion_bytes")
        ]
    assert "COMMSCHED_FUSION_BYTES=64KiB" in proc.stderr and "commsched autotune: chose" in proc.stderr
    with open(log_path) as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["phase"] == "default" and rows[-1]["phase"] == "final"
    assert all(int(row["fusion_bytes"]) == 64 * 1024 for row in rows)
    final = rows[-1]
    assert [final["policy"], int(final["partition_bytes"]), int(final["credit_bytes"])] == reports[0][
        "final"
    ][:3]
    assert all(float(row["iteration_s"]) > 0 for row in rows)
