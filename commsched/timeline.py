"""The Chrome trace started and stopped while commsched runs (Horovod's hvd.start_timeline).

COMMSCHED_TIMELINE records from init() to shutdown(); start_timeline(path) records from now on,
into `path` (ranks above 0 add `.rank<N>` before the extension, or put `{rank}` in the path, as
with COMMSCHED_TIMELINE). Calling it again moves the trace to the new file; stop_timeline() ends
the file as a complete JSON array. mark_cycles=True adds a CYCLE_START mark at each round of the
core's agreement, which shows how collectives group into rounds.
"""

from __future__ import annotations

import os

import commsched as _api
from commsched import _core
from commsched.config import timeline_path_for


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Writes this rank's Chrome trace to `file_path` from now on; needs init() first."""
    if not isinstance(file_path, (str, os.PathLike)) or not os.fspath(file_path):
        raise ValueError(f"start_timeline needs a file path, not {file_path!r}")
    path = os.fspath(file_path)
    with _api._state.lock:
        if _api._state.pending is not None:
            # The core starts with the first tensor; it opens the trace then.
            _api._state.timeline_request = (path, bool(mark_cycles))
            return
        if not _core.running():
            raise ValueError("start_timeline() needs commsched started: call init() (hvd.init()) first")
        _core.start_timeline(timeline_path_for(path, _core.rank(), _core.size()), bool(mark_cycles))


def stop_timeline() -> None:
    """Ends the trace file started by start_timeline() (or COMMSCHED_TIMELINE); a no-op when none is open."""
    with _api._state.lock:
        _api._state.timeline_request = None
        if _core.running():
            _core.stop_timeline()


def apply_pending_request() -> None:
    """Opens the trace asked for before the core started; the caller holds the state lock."""
    request = _api._state.timeline_request
    if request is not None:
        _api._state.timeline_request = None
        path, mark_cycles = request
        _core.start_timeline(timeline_path_for(path, _core.rank(), _core.size()), mark_cycles)
