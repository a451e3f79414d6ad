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
    """commsched.allgather_async answered by a fixed exchange of (host key, pid, token, next commit) per
    rank."""

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
        exchange = [[region.key, os.getpid(), region.token, 2], [key, writer.pid, token, 2]]
        monkeypatch.setattr(commsched, "allgather_async", _Exchange(exchange))
        assert region.share("test.hosts", 2)
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
    other = [[region.key + 1, os.getpid() + 1, 5, 1]]
    monkeypatch.setattr(
        commsched, "allgather_async", _Exchange([[region.key, os.getpid(), region.token, 1], *other])
    )
    assert not region.share("test.hosts", 1)
    assert not Path(region.path).exists()
    region.slot(1)[torch.float32].fill_(3)  # still this rank's capture buffer, mapped
    assert region.share("test.hosts", 1) is False  # decided once: no second collective


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


def _two_ranks(monkeypatch: pytest.MonkeyPatch, numbers: tuple[int, int]) -> tuple[Any, Any]:
    """Two regions of this process shared as ranks 0 and 1 of one host, proposing `numbers`."""
    regions = [elastic_shm.Region({torch.float32: 4}) for _ in range(2)]
    rows = [[r.key, os.getpid(), r.token, n] for r, n in zip(regions, numbers, strict=True)]
    monkeypatch.setattr(commsched, "allgather_async", _Exchange(rows))
    for rank, (region, number) in enumerate(zip(regions, numbers, strict=True)):
        monkeypatch.setattr(commsched, "rank", lambda rank=rank: rank)
        assert region.share("test.hosts", number)
    return regions[0], regions[1]


def test_ranks_agree_on_the_number_of_the_first_shared_commit(
    shm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that joined counts its commits from 1: every rank takes the highest proposed number."""
    first, second = _two_ranks(monkeypatch, (3, 7))
    assert first.first == second.first == 7
    first.release_all()


def test_a_commit_counts_once_every_rank_marked_its_part(shm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 waits for rank 1's mark, with no collective; it gives up, naming the rank, when rank 1 went on
    to a later commit without marking this one or when commsched stopped."""
    import threading

    me, peer = _two_ranks(monkeypatch, (4, 4))
    try:
        me.slot(4)
        peer.slot(4)
        me.finished(4)
        returned = threading.Event()
        waiter = threading.Thread(target=lambda: (me.await_every_part(4, lambda: True), returned.set()))
        waiter.start()
        time.sleep(0.05)
        assert not returned.is_set()  # rank 1 is still copying
        peer.finished(4)
        waiter.join(10)
        assert returned.is_set()

        me.slot(5)
        peer.slot(5)
        me.finished(5)
        peer.slot(6)  # rank 1's capture of 5 failed and it started 6
        with pytest.raises(RuntimeError, match="commit 5: rank 1 went on to a later commit"):
            me.await_every_part(5, lambda: True)

        me.slot(6)
        me.finished(6)
        with pytest.raises(RuntimeError, match="commit 6: commsched stopped before rank 1 finished its part"):
            me.await_every_part(6, lambda: False)
    finally:
        me.release_all()
