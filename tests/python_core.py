"""Starts the core on a transport written in Python, for tests that script the transport."""

from __future__ import annotations

from typing import Any

from commsched import _core


def start_on(
    transport: Any, *, partition_bytes: int, credit_bytes: int, fusion_bytes: int, cycle_time_s: float
) -> None:
    """Starts the priority core on `transport` (stop it with _core.stop())."""
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
