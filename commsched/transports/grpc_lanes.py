"""One ring of the gRPC transport: the ring of every rank, or a process set's ring of its members.

A lane holds its own collective numbering, its own pending ops and its own data streams to its
right-hand member, so that a set's frames are never taken for the global ring's or another set's,
and a set's collective in flight waits on nothing but its own members. Frames arrive on the
stream they were sent by; the stream's kind says which lane they belong to. The global ring's
large pieces may travel over a bulk connection instead (grpc_bulk), received in place where the
ring copies them; process sets' rings stay on their gRPC streams.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from commsched.transports.grpc_frames import DataFrame
from commsched.transports.grpc_ops import GrpcError, PendingOp, plan_collective
from commsched.transports.grpc_ring import FrameError, RingOp, array_at
from commsched.transports.grpc_stream import Outbox

# A peer may start this many collectives of a lane ahead of this rank.
MAX_AHEAD = 65536


class LaneOwner(Protocol):
    """The node whose failure ends every lane."""

    failure: str

    def fail(self, message: str, tell_peers: bool = True) -> None:
        """Ends every pending collective with `message`."""


def set_stream_kind(serial: int) -> str:
    """The data stream kind of the process set added `serial`-th (every rank counts adds alike)."""
    return f"set{serial}"


class BulkSender(Protocol):
    """A socket link to the right-hand member that takes the lane's large pieces."""

    threshold: int

    def put(self, frame: DataFrame) -> None:
        """Queues a data frame for the right-hand member."""


class Lane:
    """The collectives of one ring: numbering, pending ops and the streams to its right-hand member."""

    def __init__(
        self,
        node: LaneOwner,
        members: Sequence[int],
        rank: int,
        piece_bytes: int,
        direct_bytes: int,
        name: str,
        stream_kind: str = "",
    ) -> None:
        self._node = node
        self.stream_kind = stream_kind  # a process set's data stream; "" for the global ring's
        self.members = list(members)
        self.position = self.members.index(rank)
        self.size = len(self.members)
        self.rank, self.name = rank, name
        self.right = self.members[(self.position + 1) % self.size]
        self.left = self.members[(self.position - 1) % self.size]
        self.piece_bytes, self.direct_bytes = piece_bytes, direct_bytes
        self.outboxes: list[Outbox] = []
        self.bulk: BulkSender | None = None  # takes pieces of at least bulk.threshold bytes
        # Changed under `lock` by start() and by the incoming stream's thread.
        self.lock = threading.RLock()
        self.ops: dict[int, PendingOp] = {}  # begun here, still expecting pieces
        self.live: dict[int, PendingOp] = {}  # begun here, not done yet (some may still be sending)
        self._early: dict[int, list[Any]] = {}
        self._next_seq = 0  # next collective number start() hands out (core thread)
        self._begun = 0  # collectives below this number were begun here
        self.finished_below = 0  # every collective below this number received all its pieces

    def start(
        self,
        address: int,
        count: int,
        dtype: str,
        kind: str,
        root: int,
        op: str = "sum",
        array: Any = None,
        bounds: list[tuple[int, int]] | None = None,
        finish: Callable[[], None] | None = None,
    ) -> PendingOp:
        """Begins a collective (`root`: a position in the lane); the streams' threads do the rest."""
        seq = self._next_seq
        self._next_seq += 1
        pending = PendingOp(finish)
        pending.ring = RingOp(
            seq,
            array_at(address, count, dtype) if array is None else array,
            dtype,
            kind,
            root,
            self.position,
            self.size,
            self.piece_bytes,
            (lambda frame: self._send(pending, frame)) if self.outboxes else _no_peer,
            op=op,
            bounds=bounds,
            direct_bytes=self.direct_bytes,
            ranks=self.members,
        )
        try:
            with self.lock:
                if self._node.failure:
                    pending.fail(self._node.failure)
                    return pending
                self.ops[seq] = self.live[seq] = pending
                self._begun = seq + 1
                self.finished_below = min(self.ops)
                pending.ring.begin()
                for frame in self._early.pop(seq, []):
                    pending.ring.receive(frame)
                self._settle(pending)
        except FrameError as error:
            self._node.fail(f"rank {self.rank} rejected data from rank {self.left}: {error}")
        return pending

    def start_collective(
        self,
        kind: str,
        dtype: str,
        op: str,
        address: int,
        count: int,
        output: int,
        recv_counts: list[int],
        layout: list[int],
    ) -> PendingOp:
        """Starts an allgather, reducescatter or alltoall among the lane's members (see plan_collective)."""
        ring_kind, array, bounds, finish = plan_collective(
            kind, dtype, address, count, output, recv_counts, layout, self.position, self.size
        )
        return self.start(0, 0, dtype, ring_kind, 0, op, array, bounds, finish)

    def _send(self, op: PendingOp, frame: DataFrame) -> None:
        op.track(frame)
        if self.bulk is not None and frame.payload.nbytes >= self.bulk.threshold:
            self.bulk.put(frame)
        else:
            self.outboxes[frame.piece % len(self.outboxes)].put(frame)

    def landing(self, frame: Any) -> tuple[np.ndarray, PendingOp] | None:
        """The part of a begun collective's buffer a copied frame may be received into, with its op
        borrowed (hand it to `landed`); None where the frame goes through `apply`."""
        with self.lock:
            op = self.ops.get(frame.seq)
            if op is None:
                return None
            target = op.ring.landing(frame)
            if target is None or not op.borrow():
                return None
            return target, op

    def landed(self, frame: Any, op: PendingOp, complete: bool) -> None:
        """Counts a frame received in place (`complete`: every byte arrived) and gives the op back."""
        try:
            with self.lock:
                if complete and self.ops.get(frame.seq) is op:
                    op.ring.receive(frame, landed=True)
                    op.progress_at = time.monotonic()
                    self._settle(op)
        finally:
            op.give_back()

    def apply(self, frame: Any, reused: bool = False) -> None:
        """Applies one data frame to its collective, on the thread of the stream it came by;
        `reused`: its payload's memory is overwritten once this returns."""
        with self.lock:
            if frame.seq < self.finished_below:
                raise FrameError(f"collective #{frame.seq} of {self.name} is already finished")
            op = self.ops.get(frame.seq)
            if op is None:
                if self._node.failure:
                    return  # the op was ended already; late frames go nowhere
                if frame.seq < self._begun:
                    raise FrameError(
                        f"frame for collective #{frame.seq} of {self.name}, which already finished"
                    )
                if frame.seq > self._begun + MAX_AHEAD:
                    raise FrameError(f"frame for collective #{frame.seq}, far ahead of #{self._begun}")
                # The peer started it before us; the payload is kept (copied if its memory is reused).
                if reused:
                    frame.payload = memoryview(bytes(frame.payload))
                self._early.setdefault(frame.seq, []).append(frame)
                return
            op.ring.receive(frame)
            op.progress_at = time.monotonic()
            self._settle(op)

    def _settle(self, op: PendingOp) -> None:
        if not op.ring.done:
            return
        del self.ops[op.ring.seq]
        self.finished_below = min(self.ops, default=self._begun)
        op.received_all()
        if op.done:
            self.live.pop(op.ring.seq, None)

    def stalled(self, now: float, timeout_s: float, address_of: Callable[[int], str]) -> str:
        """Why the oldest stalled collective waits, or "" when data flows (forgets finished ops)."""
        for seq, op in list(self.live.items()):
            if op.done or op.error:
                self.live.pop(seq, None)
            elif now - op.progress_at > timeout_s:
                waits = f"no data from rank {self.left} at {address_of(self.left)}"
                if op.ring.done:
                    waits = f"its data to rank {self.right} at {address_of(self.right)} did not leave"
                where = "" if self.name == "the global ring" else f" of {self.name}"
                return f"rank {self.rank}: {waits} for {timeout_s:.0f}s during {op.ring.describe()}{where}"
        return ""

    def fail(self, message: str) -> None:
        """Ends every collective of the lane with `message`."""
        with self.lock:
            self.ops.clear()
            self._early.clear()
            live, self.live = list(self.live.values()), {}
        for op in live:
            op.fail(message)


def _no_peer(frame: Any) -> None:
    raise GrpcError("a ring of one rank sends no data")
