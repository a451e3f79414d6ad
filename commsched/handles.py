"""Handle: a collective in flight, waited for on the host or, for GPU memory, on a CUDA stream."""

from __future__ import annotations

import math
import time
from typing import Any

from commsched import _core, buffers

_WAIT_SLICE_S = 0.2


class Handle:
    """A collective in flight; wait() returns the reduced array.

    Dropping a handle (and the array) before it finishes is safe: the core keeps the array's
    memory alive until the collective ends.
    """

    def __init__(self, core_handle: Any, array: Any, view: buffers.BufferView) -> None:
        self._core_handle = core_handle
        self._array = array
        self._view = view

    @property
    def name(self) -> str:
        """The tensor name the collective was submitted under."""
        return self._core_handle.name

    def done(self) -> bool:
        """True once the collective finished (or failed)."""
        return self._core_handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until done and returns the array; raises TimeoutError or a CommschedError."""
        deadline = deadline_of(timeout, self.name)
        while True:
            # Wait in slices so Ctrl-C and other signals are handled while a collective hangs.
            left = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - time.monotonic())
            if self._core_handle.wait(max(left, 0.0)):
                return self._array
            if deadline is not None and time.monotonic() >= deadline:
                break
        raise _timed_out(self.name, timeout)

    def wait_stream(self, stream: int, timeout: float | None = None) -> Any:
        """Makes CUDA `stream` wait for the collective on the GPU and returns the array (on device transports).

        The host waits only until the collective is launched on commsched's stream; work queued on
        `stream` afterwards sees the result. On host transports this is wait().
        """
        deadline = deadline_of(timeout, self.name)
        while True:
            left = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - time.monotonic())
            if self._core_handle.wait_stream(stream, max(left, 0.0)):
                return self._array
            if deadline is not None and time.monotonic() >= deadline:
                break
        raise _timed_out(self.name, timeout)


def deadline_of(timeout: float | None, name: str) -> float | None:
    """The monotonic deadline of a wait of `timeout` seconds (None: none); nan is refused, not waited forever."""
    if timeout is None:
        return None
    if math.isnan(timeout):
        raise ValueError(
            f"wait for '{name}': timeout is nan; pass seconds (0 only checks, math.inf or None waits until done)"
        )
    return time.monotonic() + timeout


def _timed_out(name: str, timeout: float | None) -> TimeoutError:
    """The error for a collective that did not finish in time, saying where it stands."""
    where = _core.describe(name) if _core.running() else "commsched is not running"
    return TimeoutError(
        f"collective on '{name}' did not finish within {timeout}s"
        + (f" (it is {where})" if where else "")
        + "; COMMSCHED_STALL_TIMEOUT warnings name the ranks that have not submitted it"
    )
