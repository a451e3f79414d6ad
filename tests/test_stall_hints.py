"""Stall messages name the usual cause of a plug-in's own collectives waiting: two ranks that wrap
their optimizers with different shard= settings end at COMMSCHED_STALL_SHUTDOWN with an error that
says every rank must pass the same shard=."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

RANKS_SCRIPT = """
import sys

import torch
import commsched
import commsched.torch as hvd

hvd.init()
model = torch.nn.Linear(8, 2)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), model=model, shard=hvd.rank() == 0
)
try:
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        optimizer.step()
except commsched.RankFailure as error:
    # The error runs to several KiB: two ranks' prints of it into one pipe can interleave, so stdout
    # gets one short line per rank saying what it names, and the whole error goes to stderr.
    text = str(error)
    named = "stalled past COMMSCHED_STALL_SHUTDOWN" in text and "the same shard=" in text
    print(f"rank {hvd.rank()} error: {text}", file=sys.stderr, flush=True)
    print(f"rank {hvd.rank()} FAILED names-shard={named}", flush=True)
else:
    print(f"rank {hvd.rank()} trained", flush=True)
"""


def test_ranks_with_different_shard_settings_are_told_so(tmp_path: Path) -> None:
    """Both ranks fail past the stall limit, and the error and the warnings name shard=."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {
        **os.environ,
        "COMMSCHED_STALL_TIMEOUT": "1",
        # Warnings come each second until the shutdown. Rank 0 may submit its sharded layout a
        # second or more after rank 1's first tensors on a loaded host (CI once): a 2 s limit left
        # rank 1 no warning after it, so 4 s leaves it two more.
        "COMMSCHED_STALL_SHUTDOWN": "4",
        "COMMSCHED_TRANSPORT": "gloo",
    }
    done = subprocess.run(
        [sys.executable, "-m", "commsched.run", "-n", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.stdout.count("FAILED") == 2, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} FAILED names-shard=True" in done.stdout, output[-3000:]
    # Each rank's warnings hint at both optimizers' names, rank 1's too, which never built a sharded one.
    hinted = "'torch.shard0.layout0' ready on ranks 0 but not on ranks 1 for {}s (DistributedOptimizer(shard=True):"
    for rank in (0, 1):
        warnings = [b for b in done.stderr.split("[commsched rank ") if b.startswith(f"{rank} WARNING")]
        assert any(hinted.format(s) in b for b in warnings for s in (1, 2, 3, 4)), done.stderr[-3000:]
