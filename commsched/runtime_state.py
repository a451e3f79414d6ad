"""What init() decided and which thread drives its own collectives: the state the API's modules share."""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commsched import config as _config
    from commsched import launch as _launch


class _State:
    """What init() decided, kept for config() and local_rank()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: _config.Settings | None = None
        self.transport = ""
        self.local_rank = 0
        self.local_size = 1
        self.launcher = ""
        self.unnamed = itertools.count()
        self.user_given: frozenset[str] = frozenset()  # settings the auto-tuner must leave alone
        self.tuner: Any = None  # commsched.autotune.Tuner while tuning
        # True while the transport moves GPU memory (NCCL): host tensors are refused then.
        self.device_memory = False
        # init() whose transport waits for the first tensor: (launch info, rank, size).
        self.pending: tuple[_launch.LaunchInfo, int, int] | None = None
        # start_timeline() called while pending: (path, mark_cycles), opened when the core starts.
        self.timeline_request: tuple[str, bool] | None = None

    def initialized_here(self) -> bool:
        """True from this rank's init() to its own shutdown(), whether or not the core still runs
        (a peer's shutdown stops it): what Horovod's is_initialized() answers."""
        return self.settings is not None

    def started_on(self, transport: str) -> bool:
        """True when this rank's init() started `transport` and its own shutdown() has not come yet."""
        return self.initialized_here() and self.pending is None and self.transport == transport


_state = _State()
# Per thread: whether the collectives it submits now are waited for by it next (_caller_drives).
_submitter = threading.local()


@contextlib.contextmanager
def _caller_drives() -> Any:
    """Collectives this thread submits inside are waited for by it right after, so the core's
    thread is not woken for them: the waiting caller runs the round itself. On a busy host the
    wake-up cost the submitting thread ~200 us (the woken thread took its CPU); a rank that never
    waits still has them picked up by the core's next heartbeat."""
    previous = getattr(_submitter, "drives", False)
    _submitter.drives = True
    try:
        yield
    finally:
        _submitter.drives = previous
