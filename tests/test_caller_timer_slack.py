"""A caller that waits for a GPU collective polls its events in short sleeps: while it does, its
thread's timer slack is fine enough for those sleeps to end on time, and afterwards the thread has
the slack it had before (the thread is the user's)."""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fake_cuda import FakeCudaArray, set_delay_us

import commsched

PR_SET_TIMERSLACK = 29
USER_SLACK_NS = 200_000  # an unusual value, so the test cannot mistake it for a default
FINE_SLACK_NS = 1000  # csrc/core/timer_slack.h: kPollTimerSlackNs


def _slack_file(thread_id: int) -> Path:
    return Path(f"/proc/{thread_id}/timerslack_ns")  # /proc/<tid> reaches any thread


def test_a_waiting_caller_polls_with_fine_slack_and_gets_its_own_back(nccl_env: ctypes.CDLL) -> None:
    """Each fake stream operation sleeps 20 ms, so the allreduce keeps the caller polling for about 60 ms."""
    me = threading.get_native_id()
    if not _slack_file(me).exists():
        pytest.skip("this kernel has no /proc/<tid>/timerslack_ns")
    libc = ctypes.CDLL(None, use_errno=True)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(int(_slack_file(me).read_text()))
            time.sleep(0.001)

    commsched.init(transport="nccl")
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        assert libc.prctl(PR_SET_TIMERSLACK, USER_SLACK_NS, 0, 0, 0) == 0
        data = FakeCudaArray(np.arange(1024, dtype=np.float32), stream=0x5EED)
        set_delay_us(nccl_env, 20_000)
        watcher.start()
        commsched.allreduce(data, name="slow", timeout=30)
        done.set()
        watcher.join(5)
        assert np.array_equal(data.host, np.arange(1024, dtype=np.float32))
        assert FINE_SLACK_NS in seen, seen
        assert int(_slack_file(me).read_text()) == USER_SLACK_NS
    finally:
        done.set()
        set_delay_us(nccl_env, 0)
        commsched.shutdown()
        libc.prctl(PR_SET_TIMERSLACK, 0, 0, 0, 0)  # 0: the thread's default again
