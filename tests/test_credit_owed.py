"""Credit comes back as the least any rank has completed. When another rank's report predates a
completion this rank already reported, that rank opens the next round the moment it sees its own:
this rank must join it at once, not at its next heartbeat (on MPICH shared memory every other
partition waited a whole cycle for its credit)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from python_core import running_on  # tests/ is on sys.path (conftest.py)

import commsched

CYCLE_S = 2.0  # heartbeat: far longer than anything the test waits for


class _DoneOp:
    def test(self) -> bool:
        return True


class _LaggingPeerTransport:
    """Rank 0 of two, whose peer always reports what rank 0 reported one round before: the peer
    announces every tensor and completes every collective one round later."""

    name, rank, size = "lagging-peer", 0, 2
    poll_interval_us = 200
    host_memory = False  # every chunk is a collective, none rides in a report

    def __init__(self) -> None:
        self.previous: bytes | None = None
        self.starts: list[float] = []

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        peer = self.previous if self.previous is not None else report
        self.previous = report
        return [report, peer]

    def start(self, address: int, count: int, dtype: str, kind: str, root: int) -> _DoneOp:
        self.starts.append(time.monotonic())
        return _DoneOp()


@pytest.fixture
def transport() -> Any:
    """The core on _LaggingPeerTransport: 1 KiB chunks, one chunk of credit, a 2 s heartbeat."""
    with running_on(
        _LaggingPeerTransport(), partition_bytes=1024, credit_bytes=1024, fusion_bytes=0, cycle_time_s=CYCLE_S
    ) as lagging:
        yield lagging


def test_credit_a_lagging_report_holds_back_comes_with_the_next_round_at_once(
    transport: _LaggingPeerTransport,
) -> None:
    data = np.ones(1024, np.float32)  # 4 chunks of 1 KiB, one in flight at a time
    started = time.monotonic()
    commsched.allreduce_async(data, name="grad").wait(30)
    took = time.monotonic() - started
    assert len(transport.starts) == 4, transport.starts
    # Each chunk's credit returns two rounds after it completes (the peer's report lags one); with
    # the second round left to the heartbeat, the three hand-offs took 2 s each.
    assert took < 1.0, (
        f"4 chunks took {took:.3f}s: the credit the peer's late report held back waited a heartbeat"
    )
