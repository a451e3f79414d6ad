"""A transport over gRPC for clusters without MPI, driven through the core's Python trampoline.

Every rank runs one gRPC server. Ranks meet at rank 0 (MASTER_ADDR:MASTER_PORT) or through an
explicit address list, within a join limit that names whoever is missing (grpc_rendezvous), then keep long-lived client streams open: a control stream to every other
rank (agreement reports, so they never wait behind data) and `streams` data streams to the
right-hand ring neighbour (grpc_ring's pieces, spread over them). Every stream carries the job token
and is refused without it. Frames are protobuf (grpc_frames encodes and decodes them without
protobuf's copies), checked for size, dtype and sequence on arrival; the global ring's large pieces
take a TCP (or TLS) socket instead (grpc_bulk). A process set runs on a ring of its members with a
data stream of its own to its right-hand member (grpc_lanes). Agreement reports are allgathered
over the control streams by grpc_reports.

Threads: gRPC's sender threads encode frames (grpc_stream); the server thread of each incoming data
stream applies its frames to the buffers itself and queues the pieces they release, so a frame
crosses no queue between arrival and sum. `start` and `test`, called by the core, register and read
flags; a finished op rings the core's doorbell (on_done). A watchdog thread names stalled peers.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import weakref
from typing import Any

import grpc

from commsched.start_wait import start_wait_s
from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_access import RefusalLog
from commsched.transports.grpc_bulk import BULK_BYTES, BULK_PIECE_BYTES, BulkLink, link_stats, start_link
from commsched.transports.grpc_frames import deserialize, encode_frame
from commsched.transports.grpc_lanes import Lane, set_stream_kind
from commsched.transports.grpc_net import DaemonExecutor, Endpoint
from commsched.transports.grpc_ops import GrpcError, PendingOp
from commsched.transports.grpc_rendezvous import TLS_VERDICT_HOLD_S, JoinLimit, Rendezvous
from commsched.transports.grpc_reports import ReportBoard
from commsched.transports.grpc_ring import FrameError, check_payload
from commsched.transports.grpc_stream import CHANNEL_OPTIONS, JOIN_METHOD, STREAM_METHOD, Outbox, stream_kinds
from commsched.transports.grpc_tls import TlsFiles, check_own_certificate
from commsched.transports.grpc_tls_check import own_problem_teller, peer_refusals

log = logging.getLogger("commsched")

__all__ = ["JOIN_METHOD", "STREAM_METHOD", "GrpcError", "GrpcTransport"]
# Data streams to the ring neighbour (every rank of a job must use the same number). More than one
# measured no faster on loopback: gRPC Python's copies of each message, not the wait for the
# previous write, bound a stream.
DATA_STREAMS = 1
DIRECT_BYTES = 256 * 1024  # a 2-rank allreduce up to this size goes in one hop (grpc_ring's direct mode)
# Ring pieces on gRPC streams: gRPC Python copies each message, so smaller ones pipeline better there.
PIECE_BYTES = 1024**2


class _Node:
    """The transport's machinery; the GrpcTransport facade closes it when the core lets go."""

    def __init__(
        self,
        endpoint: Endpoint,
        token: str,
        timeout_s: float,
        piece_bytes: int,
        max_frame_bytes: int,
        tls: TlsFiles | None = None,
        join_timeout_s: float | None = None,
        streams: int = 1,
        bulk_bytes: int = BULK_BYTES,
        bulk_piece_bytes: int | None = None,
        join_limit_setting: str = "",
    ) -> None:
        self.rank, self.size = endpoint.rank, endpoint.size
        self.data_kinds = stream_kinds(streams)
        self.bulk_bytes = bulk_bytes  # 0: every piece over gRPC (every rank must agree)
        self.bulk: BulkLink | None = None
        self._join_limit_s = timeout_s if join_timeout_s is None else join_timeout_s
        self.tls = tls
        self._refusals = RefusalLog(self.rank)
        self.endpoint = endpoint
        self.token = token
        self.timeout_s = timeout_s
        self.piece_bytes = piece_bytes
        # The global ring's pieces once its bulk sockets are up (every rank agrees they are).
        self.bulk_piece_bytes = piece_bytes if bulk_piece_bytes is None else bulk_piece_bytes
        self.addresses: list[str] = []
        self.failure = ""
        self.closing = False
        self.departed: set[int] = set()  # ranks that closed their streams on purpose
        # Ranks whose control stream ended on purpose: their last report came before that
        # CLOSE on the same stream, whereas a CLOSE on a data stream may overtake it.
        self.control_departed: set[int] = set()
        self._lock = threading.Condition()
        if self.join_timeout_s < self._join_limit_s:
            join_limit_setting = (
                "half of commsched-run's --elastic-timeout, while an elastic generation starts"
            )
        limit = JoinLimit(self.join_timeout_s, *([join_limit_setting] if join_limit_setting else []))
        self._rendezvous = Rendezvous(self, self._lock, limit)
        self._board = ReportBoard(self, self._lock)
        # The global ring, and each process set's ring of its members by set id and by stream kind.
        self._global = Lane(self, range(self.size), self.rank, piece_bytes, DIRECT_BYTES, "the global ring")
        self._sets: dict[int, Lane] = {}
        self._lanes: dict[str, Lane] = {kind: self._global for kind in self.data_kinds}
        self._sets_added = 0  # every rank adds the same sets in the same order, so the counts agree
        self._streams_in: set[tuple[int, str]] = set()
        self._outboxes: dict[tuple[int, str], Outbox] = {}
        limit = max(max_frame_bytes, piece_bytes + 64 * 1024)
        # Each incoming stream holds a server thread for its life; process sets' streams take the spare ones.
        threads = (2 + len(self.data_kinds)) * self.size + 64
        self._pool = DaemonExecutor(threads, "commsched-grpc")
        self._server = grpc.server(
            self._pool,
            handlers=[self._handlers()],
            options=CHANNEL_OPTIONS + [("grpc.max_receive_message_length", limit)],
            maximum_concurrent_rpcs=threads,
        )
        self._channel_options = CHANNEL_OPTIONS + [("grpc.max_send_message_length", limit)]
        if tls is not None:
            self._channel_options += tls.channel_options()
        self._channels: dict[int, grpc.Channel] = {}
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="commsched-grpc-watchdog", daemon=True)

    # ---------------------------------------------------------------- setup

    @property
    def join_timeout_s(self) -> float:
        """How long a meeting of every rank may wait: the larger stall limit, or less while an elastic
        generation starts (every rank reached init(): one lost there must not hold the rest)."""
        starting = start_wait_s()
        return self._join_limit_s if starting is None else min(self._join_limit_s, starting)

    def open(self) -> None:
        """Binds, meets the other ranks and opens the streams; raises GrpcError naming the peer."""
        if self.tls is not None:
            try:
                check_own_certificate(
                    self.tls, self.rank, own_problem_teller(self.endpoint, self.token, self.tls)
                )
            except ValueError as error:
                raise GrpcError(str(error)) from None
        bound = self._bind()
        self.addresses = self._rendezvous.meet(bound)
        if self.tls is not None and self.size > 1:
            refusals = peer_refusals(self.addresses, self.rank, self.tls)
            if refusals:
                # The peers' own checks of this rank's server get their answer first.
                time.sleep(TLS_VERDICT_HOLD_S)
                raise GrpcError(f"rank {self.rank}: " + "; ".join(refusals))
        self._rendezvous.reach(self.addresses)
        self._watchdog.start()
        for peer in range(self.size):
            if peer != self.rank:
                self._outboxes[(peer, "control")] = self._open_stream(peer, "control")
        if self.size > 1:
            for kind in self.data_kinds:
                self._outboxes[(self.right, kind)] = self._open_stream(self.right, kind)
                self._global.outboxes.append(self._outboxes[(self.right, kind)])
        if self.size > 1:  # every rank, so ranks with different thresholds hear of it
            self.bulk = self._global.bulk = start_link(self, self._global)
            if self.bulk is not None:
                self._global.piece_bytes = self.bulk_piece_bytes
        log.debug("grpc rank %d of %d: peers %s", self.rank, self.size, self.addresses)

    @property
    def right(self) -> int:
        """The ring neighbour this rank sends data to."""
        return (self.rank + 1) % self.size

    def _bind(self) -> int:
        address = f"{self.endpoint.bind_host()}:{self.endpoint.port}"
        try:
            if self.tls is None:
                port = self._server.add_insecure_port(address)
            else:
                port = self._server.add_secure_port(address, self.tls.server_credentials())
        except RuntimeError as error:
            raise GrpcError(
                f"rank {self.rank}: cannot listen on {address} ({error}); is the port in use?"
            ) from None
        if port == 0:
            raise GrpcError(f"rank {self.rank}: cannot listen on {address}; is the port in use?")
        self._server.start()
        return port

    def metadata(self, channel: str) -> list[tuple[str, str]]:
        return [
            ("commsched-token", self.token),
            ("commsched-rank", str(self.rank)),
            ("commsched-channel", channel),
            ("commsched-size", str(self.size)),
        ]

    def channel_to(self, peer: int) -> grpc.Channel:
        """The channel to `peer`, opened once and kept for its streams."""
        if peer not in self._channels:
            self._channels[peer] = self.open_channel(self.addresses[peer])
        return self._channels[peer]

    def open_channel(self, address: str) -> grpc.Channel:
        """A new channel to host:port with this rank's options and TLS credentials."""
        if self.tls is None:
            return grpc.insecure_channel(address, options=self._channel_options)
        return grpc.secure_channel(address, self.tls.channel_credentials(), options=self._channel_options)

    def _open_stream(self, peer: int, kind: str) -> Outbox:
        return Outbox(self, peer, self.addresses[peer], kind, self.channel_to(peer), self.metadata(kind))

    # ---------------------------------------------------------------- server side

    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            wire.SERVICE,
            {
                "Join": grpc.unary_unary_rpc_method_handler(
                    self._serve_join,
                    request_deserializer=wire.JoinRequest.FromString,
                    response_serializer=wire.JoinReply.SerializeToString,
                ),
                "Stream": grpc.stream_unary_rpc_method_handler(
                    self._serve_stream,
                    request_deserializer=deserialize,
                    response_serializer=wire.Ack.SerializeToString,
                ),
            },
        )

    def _authenticate(self, context: grpc.ServicerContext) -> tuple[int, str]:
        metadata = dict(context.invocation_metadata())
        token = str(metadata.get("commsched-token", ""))
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            self._refusals.refused(context.peer(), "wrong job token")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong job token (COMMSCHED_JOB_TOKEN)")
        try:
            peer = int(metadata.get("commsched-rank", ""))
        except ValueError:
            peer = -1
        size = str(metadata.get("commsched-size", self.size))
        if size != str(self.size) and metadata.get("commsched-channel") != "join":  # a join says it itself
            # A rank of this job (it has the token) started with another WORLD_SIZE: no wait can help.
            message = (
                f"rank {peer} ({context.peer()}) has WORLD_SIZE={size}, but rank {self.rank} has WORLD_SIZE="
                f"{self.size}; every rank of a job must be started with the same WORLD_SIZE"
                + (" and COMMSCHED_GRPC_PEERS" if self.endpoint.peers else "")
            )
            self.fail(f"rank {self.rank}: {message}", tell_peers=False)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if not 0 <= peer < self.size or peer == self.rank:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {peer} is not a peer of rank {self.rank}")
        return peer, str(metadata.get("commsched-channel", ""))

    def _serve_join(self, request: Any, context: grpc.ServicerContext) -> Any:
        peer, _ = self._authenticate(context)
        return self._rendezvous.serve_join(request, context, peer)

    def _serve_stream(self, frames: Any, context: grpc.ServicerContext) -> Any:
        peer, kind = self._authenticate(context)
        data = kind in self.data_kinds or _is_set_stream(kind)
        if not (kind == "control" or data) or (
            kind in self.data_kinds and peer != (self.rank - 1) % self.size
        ):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"rank {self.rank} takes no {kind} stream from rank {peer}"
            )
        with self._lock:
            if (peer, kind) in self._streams_in:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"rank {peer} already has a {kind} stream open")
            self._streams_in.add((peer, kind))
        closed = False
        try:
            for frame in frames:
                if frame.channel == wire.CLOSE:
                    closed = True
                    if _is_set_stream(kind):
                        break  # the set was removed; the peer itself may stay
                    with self._lock:
                        self.departed.add(peer)  # it shuts down: our streams to it may end now
                        if kind == "control":
                            self.control_departed.add(peer)
                        self._lock.notify_all()
                    break
                self._check_frame(frame, peer, data)
                if frame.channel == wire.ABORT:
                    reason = bytes(frame.payload).decode(errors="replace")
                    self.fail(f"rank {peer} failed: {reason}", tell_peers=False)
                elif frame.channel == wire.CONTROL:
                    self._board.take(frame)
                else:
                    self._lane_of(kind, peer).apply(frame)
        except FrameError as error:
            message = f"rank {self.rank} rejected a frame from rank {peer} ({context.peer()}): {error}"
            self.fail(message)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        except grpc.RpcError:
            pass  # the peer went away mid-stream; handled below
        if not closed and not self.closing:
            self.fail(
                f"rank {self.rank}: lost the {kind} stream from rank {peer} at {self._address_of(peer)}"
            )
        return wire.Ack()

    def _address_of(self, peer: int) -> str:
        return self.addresses[peer] if peer < len(self.addresses) else "an unknown address"

    def _check_frame(self, frame: Any, peer: int, data: bool) -> None:
        if frame.src != peer:
            raise FrameError(f"frame claims rank {frame.src} on rank {peer}'s stream")
        # A data stream carries ABORT in place of the frames of an op that failed before they left.
        allowed = (wire.DATA, wire.ABORT) if data else (wire.CONTROL, wire.ABORT)
        if frame.channel not in allowed:
            raise FrameError(
                f"channel {frame.channel} does not belong on a {'data' if data else 'control'} stream"
            )
        if frame.channel == wire.DATA:
            check_payload(frame)

    def _lane_of(self, kind: str, peer: int) -> Lane:
        """The ring a data stream of `kind` from `peer` feeds; FrameError unless `peer` feeds it."""
        lane = self._lanes.get(kind)
        if lane is None:
            raise FrameError(f"data on a {kind} stream, but this rank has no such process set")
        if peer != lane.left:
            raise FrameError(f"data comes from rank {lane.left} in {lane.name}, not from rank {peer}")
        return lane

    # ---------------------------------------------------------------- agreement

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Allgathers one report per rank over the control streams."""
        return self._board.exchange(report, timeout_s, self._send_report, self._address_of)

    def _send_report(self, seq: int, report: bytes) -> None:
        frame = encode_frame(wire.CONTROL, self.rank, seq, report)
        for (_, kind), outbox in self._outboxes.items():
            if kind == "control":
                outbox.put(frame)

    # ---------------------------------------------------------------- data

    def start(
        self,
        address: int,
        count: int,
        dtype: str,
        kind: str,
        root: int,
        op: str = "sum",
        process_set: int = 0,
    ) -> PendingOp:
        """Begins an allreduce or broadcast (`root`: a position in the set) on the ring of `process_set`."""
        return self._lane(process_set).start(address, count, dtype, kind, root, op)

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
        process_set: int = 0,
    ) -> PendingOp:
        """Starts an allgather, reducescatter or alltoall as a ring collective (see plan_collective)."""
        return self._lane(process_set).start_collective(
            kind, dtype, op, address, count, output, recv_counts, layout
        )

    def _lane(self, process_set: int) -> Lane:
        if process_set == 0:
            return self._global
        lane = self._sets.get(process_set)
        if lane is None:
            raise GrpcError(
                f"rank {self.rank} is not a member of process set {process_set} (or it was removed)"
            )
        return lane

    # ---------------------------------------------------------------- process sets

    def add_process_set(self, set_id: int, ranks: list[int]) -> None:
        """Opens the member-only ring of a set (every rank calls it, in the same order)."""
        self._sets_added += 1
        kind = set_stream_kind(self._sets_added)
        if self.rank not in ranks:
            return
        lane = Lane(
            self, ranks, self.rank, self.piece_bytes, DIRECT_BYTES, f"process set {set_id} {ranks}", kind
        )
        if lane.size > 1:
            outbox = self._open_stream(lane.right, kind)
            self._outboxes[(lane.right, kind)] = outbox
            lane.outboxes.append(outbox)
        with self._lock:
            self._sets[set_id] = self._lanes[kind] = lane

    def remove_process_set(self, set_id: int) -> None:
        """Closes a set's ring; every rank is done with it (process_sets.remove_process_set waits for that)."""
        with self._lock:
            lane = self._sets.pop(set_id, None)
            for kind in [kind for kind, known in self._lanes.items() if known is lane]:
                del self._lanes[kind]
        if lane is None:
            return
        for outbox in lane.outboxes:
            self._outboxes.pop((lane.right, lane.stream_kind), None)
            outbox.close()

    def _watch(self) -> None:
        """Every half second: forgets finished ops and fails the job if data stopped flowing."""
        while not self._stopped.wait(0.5):
            now = time.monotonic()
            with self._lock:
                lanes = [self._global, *self._sets.values()]
            for lane in lanes:
                stalled = lane.stalled(now, self.timeout_s, self._address_of)
                if stalled:
                    self.fail(stalled)
                    break

    def fail(self, message: str, tell_peers: bool = True) -> None:
        """Ends every pending collective and exchange with `message`; tells the other ranks once."""
        with self._lock:
            if self.failure or self.closing:
                return
            self.failure = message
            self._lock.notify_all()
        log.error("grpc: %s", message)
        with self._lock:
            lanes = [self._global, *self._sets.values()]
        for lane in lanes:
            lane.fail(message)
        if self.bulk is not None:
            self.bulk.abort()
        if tell_peers:
            abort = encode_frame(wire.ABORT, self.rank, payload=message.encode())
            for (_, kind), outbox in list(self._outboxes.items()):
                if kind == "control":
                    outbox.put(abort)

    def close(self) -> None:
        """Says goodbye on every stream and stops the server (idempotent)."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
            self._lock.notify_all()
        outboxes = list(self._outboxes.values())
        for outbox in outboxes:
            outbox.close()
        for outbox in outboxes:
            outbox.wait(1.0)
        if self.bulk is not None:
            self.bulk.close()
        for channel in self._channels.values():
            channel.close()
        self._stopped.set()
        self._server.stop(grace=0.5).wait(5.0)
        self._refusals.flush()
        self._pool.shutdown(wait=False)
        if self._watchdog.is_alive():
            self._watchdog.join(5.0)


def _is_set_stream(kind: str) -> bool:
    return kind.startswith("set") and kind[3:].isdigit()


class GrpcTransport:
    """The object the core's trampoline drives: rank, size, name, exchange(), start()."""

    name = "grpc"
    # Completions and failures ring the core's doorbell (PendingOp.on_done): polling is only a
    # fallback. Each poll takes the GIL from the bulk sockets' thread; at the default 200 us a
    # 4 MiB allreduce cost the two threads half again the CPU of the TCP ring's one.
    poll_interval_us = 5000

    def __init__(
        self,
        endpoint: Endpoint,
        token: str,
        timeout_s: float = 60.0,
        piece_bytes: int | None = None,
        max_frame_bytes: int = 64 * 1024**2,
        tls: TlsFiles | None = None,
        join_timeout_s: float | None = None,
        streams: int = DATA_STREAMS,
        bulk_bytes: int = BULK_BYTES,
        join_limit_setting: str = "",
    ) -> None:
        # Data frames carry at most piece_bytes; the larger frame limit is for agreement reports,
        # and gRPC itself refuses anything above it.
        if not token:
            raise ValueError("the gRPC transport needs a job token")
        # Unset: PIECE_BYTES on gRPC streams, BULK_PIECE_BYTES on the bulk sockets; set: both.
        bulk_piece_bytes = BULK_PIECE_BYTES if piece_bytes is None else piece_bytes
        piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
        if piece_bytes <= 0:
            raise ValueError("piece_bytes must be positive")
        if streams <= 0:
            raise ValueError("streams (data streams to the ring neighbour) must be positive")
        self.rank, self.size = endpoint.rank, endpoint.size
        self._node = _Node(
            endpoint,
            token,
            timeout_s,
            piece_bytes,
            max_frame_bytes,
            tls,
            join_timeout_s,
            streams,
            bulk_bytes,
            bulk_piece_bytes,
            join_limit_setting,
        )
        # The core holds this facade; once it lets go, the node's streams and server close.
        # The node never points back here, so that happens as soon as the last reference goes.
        self._closer = weakref.finalize(self, self._node.close)
        try:
            self._node.open()
        except BaseException:
            self._closer()
            raise

    @property
    def addresses(self) -> list[str]:
        """Server address of every rank, index = rank."""
        return list(self._node.addresses)

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Blocking allgather of one byte string per rank."""
        return self._node.exchange(report, timeout_s)

    def bulk_stats(self) -> dict[str, int | bool]:
        """Payload bytes sent and received over the bulk sockets, and whether they carry TLS."""
        return link_stats(self._node.bulk)

    def start(
        self,
        address: int,
        count: int,
        dtype: str,
        kind: str,
        root: int,
        op: str = "sum",
        process_set: int = 0,
    ) -> PendingOp:
        """Starts an in-place allreduce (sum, min, max, product) or a broadcast from `root` on raw memory;
        `root` is a position in `process_set`."""
        return self._node.start(address, count, dtype, kind, root, op, process_set)

    def add_process_set(self, set_id: int, ranks: list[int]) -> None:
        """Opens a set's ring of its members (every rank calls it, in the same order)."""
        self._node.add_process_set(set_id, list(ranks))

    def remove_process_set(self, set_id: int) -> None:
        """Closes a set's ring."""
        self._node.remove_process_set(set_id)

    def unsupported(self, kind: str, dtype: str, op: str) -> str:
        """The ring runs every collective and op commsched has."""
        return ""

    def start_collective(
        self,
        kind: str,
        dtype: str,
        op: str,
        address: int,
        count: int,
        output: int,
        recv_counts: list[int],
        send_counts: list[int],
        layout: list[int],
        process_set: int = 0,
    ) -> PendingOp:
        """Starts an allgather, reducescatter or alltoall into `output` (see _Node.start_collective)."""
        return self._node.start_collective(
            kind, dtype, op, address, count, output, recv_counts, layout, process_set
        )

    def close(self) -> None:
        """Closes streams and server now instead of when the object is collected."""
        self._closer()
