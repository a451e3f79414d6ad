"""The sending half of the gRPC transport: long-lived client streams to the peers, fed from queues.

gRPC's Python client keeps one message in flight per stream: its sender thread takes the next frame
from the stream's iterator only once the previous one was handed to the transport. A data frame is
therefore encoded (its payload read from the collective's buffer) on that thread, as late as
possible and once; and a rank may open several data streams to its neighbour, so that one stream's
wait for its previous write does not idle the link.
"""

from __future__ import annotations

import queue
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_frames import encode_frame, serialize

STREAM_METHOD = f"/{wire.SERVICE}/Stream"
JOIN_METHOD = f"/{wire.SERVICE}/Join"
CHANNEL_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second job on the same port must fail loudly, not share it
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A peer that starts late is reached within a second of its start, not after gRPC's backoff
    # (up to two minutes), which could outlast the join limit with the peer long up.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # A stream may run this far ahead of the receiver's reads: several pieces, not 64 KiB.
    ("grpc.http2.lookahead_bytes", 16 * 1024**2),
    # Fewer, larger HTTP/2 frames and socket reads: gRPC Python turns every slice of a received
    # message into a Python object before joining them, so a piece in 16 KiB slices costs far more
    # than one in a few large ones (about a fifth more busbw at 4 MiB on loopback).
    ("grpc.http2.max_frame_size", 4 * 1024**2),
    ("grpc.experimental.tcp_read_chunk_size", 1024**2),
    ("grpc.experimental.tcp_min_read_chunk_size", 256 * 1024),
    ("grpc.experimental.tcp_max_read_chunk_size", 8 * 1024**2),
]


class StreamOwner(Protocol):
    """What an outbox needs from the node that opened it."""

    rank: int
    closing: bool
    departed: set[int]

    def fail(self, message: str, tell_peers: bool = True) -> None:
        """Ends every pending collective with `message`."""


def stream_kinds(streams: int) -> list[str]:
    """Names of the data streams to the ring neighbour: "data", "data1", ..."""
    return ["data" + (str(index) if index else "") for index in range(streams)]


class Outbox:
    """One long-lived client stream to a peer, fed from a queue by gRPC's own sender thread."""

    def __init__(
        self,
        node: StreamOwner,
        peer: int,
        address: str,
        kind: str,
        channel: grpc.Channel,
        metadata: list[tuple[str, str]],
    ) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._node_ref: Callable[[], StreamOwner | None] = weakref.ref(node)  # type: ignore[arg-type]
        self._rank = node.rank
        self._peer, self._kind, self._address = peer, kind, address
        self._closed = False  # closed on purpose: its end is no failure
        method = channel.stream_unary(
            STREAM_METHOD, request_serializer=serialize, response_deserializer=wire.Ack.FromString
        )
        self._future = method.future(self._frames(), metadata=metadata, wait_for_ready=True)
        self._future.add_done_callback(self._finished)

    def _frames(self) -> Iterator[Any]:
        while True:
            frame = self._queue.get()
            if frame is None:
                return
            yield frame

    def put(self, frame: Any) -> None:
        """Queues a frame for the peer: a DataFrame, encoded bytes or a wire.Frame."""
        self._queue.put(frame)

    def close(self) -> None:
        """Ends the stream with a CLOSE frame, so the peer knows it was on purpose."""
        self._closed = True
        self._queue.put(encode_frame(wire.CLOSE, self._rank))
        self._queue.put(None)

    def wait(self, timeout_s: float) -> None:
        """Waits a little for the peer to take the rest of the stream."""
        try:
            self._future.result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - at shutdown a peer that already left is fine
            self._future.cancel()

    def _finished(self, future: Any) -> None:
        node = self._node_ref()
        if node is None or node.closing or self._closed or future.cancelled() or self._peer in node.departed:
            return
        error = future.exception()
        detail = (
            f"{error.code().name}: {error.details()}"
            if isinstance(error, grpc.RpcError)
            else "closed by the peer"
        )
        node.fail(
            f"rank {node.rank}: the {self._kind} stream to rank {self._peer} at {self._address} ended ({detail})"
        )
