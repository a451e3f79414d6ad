"""How gRPC ranks learn each other's addresses and reach each other before any stream opens.

Two ways to meet: rank 0 holds a rendezvous at MASTER_ADDR:MASTER_PORT (the others join with their
own server's address and get everyone's back), or COMMSCHED_GRPC_PEERS lists every rank's address.
Either way each rank then waits until its channel to every peer is up. All of it happens within one
limit counted from the rank's start (the join limit; under commsched.init the larger stall limit),
so a rank that starts a little late still makes it, and one that never starts is named, with its
address, the limit, the variable that sets it and the setting to check. A wait longer than a few
seconds is logged now and then, so the ranks that wait for a late one are not silent meanwhile.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_access import tls_mismatch
from commsched.transports.grpc_net import Endpoint
from commsched.transports.grpc_ops import GrpcError
from commsched.transports.grpc_stream import JOIN_METHOD
from commsched.transports.grpc_tls import TlsFiles, handshake_refusal
from commsched.transports.grpc_tls_check import door_refusal, open_door

log = logging.getLogger("commsched")

_PROBE_EVERY_S = 1.0  # a channel not up after this long may never come up: ask the peer why
# A rank that found a TLS refusal keeps its server up this long before it raises, so a peer probing
# every _PROBE_EVERY_S still reaches it and names the refusal too. With 0.5 s, a peer started first
# once probed only after the server had gone, and waited out the join limit (a loaded host).
TLS_VERDICT_HOLD_S = _PROBE_EVERY_S + 0.5
_VERDICT_GRACE_S = 2.0  # how long past its own join limit a rank waits for rank 0's word on the others


@dataclass(frozen=True)
class JoinLimit:
    """How long a rank may take to meet and reach the others, and the setting that says so."""

    seconds: float
    setting: str = "the transport's join_timeout_s"

    def __str__(self) -> str:
        return f"{self.seconds:g}s (the join limit, set by {self.setting})"


class Waiting:
    """Logs now and then that this rank still waits, and for whom, so a long wait is not silent."""

    def __init__(self, rank: int, limit: JoinLimit, started: float) -> None:
        self._rank, self._limit, self._started = rank, limit, started
        self.every_s = min(30.0, max(1.0, limit.seconds / 4))
        self._next = started + self.every_s

    def note(self, whom: Callable[[], str]) -> None:
        """Logs `whom()` with the time waited so far if the last line is old enough."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        log.warning(
            "grpc rank %d: %s, for %.0fs; giving up after %s",
            self._rank,
            whom(),
            now - self._started,
            self._limit,
        )


class MeetingOwner(Protocol):
    """What the rendezvous needs from the node that meets the others."""

    rank: int
    size: int
    endpoint: Endpoint
    tls: TlsFiles | None
    token: str
    closing: bool
    failure: str  # set when the node failed (a peer that cannot be part of this job, say)

    def channel_to(self, peer: int) -> grpc.Channel:
        """The node's channel to `peer` (kept for the streams)."""

    def open_channel(self, address: str) -> grpc.Channel:
        """A new channel to host:port with the node's options and credentials."""

    def metadata(self, channel: str) -> list[tuple[str, str]]:
        """Token, rank and channel name for a call."""


class _MissingRanks(Exception):
    """Rank 0's answer to a join when some ranks never joined."""


class Rendezvous:
    """One rank's meeting with the others: every rank's address, and a channel up to each."""

    def __init__(self, node: MeetingOwner, lock: threading.Condition, limit: JoinLimit) -> None:
        # The node's condition: its close() notifies it, which ends rank 0's waits.
        self._node, self._lock, self.limit = node, lock, limit
        self._joined: dict[int, str] = {}
        # Rank 0: why a rank cannot be part of this job (its TLS handshake failed, told at the check
        # port, or it joined with another WORLD_SIZE): the rendezvous ends at once, naming it.
        self._refusal = ""
        self._over = False  # rank 0 gave up on the joins
        self._started = self._deadline = float("inf")

    def meet(self, bound: int) -> list[str]:
        """Every rank's server address (index = rank); GrpcError naming whoever is missing."""
        node = self._node
        self._started = time.monotonic()
        self._deadline = self._started + self.limit.seconds
        waiting = Waiting(node.rank, self.limit, self._started)
        if node.endpoint.peers:
            return list(node.endpoint.peers)
        if node.rank == 0:
            self._joined[0] = f"{node.endpoint.advertise}:{bound}"
            door = open_door(node.tls, node.endpoint.bind, bound, node.token, self._refused, node.size)
            try:
                return self._wait_for_joins(bound, waiting)
            finally:
                if door is not None:
                    door.close()
        return self._join(bound, waiting)

    def reach(self, addresses: list[str]) -> None:
        """Waits until the channel to every peer is up, within what is left of the join limit."""
        node = self._node
        peers = [peer for peer in range(node.size) if peer != node.rank]
        started = time.monotonic()
        waiting = Waiting(node.rank, self.limit, self._started)  # says how long since this rank began
        ready = {peer: grpc.channel_ready_future(node.channel_to(peer)) for peer in peers}
        probed: dict[int, float] = {}
        try:
            while pending := [peer for peer in peers if not ready[peer].done()]:
                if node.failure:
                    raise GrpcError(node.failure)
                now = time.monotonic()
                if now >= self._deadline:
                    raise GrpcError(self._unreachable(pending, addresses))
                if now - started >= _PROBE_EVERY_S:
                    for peer in pending:
                        if now - probed.get(peer, 0.0) >= _PROBE_EVERY_S:
                            probed[peer] = now
                            self._refuse_on_tls(addresses[peer], f"rank {peer}")
                            if not node.endpoint.peers and _refuses(addresses[peer]):
                                # Its server was up when it joined: a refusal now means it is gone.
                                raise GrpcError(
                                    f"rank {node.rank}: rank {peer} joined rank 0 from {addresses[peer]}, but "
                                    "its server there refuses connections now: it exited (see its own "
                                    "output), or a firewall rejects that port"
                                )
                waiting.note(
                    lambda: (
                        "waiting to reach "
                        + ", ".join(f"rank {peer} at {addresses[peer]}" for peer in pending)
                    )
                )
                time.sleep(0.05)
        finally:
            for future in ready.values():
                future.cancel()

    def _refuse_on_tls(self, address: str, peer: str) -> None:
        """Raises GrpcError if the peer at `address` speaks TLS and this rank not (or the reverse),
        or if the TLS handshake with it fails."""
        node = self._node
        problem = tls_mismatch(address, node.rank, node.tls is not None)
        if not problem and node.tls is not None:
            problem = handshake_refusal(address, node.tls, peer)
        if problem:
            # The peer's own check of this rank's server gets its answer first.
            time.sleep(TLS_VERDICT_HOLD_S)
            raise GrpcError(f"rank {node.rank}: {problem}")

    def _unreachable(self, pending: list[int], addresses: list[str]) -> str:
        node = self._node
        who = ", ".join(f"rank {peer} at {addresses[peer]}" for peer in pending)
        if node.endpoint.peers:
            entries = ", ".join(str(peer) for peer in pending)
            check = (
                f"is each of them running, and does COMMSCHED_GRPC_PEERS list its address (entry {entries}, "
                "counting from 0) the same on every rank?"
            )
        else:
            check = (
                "they joined rank 0 but their servers cannot be reached from here: did they exit, or is the "
                "address they listen on (COMMSCHED_GRPC_BIND) reachable from this host?"
            )
        return f"rank {node.rank} could not reach {who} within {self.limit}: {check}"

    # ---------------------------------------------------------------- rank 0

    def _refused(self, sentence: str) -> None:
        with self._lock:
            self._refusal = self._refusal or sentence
            self._lock.notify_all()

    def _wait_for_joins(self, bound: int, waiting: Waiting) -> list[str]:
        """Rank 0: waits until every rank joined; GrpcError naming the missing ones or a TLS refusal."""
        node = self._node
        with self._lock:
            while len(self._joined) < node.size and not self._refusal:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._over = True
                    self._lock.notify_all()  # the joined ranks' calls hear who is missing
                    missing = self._missing()
                    raise GrpcError(
                        f"rank 0: ranks {missing} did not join at {node.endpoint.bind}:{bound} within "
                        f"{self.limit}; check that they started, with the same MASTER_ADDR/MASTER_PORT, "
                        f"WORLD_SIZE and COMMSCHED_JOB_TOKEN, and that every rank "
                        f"{'sets' if node.tls else 'leaves unset'} COMMSCHED_GRPC_TLS_*"
                        + (". With TLS, a rank refused in the handshake names the reason" if node.tls else "")
                    )
                self._lock.wait(min(left, waiting.every_s))
                waiting.note(lambda: f"waiting for ranks {self._missing()} to join at port {bound}")
            if len(self._joined) < node.size:
                self._over = True
                self._lock.notify_all()
                raise GrpcError(f"rank 0: {self._refusal}")
            return [self._joined[r] for r in range(node.size)]

    def _missing(self) -> list[int]:
        return sorted(set(range(self._node.size)) - set(self._joined))

    def serve_join(self, request: Any, context: grpc.ServicerContext, peer: int) -> Any:
        """Rank 0's answer to an authenticated join: every address once all joined, or who did not."""
        node = self._node
        if node.rank != 0 or node.endpoint.peers:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"rank {node.rank} does not hold the rendezvous"
            )
        if request.rank != peer:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"a join as rank {request.rank} on rank {peer}'s call"
            )
        if request.size != node.size:
            self._refused(
                f"rank {peer} ({context.peer()}) joined with WORLD_SIZE={request.size}, but this rank has "
                f"WORLD_SIZE={node.size}; every rank of a job must be started with the same WORLD_SIZE"
            )
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank 0 has WORLD_SIZE={node.size}, this rank {request.size}: every rank of a job must be "
                "started with the same WORLD_SIZE",
            )
        with self._lock:
            if len(self._joined) == node.size and self._joined.get(peer) != request.address:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "this rendezvous is over (a previous run?)"
                )
            if self._joined.setdefault(peer, request.address) != request.address:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"rank {peer} already joined from another address"
                )
            self._lock.notify_all()
            self._lock.wait_for(
                lambda: len(self._joined) == node.size or node.closing or self._over,
                max(0.0, self._deadline - time.monotonic()),
            )
            if len(self._joined) < node.size:
                context.abort(
                    grpc.StatusCode.ABORTED,
                    f"ranks {self._missing()} did not join rank 0 within {self.limit}",
                )
            return wire.JoinReply(addresses=[self._joined[r] for r in range(node.size)])

    # ---------------------------------------------------------------- the other ranks

    def _join(self, bound: int, waiting: Waiting) -> list[str]:
        node = self._node
        request = wire.JoinRequest(
            rank=node.rank, size=node.size, address=f"{node.endpoint.advertise}:{bound}"
        )
        master = node.endpoint.master
        channel = node.open_channel(master)
        try:
            return join_rendezvous(
                channel, master, request, node.metadata("join"), self._deadline, node.tls, node.token, waiting
            )
        except _MissingRanks as error:
            raise GrpcError(
                f"rank {node.rank}: {error} (rank 0 at {master} says so); check that they started, with the "
                "same MASTER_ADDR/MASTER_PORT and WORLD_SIZE"
            ) from None
        except TimeoutError as error:
            raise GrpcError(
                f"rank {node.rank}: could not join rank 0 at {master} within {self.limit} ({error}); "
                "check that rank 0 runs, MASTER_ADDR/MASTER_PORT, WORLD_SIZE"
                + (
                    " COMMSCHED_JOB_TOKEN and COMMSCHED_GRPC_TLS_*"
                    if node.tls
                    else " and COMMSCHED_JOB_TOKEN"
                )
            ) from None
        except ConnectionRefusedError as error:
            raise GrpcError(str(error)) from None
        finally:
            channel.close()


def join_rendezvous(
    channel: grpc.Channel,
    master: str,
    request: Any,
    metadata: list[tuple[str, str]],
    deadline: float,
    tls: TlsFiles | None,
    token: str = "",
    waiting: Waiting | None = None,
) -> list[str]:
    """Joins rank 0 at `master`; returns every rank's server address. Raises TimeoutError with the
    last answer when rank 0 does not take the join in time, _MissingRanks when rank 0 gave up on
    others, ConnectionRefusedError naming a TLS mismatch or why the TLS handshake with rank 0 fails
    (with gRPC's own reason)."""
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

    def note() -> None:
        if waiting is not None:
            waiting.note(lambda: f"waiting at rank 0 ({master}) for every rank to join")

    last = "no answer"
    if _wait_until_reachable(channel, master, request.rank, deadline, tls, grpc_reason, token, note):
        # Rank 0 is there, and its verdict names who did not join: it may come a little after
        # this rank's own limit, as rank 0's began when rank 0 started.
        deadline += _VERDICT_GRACE_S
    # Calls no longer than a log interval, so this rank says now and then that it still waits.
    slice_s = waiting.every_s if waiting is not None else float("inf")
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply = join(
                request, timeout=max(0.1, min(left, slice_s)), wait_for_ready=True, metadata=metadata
            )
            return list(reply.addresses)
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.ABORTED:
                raise _MissingRanks(error.details()) from None
            last = (
                "rank 0 still waited for other ranks to join"
                if code == grpc.StatusCode.DEADLINE_EXCEEDED
                else f"{code.name}: {error.details()}"
            )
            if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT):
                # The job refuses this rank; retrying cannot help.
                raise ConnectionRefusedError(
                    f"rank {request.rank}: rank 0 at {master} refused the join: {error.details()}"
                ) from None
            note()
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
    note: Callable[[], None],
) -> bool:
    """Waits until the channel to rank 0 is up; False if it is not by `deadline`.

    A TLS server and a plaintext client (or the reverse), or a certificate one side refuses, only
    ever see a connection that does not come up: asking the server what it speaks, and trying the
    TLS handshake with Python's ssl, turns that into an error naming the cause and the setting.
    The handshake is tried at rank 0's TLS check port first, so rank 0 learns the reason too.
    """
    while (left := deadline - time.monotonic()) > 0:
        try:
            grpc.channel_ready_future(channel).result(timeout=min(_PROBE_EVERY_S, left))
            return True
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
            note()
    return False


def _refuses(address: str) -> bool:
    """True if nothing listens at host:port (the connection is refused, not just unanswered)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


def _last_error(details: str) -> str:
    """The cause in a gRPC connection failure's details, without the words around it."""
    text = details.split("last error: ", 1)[-1]
    text = re.sub(r"^(UNKNOWN|UNAVAILABLE): ", "", text)
    return re.sub(r": OK$", "", text).strip()
