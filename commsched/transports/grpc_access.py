"""Who may talk to a gRPC rank: refused attempts, logged without flooding the log, and telling a
peer that uses TLS from one that does not."""

from __future__ import annotations

import logging
import threading
import time

from commsched.transports.grpc_tls import speaks_tls

log = logging.getLogger("commsched")


class RefusalLog:
    """Logs refused connections at most once per interval, with how many were refused in between,
    so a flood of bad attempts cannot flood the log with one WARNING line per attempt."""

    def __init__(self, rank: int, interval_s: float = 10.0) -> None:
        self._rank = rank
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last_logged = float("-inf")
        self._suppressed = 0

    def refused(self, peer: str, why: str) -> None:
        """Counts one refused attempt; logs it if the last line is older than the interval."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_logged < self._interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last_logged = self._suppressed, 0, now
        more = f" ({suppressed} more refused since the last such line)" if suppressed else ""
        log.warning("grpc rank %d: refused a connection from %s: %s%s", self._rank, peer, why, more)

    def flush(self) -> None:
        """Logs the count of refusals not logged yet (at close)."""
        with self._lock:
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            log.warning(
                "grpc rank %d: %d more connections refused since the last such line", self._rank, suppressed
            )


def tls_mismatch(address: str, rank: int, uses_tls: bool) -> str:
    """Why the peer at host:port cannot be reached if one side uses TLS and the other does not, else ""."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return ""
    theirs = speaks_tls(host.strip("[]"), int(port))
    if theirs is None or theirs == uses_tls:
        return ""
    fix = "set COMMSCHED_GRPC_TLS_CA, COMMSCHED_GRPC_TLS_CERT and COMMSCHED_GRPC_TLS_KEY on every rank, or on none"
    if theirs:
        return f"rank {rank} does not use TLS, but the rank at {address} does: {fix}"
    return f"rank {rank} uses TLS (COMMSCHED_GRPC_TLS_*), but the rank at {address} does not: {fix}"
