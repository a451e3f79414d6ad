"""A gRPC collective as the core sees it, and how allgather, reducescatter and alltoall map onto
the ring's collectives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from commsched.transports.grpc_frames import DataFrame
from commsched.transports.grpc_ring import RingOp, array_at


class GrpcError(RuntimeError):
    """The gRPC transport failed; the message names the peer and what happened."""


class PendingOp:
    """A collective in flight as the core sees it: done once every piece arrived and every piece
    it sends was encoded (read from its buffer); `lock` guards that count, `done` and `error`.

    A socket transfer that reads or writes its buffer in place (grpc_bulk) borrows the op first;
    a failure is reported only once every borrow is given back, so the caller never frees memory
    a transfer still touches.
    """

    def __init__(self, finish: Callable[[], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.ring: RingOp
        self.done = False
        self.error = ""
        self.progress_at = time.monotonic()
        self._received_all = False
        self._unsent = 0
        self._borrowed = 0
        self._callbacks: list[Callable[[], None]] = []
        self._finish = finish  # moves the ring's result into the core's output, on the core's thread

    def test(self) -> bool:
        """True once the collective finished; raises if it failed."""
        if self.error and not self._borrowed:
            raise GrpcError(self.error)
        if self.done and self._finish is not None:
            self._finish()
            self._finish = None
        return self.done

    def on_done(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once, from any thread, when the op finishes or fails."""
        with self.lock:
            if not (self.done or (self.error and not self._borrowed)):
                self._callbacks.append(callback)
                return
        callback()

    def track(self, frame: DataFrame) -> None:
        """Counts a frame this op sends until it is encoded."""
        frame.owner = self
        with self.lock:
            self._unsent += 1

    def encoded(self) -> None:
        """One of its frames was encoded (grpc_frames calls this with `lock` held)."""
        self._unsent -= 1
        self.progress_at = time.monotonic()
        self._settle_locked()

    def borrow(self) -> bool:
        """Marks its buffer as in use by a socket transfer; False if the op already ended."""
        with self.lock:
            if self.done or self.error:
                return False
            self._borrowed += 1
            return True

    def give_back(self, sent: bool = False) -> None:
        """Ends a borrow; `sent`: the transfer sent one of its frames (counted as encoded)."""
        with self.lock:
            self._borrowed -= 1
            if sent:
                self._unsent -= 1
                self.progress_at = time.monotonic()
            if self.error:
                if not self._borrowed:
                    self._ring_locked()
            else:
                self._settle_locked()

    def received_all(self) -> None:
        """Every expected piece arrived and was applied."""
        with self.lock:
            self._received_all = True
            self._settle_locked()

    def fail(self, message: str) -> None:
        """Ends the op with `message` unless it already finished."""
        with self.lock:
            if self.done or self.error:
                return
            self.error = message
            if not self._borrowed:
                self._ring_locked()

    def _settle_locked(self) -> None:
        if self._received_all and self._unsent == 0 and not self.done and not self.error:
            self.done = True
            self._ring_locked()

    def _ring_locked(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def bounds_of(counts: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of consecutive parts of the given lengths."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def plan_collective(
    kind: str,
    dtype: str,
    address: int,
    count: int,
    output: int,
    recv_counts: list[int],
    layout: list[int],
    rank: int,
    size: int,
) -> tuple[str, np.ndarray, list[tuple[int, int]], Callable[[], None] | None]:
    """(ring kind, array, bounds, finish) for an allgather, reducescatter or alltoall.

    Allgather and reducescatter are the two halves of the ring allreduce; alltoall is a ring
    allgather of every rank's whole input, of which each rank keeps what was sent to it (n times
    the traffic of a direct exchange: the ring's streams reach the right-hand neighbour only).
    `finish` moves the result into `output`, on the core's thread.
    """
    source = array_at(address, count, dtype)
    if kind == "reducescatter":
        work = source.copy()  # the caller's input stays as it is
        bounds = bounds_of(recv_counts)
        target = array_at(output, recv_counts[rank], dtype)
        start, stop = bounds[rank]

        def kept() -> None:
            target[:] = work[start:stop]

        return kind, work, bounds, kept
    if kind == "allgather":
        bounds = bounds_of(recv_counts)
        gathered = array_at(output, sum(recv_counts), dtype)
        start, stop = bounds[rank]
        gathered[start:stop] = source
        return kind, gathered, bounds, None
    # alltoall: layout[s * size + d] elements go from rank s to rank d
    sent_by = [sum(layout[s * size : (s + 1) * size]) for s in range(size)]
    bounds = bounds_of(sent_by)
    everything = np.empty(sum(sent_by), dtype=source.dtype)
    start, stop = bounds[rank]
    everything[start:stop] = source
    target = array_at(output, sum(recv_counts), dtype)

    def picked() -> None:
        offset = 0
        for s in range(size):
            begin = bounds[s][0] + sum(layout[s * size : s * size + rank])
            target[offset : offset + recv_counts[s]] = everything[begin : begin + recv_counts[s]]
            offset += recv_counts[s]

    return "allgather", everything, bounds, picked
