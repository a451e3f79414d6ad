"""Ring collectives of the gRPC transport, as per-rank state machines advanced frame by frame.

Allreduce is a ring reduce-scatter followed by a ring all-gather: the buffer is cut into one
segment per rank and every rank sends and receives 2(n-1)/n of the buffer, instead of n times
the buffer passing through one rank. Segments travel in pieces of at most `piece_bytes`, and a
piece is forwarded as soon as it has been reduced, so the steps pipeline. Broadcast is a chain
along the ring from the root, also piece by piece.

Nothing here touches the network: `send` is a callable taking a Frame for the right-hand
neighbour, so the logic is tested with ranks wired together in memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from commsched.transports.grpc_frames import DataFrame

# commsched dtype -> numpy dtype; bfloat16 travels and is summed as raw uint16 (numpy has no bfloat16).
NUMPY_DTYPES: dict[str, Any] = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
}


class FrameError(Exception):
    """A frame that does not match what the receiver expects; the message says what differs."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a commsched dtype."""
    return int(np.dtype(NUMPY_DTYPES[dtype]).itemsize)


def array_at(address: int, count: int, dtype: str) -> np.ndarray:
    """A writable numpy view of `count` elements at raw `address` (no copy)."""
    numpy_dtype = NUMPY_DTYPES[dtype]
    if count == 0:
        return np.empty(0, numpy_dtype)
    memory = (ctypes.c_char * (count * itemsize(dtype))).from_address(address)
    return np.frombuffer(memory, dtype=numpy_dtype)


_NUMPY_OPS = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def _reduce_bfloat16(dst: np.ndarray, src: np.ndarray, op: str = "sum") -> None:
    # Same rounding as the core's float_to_bfloat16 (nearest even, NaN kept quiet), so every
    # transport gives the same bits.
    total = _NUMPY_OPS[op](
        (dst.astype(np.uint32) << 16).view(np.float32), (src.astype(np.uint32) << 16).view(np.float32)
    )
    bits = total.view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(total)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16) | 0x40
    dst[:] = rounded.astype(np.uint16)


def check_payload(frame: Any) -> None:
    """Raises FrameError unless a data frame's payload holds `count` elements of a known dtype."""
    try:
        width = itemsize(frame.dtype)
    except KeyError:
        raise FrameError(f"unknown dtype {frame.dtype!r}") from None
    nbytes = memoryview(frame.payload).nbytes
    if nbytes != frame.count * width:
        state = "truncated" if nbytes < frame.count * width else "oversized"
        raise FrameError(
            f"{state} payload in collective #{frame.seq}: {nbytes} bytes for {frame.count} {frame.dtype}"
        )


def add_into(dst: np.ndarray, src: np.ndarray, dtype: str, op: str = "sum") -> None:
    """dst = op(dst, src) elementwise in the precision of `dtype` (integers wrap, as in MPI);
    op: sum (average sums: the core divides), min, max or product."""
    if dtype == "bfloat16":
        _reduce_bfloat16(dst, src, op)
    elif dtype == "float16" and op == "product":
        np.copyto(dst, (dst.astype(np.float32) * src.astype(np.float32)).astype(np.float16))
    else:
        _NUMPY_OPS[op](dst, src, out=dst, casting="unsafe")


def segments(count: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) element ranges of the `size` ring segments; the first ones take the remainder."""
    base, extra = divmod(count, size)
    bounds, start = [], 0
    for index in range(size):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def pieces(start: int, stop: int, piece_elements: int) -> list[tuple[int, int]]:
    """(offset, count) of the pieces that carry elements [start, stop)."""
    return [(offset, min(piece_elements, stop - offset)) for offset in range(start, stop, piece_elements)]


class RingOp:
    """One collective as seen by one rank; `receive` advances it by one frame.

    allreduce: ring reduce-scatter then ring all-gather over `segments`; reducescatter: the first
    half alone, shifted so that rank r ends with the reduced part r of `bounds`; allgather: the
    second half alone, each rank's part of `bounds` filled by its owner; broadcast: a chain.
    """

    def __init__(
        self,
        seq: int,
        array: np.ndarray,
        dtype: str,
        kind: str,
        root: int,
        rank: int,
        size: int,
        piece_bytes: int,
        send: Callable[[Any], None],
        op: str = "sum",
        bounds: list[tuple[int, int]] | None = None,
        direct_bytes: int = 0,
        ranks: list[int] | None = None,
    ) -> None:
        if kind not in ("allreduce", "broadcast", "reducescatter", "allgather"):
            raise ValueError(f"unknown collective {kind!r}")
        if not 0 <= root < size:
            raise ValueError(f"broadcast root {root} is not a rank of {size}")
        self.seq, self.array, self.dtype, self.kind, self.op = seq, array, dtype, kind, op
        self.rank, self.size, self.root = rank, size, root
        self.itemsize = itemsize(dtype)
        self._send = send
        piece_elements = max(1, piece_bytes // self.itemsize)
        # `rank`, `size` and `root` are positions in the ring; frames name the global ranks in `ranks`.
        self.src = rank if ranks is None else ranks[rank]
        self.left = (rank - 1) % size if ranks is None else ranks[(rank - 1) % size]
        count = int(array.size)
        # Leading steps that reduce what they receive; later ones copy it.
        self._reduce_steps = size - 1 if kind in ("allreduce", "reducescatter") else 0
        # A small allreduce of two ranks: each sends its whole buffer and adds the other's, one hop
        # instead of two for the same bytes; x + y == y + x bit for bit, so both ranks agree. The
        # payload is copied at once, as the sum lands in the buffer before the copy might leave.
        self._direct = kind == "allreduce" and size == 2 and count * self.itemsize <= direct_bytes
        self._forwards = False
        if self._direct:
            self.steps = 1
            everything = pieces(0, count, piece_elements)
            self._expected, self._first_send = [everything], everything
        elif kind != "broadcast":
            self.steps = 2 * (size - 1) if kind == "allreduce" else size - 1
            bounds = bounds if bounds is not None else segments(count, size)
            shift = 1 if kind == "reducescatter" else 0
            # At step k this rank receives segment (rank - k - 1 - shift) and sends (rank - k - shift).
            self._expected = [
                pieces(*bounds[(rank - k - 1 - shift) % size], piece_elements) for k in range(self.steps)
            ]
            self._first_send = pieces(*bounds[(rank - shift) % size], piece_elements) if self.steps else []
        else:
            position = (rank - root) % size
            self.steps = 1
            everything = pieces(0, count, piece_elements)
            self._expected = [everything if position > 0 else []]
            self._first_send = everything if position == 0 and size > 1 else []
            self._forwards = 0 < position < size - 1
        self._received = [bytearray(len(step)) for step in self._expected]
        self.remaining = sum(len(step) for step in self._expected)
        self.sent_bytes = 0

    @property
    def done(self) -> bool:
        """True once every expected piece arrived (and was applied)."""
        return self.remaining == 0

    def describe(self) -> str:
        """What the op is, for error messages."""
        extra = f" from root {self.root}" if self.kind == "broadcast" else ""
        return f"{self.kind}{extra} #{self.seq} of {self.array.size} {self.dtype}"

    def begin(self) -> None:
        """Sends what this rank can send before hearing from anyone."""
        for index, (offset, count) in enumerate(self._first_send):
            self._emit(0, index, offset, count)

    def _emit(self, step: int, piece: int, offset: int, count: int) -> None:
        # A view, not a copy: the ring writes this part of the buffer again only after the
        # right-hand neighbour applied this frame, and the payload is read once, when encoded.
        payload = self.array[offset : offset + count]
        if self._direct:
            payload = payload.copy()
        self.sent_bytes += payload.nbytes
        self._send(DataFrame(self.src, self.seq, step, piece, self.dtype, offset, count, payload))

    def check(self, frame: Any) -> tuple[int, int]:
        """Validates a frame against what this op expects next; returns its (offset, count)."""
        where = f"frame {frame.step}/{frame.piece} of {self.describe()} from rank {frame.src}"
        if frame.src != self.left:
            raise FrameError(f"{where}: data comes from rank {self.left} in this ring")
        if frame.dtype != self.dtype:
            raise FrameError(f"{where}: dtype {frame.dtype!r}, expected {self.dtype!r}")
        if frame.step >= self.steps or frame.piece >= len(self._expected[frame.step]):
            raise FrameError(f"{where}: no such step/piece (the op has {self.steps} steps)")
        offset, count = self._expected[frame.step][frame.piece]
        if (frame.offset, frame.count) != (offset, count):
            raise FrameError(f"{where}: elements {frame.offset}+{frame.count}, expected {offset}+{count}")
        nbytes = memoryview(frame.payload).nbytes
        if nbytes != count * self.itemsize:
            state = "truncated" if nbytes < count * self.itemsize else "oversized"
            raise FrameError(f"{where}: {state} payload of {nbytes} bytes, expected {count * self.itemsize}")
        if self._received[frame.step][frame.piece]:
            raise FrameError(f"{where}: piece received twice")
        return offset, count

    def landing(self, frame: Any) -> np.ndarray | None:
        """Where a frame that copies (rather than reduces) can be received straight into: the
        validated part of the buffer; None for a frame that is summed or may be mutated after
        arrival (direct mode)."""
        if self._direct or frame.step < self._reduce_steps:
            return None
        offset, count = self.check(frame)
        return self.array[offset : offset + count]

    def receive(self, frame: Any, landed: bool = False) -> None:
        """Applies one validated frame (sum or copy) and forwards the piece where the ring says so;
        `landed`: its payload was already received into the place `landing` gave."""
        offset, count = self.check(frame)
        target = self.array[offset : offset + count]
        if landed:
            pass
        elif frame.step < self._reduce_steps:
            add_into(target, np.frombuffer(frame.payload, dtype=self.array.dtype), self.dtype, self.op)
        else:
            target[:] = np.frombuffer(frame.payload, dtype=self.array.dtype)
        self._received[frame.step][frame.piece] = 1
        self.remaining -= 1
        if self.kind != "broadcast" and not self._direct:
            # The piece just received is the one this rank sends at the next step.
            if frame.step + 1 < self.steps:
                self._emit(frame.step + 1, frame.piece, offset, count)
        elif self._forwards:
            self._emit(0, frame.piece, offset, count)
