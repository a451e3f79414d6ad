"""Horovod's timeline variables on one rank: HOROVOD_TIMELINE=<file> writes a trace that a reader sees
while the job runs, with Horovod's activity names (NEGOTIATE_ALLREDUCE) and CYCLE_START marks, and
HOROVOD_TIMELINE=DYNAMIC writes nothing until hvd.start_timeline(path), as in Horovod."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RANK_SCRIPT = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import commsched
from commsched import _horovod as hvd

hvd.init()
commsched.allreduce(np.ones(3, np.float32), name="allreduce.probe")
time.sleep(0.1)  # as Horovod's test: the trace is read while the job still runs
target = Path(sys.argv[1])
print(json.dumps({"live": target.read_text() if target.exists() else None}), flush=True)
hvd.start_timeline(str(target.with_name("later.json")))
commsched.allreduce(np.ones(3, np.float32), name="allreduce.later")
hvd.stop_timeline()
hvd.shutdown()
"""


def _run(tmp_path: Path, timeline: str, target: Path) -> str | None:
    environment = {
        **os.environ,
        "HOROVOD_TIMELINE": timeline,
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "COMMSCHED_TRANSPORT": "loopback",
    }
    environment.pop("COMMSCHED_TIMELINE", None)
    result = subprocess.run(
        [sys.executable, "-c", RANK_SCRIPT, str(target)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    live: str | None = json.loads(result.stdout.strip().splitlines()[-1])["live"]
    return live


def test_horovod_timeline_file_is_readable_while_running(tmp_path: Path) -> None:
    """The trace names the tensor, Horovod's NEGOTIATE_ALLREDUCE and CYCLE_START before shutdown."""
    target = tmp_path / "trace.json"
    live = _run(tmp_path, str(target), target)
    assert live is not None, "HOROVOD_TIMELINE wrote no file"
    for expected in ("allreduce.probe", "NEGOTIATE_ALLREDUCE", "CYCLE_START"):
        assert expected in live, (expected, live[-2000:])
    json.loads(target.read_text())  # complete JSON once the job ended
    assert "allreduce.later" in (tmp_path / "later.json").read_text()


def test_horovod_timeline_dynamic_waits_for_start_timeline(tmp_path: Path) -> None:
    """DYNAMIC is not a file name: nothing is written until start_timeline(path)."""
    target = tmp_path / "trace.json"
    live = _run(tmp_path, "DYNAMIC", target)
    assert live is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["later.json"]
    later = (tmp_path / "later.json").read_text()
    assert "allreduce.later" in later and "allreduce.probe" not in later
