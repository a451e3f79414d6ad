"""Credit comes back only through agreement rounds. A collective that finishes while a round is
in its exchange (the round's report predates it) must make the next round start at once: left
to the heartbeat, the credit it frees sat unused for a whole cycle."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from python_core import running_on  # tests/ is on sys.path (conftest.py)

import commsched

EXCHANGE_S = 0.03  # an agreement round queued behind data on the wire
CYCLE_S = 2.0  # heartbeat: far longer than anything the test waits for


class _TimedOp:
    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def test(self) -> bool:
        return time.monotonic() >= self.done_at


class _SlowRoundTransport:
    """A lone rank whose rounds take EXCHANGE_S and whose n-th collective takes durations[n]."""

    name, rank, size = "slow-round", 0, 1
    poll_interval_us = 200
    host_memory = False  # every chunk is a collective, none rides in a report

    def __init__(self, durations_s: list[float]) -> None:
        self.durations_s = durations_s
        self.starts: list[float] = []

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        time.sleep(EXCHANGE_S)
        return [report]

    def start(self, address: int, count: int, dtype: str, kind: str, root: int) -> _TimedOp:
        now = time.monotonic()
        self.starts.append(now)
        return _TimedOp(now + self.durations_s[len(self.starts) - 1])


@pytest.fixture
def transport() -> Any:
    """The core on _SlowRoundTransport: 1 KiB chunks, 2 KiB of credit, a 2 s heartbeat."""
    # Launch order: chunk 0 ends mid-wait and starts round B; chunk 1 ends during round B's
    # exchange; chunk 2 holds half the credit for a second; chunk 3 needs chunk 1's credit.
    scripted = _SlowRoundTransport([0.01, 0.035, 1.0, 0.01])
    with running_on(scripted, partition_bytes=1024, credit_bytes=2048, fusion_bytes=0, cycle_time_s=CYCLE_S):
        yield scripted


def test_credit_freed_during_an_exchange_is_used_by_the_next_round_at_once(
    transport: _SlowRoundTransport,
) -> None:
    data = np.ones(1024, np.float32)  # 4 chunks of 1 KiB
    commsched.allreduce_async(data, name="grad").wait(30)
    assert len(transport.starts) == 4, transport.starts
    # Chunk 3 may start once round B's closing poll has seen chunk 1 done: one more round
    # (EXCHANGE_S) later, not when the 1 s chunk 2 ends or the 2 s heartbeat comes round.
    waited = transport.starts[3] - transport.starts[2]
    assert waited < 0.4, f"chunk 3 waited {waited:.3f}s for credit chunk 1 freed during an exchange"
    assert np.array_equal(data, np.ones(1024, np.float32))
