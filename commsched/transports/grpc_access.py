"""Who may talk to a gRPC rank: refused attempts, logged without flooding the log, telling a peer
that uses TLS from one that does not, why a TLS handshake with rank 0 fails, and joining rank 0's
rendezvous."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import grpc

from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_stream import JOIN_METHOD
from commsched.transports.grpc_tls import TlsFiles, handshake_refusal, speaks_tls
from commsched.transports.grpc_tls_check import door_refusal

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


def join_rendezvous(
    channel: grpc.Channel,
    master: str,
    request: Any,
    metadata: list[tuple[str, str]],
    deadline: float,
    tls: TlsFiles | None,
    token: str = "",
) -> list[str]:
    """Joins rank 0 at `master`; returns every rank's server address. Raises TimeoutError with the
    last answer when rank 0 does not take the join in time, ConnectionRefusedError naming a TLS
    mismatch or why the TLS handshake with rank 0 fails (with gRPC's own reason)."""
    join = channel.unary_unary(
        JOIN_METHOD,
        request_serializer=wire.JoinRequest.SerializeToString,
        response_deserializer=wire.JoinReply.FromString,
    )

    def grpc_reason() -> str:
        """gRPC's reason the channel is not up: a call that does not wait for it says."""
        try:
            join(request, timeout=1.0, metadata=metadata)
        except grpc.RpcError as error:
            return _last_error(error.details() or "")
        return ""

    _wait_until_reachable(channel, master, request.rank, deadline, tls, grpc_reason, token)
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = join(
                request,
                timeout=max(0.1, deadline - time.monotonic()),
                wait_for_ready=True,
                metadata=metadata,
            )
            return list(reply.addresses)
        except grpc.RpcError as error:
            last = f"{error.code().name}: {error.details()}"
            if error.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT):
                break  # the job refuses us; retrying cannot help
            time.sleep(0.05)  # rank 0 is still starting, or a previous run's server is closing
    raise TimeoutError(last)


def _wait_until_reachable(
    channel: grpc.Channel,
    master: str,
    rank: int,
    deadline: float,
    tls: TlsFiles | None,
    grpc_reason: Any,
    token: str,
) -> None:
    """Waits until the channel to rank 0 is up (the join then reports a timeout if it never is).

    A TLS server and a plaintext client (or the reverse), or a certificate one side refuses, only
    ever see a connection that does not come up: asking the server what it speaks, and trying the
    TLS handshake with Python's ssl, turns that into an error naming the cause and the setting.
    The handshake is tried at rank 0's TLS check port first, so rank 0 learns the reason too.
    """
    while (left := deadline - time.monotonic()) > 0:
        try:
            grpc.channel_ready_future(channel).result(timeout=min(1.0, left))
            return
        except grpc.FutureTimeoutError:
            problem = tls_mismatch(master, rank, tls is not None)
            if not problem and tls is not None:
                problem = door_refusal(master, tls, token, rank)
                if problem is None:  # no check port there: the handshake with gRPC's own port tells
                    problem = handshake_refusal(master, tls, "rank 0")
                if problem:
                    said = grpc_reason()
                    problem = f"rank {rank}: {problem}" + (f" (gRPC: {said})" if said else "")
            if problem:
                raise ConnectionRefusedError(problem) from None


def _last_error(details: str) -> str:
    """The cause in a gRPC connection failure's details, without the words around it."""
    text = details.split("last error: ", 1)[-1]
    text = re.sub(r"^(UNKNOWN|UNAVAILABLE): ", "", text)
    return re.sub(r": OK$", "", text).strip()
