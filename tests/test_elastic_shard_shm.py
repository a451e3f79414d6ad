"""A sharded commit's shared memory (elastic_shm): a shard written by a process that is then SIGKILLed
stays readable through the mapping of a rank that shared it, no file is left behind, a slot holding
another commit is refused, and ranks on different hosts fall back to broadcasts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from commsched.torch import elastic_shm

import commsched

WRITER = """
import sys
import time
import torch
from commsched.torch import elastic_shm
region = elastic_shm.Region({torch.float32: 5, torch.int64: 3})
slot = region.slot(2)
slot[torch.float32].copy_(torch.arange(5, dtype=torch.float32) * 1.5)
slot[torch.int64].copy_(torch.tensor([7, 8, 9]))
region.finished(2)
print(region.key, region.token, flush=True)
sys.stdin.read()  # killed here
"""


class _Exchange:
    """commsched.allgather_async answered by a fixed exchange of (host key, pid, token) per rank."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __call__(self, array: Any, name: str = "", priority: int = 0) -> Any:
        rows = self.rows

        class Done:
            def wait(self) -> Any:
                return torch.tensor(rows, dtype=torch.int64).reshape(-1)

        return Done()


@pytest.fixture
def shm() -> None:
    if elastic_shm.host_key() == 0:
        pytest.skip(f"no {elastic_shm.DIRECTORY} here")


def test_a_killed_rank_shard_stays_readable_to_the_ranks_that_mapped_it(
    shm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 (another process) captures commit 2 and is SIGKILLed after both shared; rank 0 reads its
    shard from its own mapping, and neither file remains in /dev/shm."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        key, token = (int(word) for word in writer.stdout.readline().split())
        region = elastic_shm.Region({torch.float32: 5, torch.int64: 3})
        assert region.key == key  # the same host
        mine = region.slot(2)
        mine[torch.float32].fill_(-1)
        mine[torch.int64].fill_(-2)
        region.finished(2)
        monkeypatch.setattr(commsched, "rank", lambda: 0)
        exchange = [[region.key, os.getpid(), region.token], [key, writer.pid, token]]
        monkeypatch.setattr(commsched, "allgather_async", _Exchange(exchange))
        assert region.share("test.hosts")
        region.release_all()  # as a restore does; the writer never unlinked its file
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
    assert region.names and not any(Path(path).exists() for path in region.names.values())
    shards = region.shards(2)
    assert torch.equal(shards[1][torch.float32], torch.arange(5, dtype=torch.float32) * 1.5)
    assert torch.equal(shards[1][torch.int64], torch.tensor([7, 8, 9]))
    assert torch.equal(shards[0][torch.int64], torch.full((3,), -2))
    with pytest.raises(RuntimeError, match=r"rank \d's shared-memory slot holds commit 2;"):
        region.shards(5)
    region.slot(5)  # rank 0 starts commit 5 in the same slot: not complete yet
    with pytest.raises(RuntimeError, match=r"rank 0's shared-memory slot holds commit 5 \(incomplete\)"):
        region.shards(5)


def test_ranks_on_other_hosts_send_by_broadcasts(shm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose host differs makes every rank fall back to broadcasts; the file goes at once."""
    region = elastic_shm.Region({torch.float32: 4})
    assert region.path is not None and Path(region.path).exists()
    other = [[region.key + 1, os.getpid() + 1, 5]]
    monkeypatch.setattr(
        commsched, "allgather_async", _Exchange([[region.key, os.getpid(), region.token], *other])
    )
    assert not region.share("test.hosts")
    assert not Path(region.path).exists()
    region.slot(1)[torch.float32].fill_(3)  # still this rank's capture buffer, mapped
    assert region.share("test.hosts") is False  # decided once: no second collective


def test_files_of_processes_that_ended_are_removed(shm: None) -> None:
    """A file left by a process that died before unlinking it (its lock free) goes when the next region
    is made; a live region's file (locked) stays."""
    live = elastic_shm.Region({torch.float32: 1})
    stale = Path(elastic_shm.DIRECTORY) / f"commsched-commit-1-{live.token + 1:x}"
    stale.write_bytes(b"x")
    elastic_shm.Region({torch.float32: 1})
    assert not stale.exists()
    assert live.path is not None and Path(live.path).exists()
    live.release()
    assert not Path(live.path).exists()


def test_only_running_processes_count_as_still_copying() -> None:
    """A commit's decision waits for the parts of ranks still running: this process runs; a child that
    was SIGSTOPped, one killed and not yet reaped, and a reaped one do not."""
    assert elastic_shm._running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert elastic_shm._running(child.pid)
        child.send_signal(signal.SIGSTOP)
        for _ in range(200):
            if not elastic_shm._running(child.pid):
                break
            time.sleep(0.01)
        assert not elastic_shm._running(child.pid)
        child.send_signal(signal.SIGCONT)
        child.kill()
        for _ in range(200):  # a zombie until waited for
            if not elastic_shm._running(child.pid):
                break
            time.sleep(0.01)
        assert not elastic_shm._running(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not elastic_shm._running(child.pid)
    assert not elastic_shm._running(0)
