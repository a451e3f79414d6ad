"""Starts the core on a transport written in Python, for tests that script the transport."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from commsched import _core


@contextmanager
def running_on(
    transport: Any, *, partition_bytes: int, credit_bytes: int, fusion_bytes: int, cycle_time_s: float
) -> Iterator[Any]:
    """The priority core running on `transport` inside the block, stopped when it ends."""
    _core.start(
        policy="priority",
        partition_bytes=partition_bytes,
        credit_bytes=credit_bytes,
        fusion_bytes=fusion_bytes,
        cycle_time_s=cycle_time_s,
        stall_timeout_s=30.0,
        stall_shutdown_s=60.0,
        timeline_path="",
        log_level="warning",
        transport_kind="python",
        transport_argument=transport,
    )
    try:
        yield transport
    finally:
        _core.stop()
