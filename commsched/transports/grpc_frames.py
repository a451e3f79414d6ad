"""Frames of the gRPC transport as bytes, in grpc_wire.proto's protobuf encoding, without protobuf's copies.

A data frame is encoded from a header and a view of the collective's buffer, with one copy of the
payload (the one into the message gRPC sends); a received frame is decoded into a FrameView whose
payload is a memoryview of the received message, so it is summed or copied into place from there.
The bytes are the protobuf encoding of wire.Frame, so protobuf-built frames (tests, older ranks) and
these are read alike. Encoding a payload is deferred until gRPC's sender takes the frame, and the
op a frame belongs to counts frames not yet encoded: the op is not done while any is, so the
caller's buffer is never read after its collective returned, and a failed op sends ABORT instead.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from commsched.transports import grpc_wire as wire

# field number -> attribute of grpc_wire.proto's Frame; 6 (dtype) and 9 (payload) are length-delimited.
_VARINT_FIELDS = {1: "channel", 2: "src", 3: "seq", 4: "step", 5: "piece", 7: "offset", 8: "count"}
_DTYPE, _PAYLOAD = 6, 9


class MalformedFrame(ValueError):
    """Bytes that are not a Frame in grpc_wire.proto's encoding."""


class FrameView:
    """A decoded frame; `payload` is a memoryview of the received message (no copy)."""

    __slots__ = ("channel", "count", "dtype", "offset", "payload", "piece", "seq", "src", "step")

    def __init__(self) -> None:
        self.channel = self.src = self.seq = self.step = self.piece = self.offset = self.count = 0
        self.dtype = ""
        self.payload: Any = memoryview(b"")


class Sender(Protocol):
    """The op a data frame belongs to: told when its frame is encoded, asked whether it failed."""

    lock: threading.Lock
    error: str

    def encoded(self) -> None:
        """One of its frames was encoded (called with `lock` held)."""


class DataFrame:
    """A data frame whose payload is still a view of the collective's buffer."""

    __slots__ = ("channel", "count", "dtype", "offset", "owner", "payload", "piece", "seq", "src", "step")

    def __init__(
        self, src: int, seq: int, step: int, piece: int, dtype: str, offset: int, count: int, payload: Any
    ) -> None:
        self.channel = wire.DATA
        self.src, self.seq, self.step, self.piece = src, seq, step, piece
        self.dtype, self.offset, self.count = dtype, offset, count
        self.payload = payload  # a numpy view: read when encoded, never copied before
        self.owner: Sender | None = None

    def encode(self) -> bytes:
        """The frame's protobuf bytes; an ABORT with the reason if its op failed meanwhile."""
        owner = self.owner
        if owner is None:
            return _encode_data(self)
        with owner.lock:  # the op cannot fail (and its buffer go away) while its memory is read
            if owner.error:
                return encode_frame(wire.ABORT, self.src, payload=owner.error.encode())
            data = _encode_data(self)
            owner.encoded()
        return data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _header(
    channel: int, src: int, seq: int, step: int, piece: int, dtype: str, offset: int, count: int
) -> bytes:
    parts = []
    # proto3 leaves zero fields out; the decoder reads a missing field as zero.
    for number, value in ((1, channel), (2, src), (3, seq), (4, step), (5, piece)):
        if value:
            parts += [_varint(number << 3), _varint(value)]
    if dtype:
        raw = dtype.encode()
        parts += [_varint(_DTYPE << 3 | 2), _varint(len(raw)), raw]
    for number, value in ((7, offset), (8, count)):
        if value:
            parts += [_varint(number << 3), _varint(value)]
    return b"".join(parts)


def _encode_data(frame: DataFrame) -> bytes:
    view = memoryview(frame.payload).cast("B")
    head = _header(
        wire.DATA, frame.src, frame.seq, frame.step, frame.piece, frame.dtype, frame.offset, frame.count
    )
    if not view.nbytes:
        return head
    return b"".join((head, _varint(_PAYLOAD << 3 | 2), _varint(view.nbytes), view))


def encode_frame(channel: int, src: int, seq: int = 0, payload: bytes = b"") -> bytes:
    """A control, abort or close frame's bytes."""
    head = _header(channel, src, seq, 0, 0, "", 0, 0)
    if not payload:
        return head
    return b"".join((head, _varint(_PAYLOAD << 3 | 2), _varint(len(payload)), payload))


def serialize(frame: Any) -> bytes:
    """gRPC's request serializer: DataFrame, bytes already encoded, or a protobuf wire.Frame."""
    if isinstance(frame, DataFrame):
        return frame.encode()
    if isinstance(frame, bytes):
        return frame
    return frame.SerializeToString()


def deserialize(data: bytes) -> FrameView:
    """gRPC's request deserializer: a FrameView over `data`; raises MalformedFrame on bad bytes."""
    frame = FrameView()
    view = memoryview(data)
    position, end = 0, len(data)
    while position < end:
        tag, position = _read_varint(data, position)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            value, position = _read_varint(data, position)
            name = _VARINT_FIELDS.get(number)
            if name is not None:
                setattr(frame, name, value)
            elif number in (_DTYPE, _PAYLOAD):
                raise MalformedFrame(f"field {number} is not a varint")
        elif kind == 2:
            length, position = _read_varint(data, position)
            if position + length > end:
                raise MalformedFrame("a field runs past the end of the message")
            if number == _PAYLOAD:
                frame.payload = view[position : position + length]
            elif number == _DTYPE:
                frame.dtype = bytes(view[position : position + length]).decode(errors="replace")
            elif number in _VARINT_FIELDS:
                raise MalformedFrame(f"field {number} is not length-delimited")
            position += length
        elif kind in (1, 5):  # an unknown fixed-width field: skipped, as protobuf does
            position += 8 if kind == 1 else 4
        else:
            raise MalformedFrame(f"wire type {kind} in field {number}")
    if position != end:
        raise MalformedFrame("the message ends inside a field")
    return frame


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise MalformedFrame("a varint runs past the end of the message")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
