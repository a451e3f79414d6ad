"""The gRPC transport's agreement exchange: one report per rank, allgathered over the control streams.

Each rank sends its report for exchange #k to every other rank on its control stream and waits
for theirs. A peer runs at most one exchange ahead (it needs this rank's report to finish the
current one), so a report numbered outside [k, k + 1] is a protocol error, as is one that
arrives twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from commsched.transports.grpc_ops import GrpcError
from commsched.transports.grpc_ring import FrameError


class ReportOwner(Protocol):
    """The node whose failure or departures end an exchange."""

    rank: int
    size: int
    failure: str
    control_departed: set[int]  # ranks whose control stream ended on purpose


class ReportBoard:
    """Reports of the exchange in progress (and of the next one, from peers already there)."""

    def __init__(self, owner: ReportOwner, lock: threading.Condition) -> None:
        # The owner's condition: its fail() and departures notify it, which ends a waiting exchange.
        self._owner, self._lock = owner, lock
        self._reports: dict[int, dict[int, bytes]] = {}
        self._seq = 0

    def take(self, frame: Any) -> None:
        """Files a peer's report frame; FrameError if it is out of turn or repeated."""
        with self._lock:
            if not self._seq <= frame.seq <= self._seq + 1:
                raise FrameError(f"report #{frame.seq} while exchange #{self._seq} runs")
            slot = self._reports.setdefault(frame.seq, {})
            if frame.src in slot:
                raise FrameError(f"report #{frame.seq} arrived twice")
            slot[frame.src] = bytes(frame.payload)
            self._lock.notify_all()

    def exchange(
        self,
        report: bytes,
        timeout_s: float,
        send: Callable[[int, bytes], None],
        address_of: Callable[[int], str],
    ) -> list[bytes]:
        """Allgathers `report`: `send(seq, report)` tells every peer, then this waits for theirs."""
        owner = self._owner
        with self._lock:
            seq = self._seq
            if owner.failure:
                raise GrpcError(owner.failure)
        send(seq, report)
        with self._lock:
            slot = self._reports.setdefault(seq, {})
            ready = self._lock.wait_for(
                lambda: (
                    len(slot) == owner.size - 1
                    or bool(owner.failure)
                    or bool(owner.control_departed - set(slot))
                ),
                timeout_s,
            )
            if owner.failure:
                raise GrpcError(owner.failure)
            gone = sorted(owner.control_departed - set(slot))
            if gone and len(slot) < owner.size - 1:
                raise GrpcError(f"rank {owner.rank}: ranks {gone} shut down while this rank still exchanges")
            if not ready:
                missing = sorted(set(range(owner.size)) - set(slot) - {owner.rank})
                raise GrpcError(
                    f"rank {owner.rank}: no agreement report from ranks {missing} "
                    f"({', '.join(address_of(p) for p in missing)}) within {timeout_s:.0f}s"
                )
            del self._reports[seq]
            self._seq = seq + 1
        slot[owner.rank] = report
        return [slot[r] for r in range(owner.size)]
