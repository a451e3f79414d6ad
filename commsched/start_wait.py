"""How long a wait on the other ranks may last while an elastic generation starts.

commsched-run --min-np gives the ranks --elastic-timeout seconds (COMMSCHED_ELASTIC_WINDOW) to ask
for the next generation after a failure. While a generation starts (commsched.elastic.generation),
every rank reached init(), so each wait on the others (a rendezvous, a group, a meeting, the link
probe) lasts at most half of that: a rank held there by one that was lost still asks in time.
Kept apart from commsched.elastic so the transports read it without importing that package.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

WINDOW_VARIABLE = "COMMSCHED_ELASTIC_WINDOW"
_starting = False


def start_wait_s() -> float | None:
    """While a generation starts, the longest one wait on the other ranks may last; None otherwise."""
    window = float(os.environ.get(WINDOW_VARIABLE, "0") or 0)
    return window / 2 if _starting and window > 0 else None


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Marks this process as starting a generation for the duration of the block."""
    global _starting
    _starting = True
    try:
        yield
    finally:
        _starting = False
