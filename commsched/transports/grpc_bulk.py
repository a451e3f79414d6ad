"""The gRPC transport's bulk data path: the global ring's large pieces over plain TCP (or TLS) sockets.

gRPC's Python API copies every message on both ends (a send takes bytes, a receive joins slices
into new bytes), which caps a data stream far below what the link carries. So each rank also
opens one socket to its right-hand ring neighbour and accepts one from its left, on the address
its gRPC server binds (COMMSCHED_GRPC_BIND), the ports traded over the gRPC control streams.
Pieces of at least `threshold` bytes go there: sent with sendmsg straight from the collective's
buffer, received with recv_into straight into the buffer where the ring copies a piece, or into
one preallocated scratch array where it sums one. gRPC keeps the rendezvous, agreement reports,
small pieces, aborts and process sets' rings.

A socket frame is a fixed header (_HEADER) and `count` elements of payload; the sender is the
connection's peer, proven at connect time by a hello carrying an HMAC of the job token (and, with
COMMSCHED_GRPC_TLS_*, by mutual TLS with the same CA and certificates as gRPC's).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, Protocol

import numpy as np

from commsched.transports.grpc_frames import DataFrame, FrameView
from commsched.transports.grpc_lanes import Lane
from commsched.transports.grpc_ops import GrpcError, PendingOp
from commsched.transports.grpc_ring import NUMPY_DTYPES, FrameError, itemsize
from commsched.transports.grpc_tls import TlsFiles

log = logging.getLogger("commsched")

# Pieces from this size on take the socket. Measured on loopback (2 ranks, the ring alone), a
# 16 KiB piece took 170 us over the socket and 390 us over gRPC, a 64 KiB one 160 us and 330 us;
# smaller pieces stay on gRPC with the agreement traffic they are about as fast as.
BULK_BYTES = 16 * 1024
# Ring pieces on the sockets (the global ring's, unless a piece size is set): as large as the default
# partition, so a 2-rank allreduce of one partition sends each segment as one piece. Each piece costs
# a wake-up of the receiving thread and a send on the forwarding one; on a loaded 2-core host 1 MiB
# pieces were slower than one piece per segment at 4 and 16 MiB (the overlap they buy did not pay
# for those), as in the plain TCP ring.
BULK_PIECE_BYTES = 4 * 1024**2
# Socket buffers: a few pieces in flight each way (the kernel caps them at net.core.[rw]mem_max).
SOCKET_BUFFER_BYTES = 4 * 1024**2

_DTYPES = list(NUMPY_DTYPES)
_DATA, _CLOSE = 0, 3
# kind, dtype index, step, piece, seq, offset, count
_HEADER = struct.Struct("<BBxxIIQQQ")
_MAGIC = b"CSB1"
# magic, sender rank, receiver rank, HMAC-SHA256 of those under the job token
_HELLO = struct.Struct("<4sII32s")


class BulkOwner(Protocol):
    """The node a link reports to."""

    rank: int
    closing: bool
    failure: str
    departed: set[int]

    def fail(self, message: str, tell_peers: bool = True) -> None:
        """Ends every pending collective with `message`."""


def _hello_digest(token: str, sender: int, receiver: int) -> bytes:
    return hmac.new(token.encode(), f"commsched bulk {sender}->{receiver}".encode(), hashlib.sha256).digest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:  # 0: the kernel's autotuning
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _contexts(tls: TlsFiles) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts with the gRPC transport's CA and certificate, each requiring the other's."""
    return tls.ssl_contexts()


@contextmanager
def _closing_on_error(sock: socket.socket) -> Iterator[socket.socket]:
    try:
        yield sock
    except BaseException:
        sock.close()
        raise


class _Outgoing:
    """A frame on its way out: what is left to write, and the op whose buffer it reads."""

    __slots__ = ("nbytes", "op", "parts")

    def __init__(self, parts: list[memoryview], op: PendingOp | None) -> None:
        self.parts, self.op, self.nbytes = parts, op, parts[1].nbytes


def _write(sock: socket.socket, parts: list[memoryview], flags: int) -> None:
    """Writes `parts`, dropping what left; with MSG_DONTWAIT, returns early when the socket is full."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS (and no MSG_DONTWAIT: see put)
        for part in parts:
            sock.sendall(part)
        parts.clear()
        return
    while parts:
        try:
            done = sock.sendmsg(parts, [], flags)
        except BlockingIOError:
            return
        while parts and done >= parts[0].nbytes:
            done -= parts[0].nbytes
            parts.pop(0)
        if parts:
            parts[0] = parts[0][done:]


class BulkLink:
    """The global ring's sockets: to the right-hand neighbour (written by whichever thread has a
    frame, or by a sender thread when the socket is full) and from the left one (read by a
    receiver thread that applies what arrives)."""

    def __init__(
        self,
        owner: BulkOwner,
        lane: Lane,
        outgoing: socket.socket,
        incoming: socket.socket,
        addresses: tuple[str, str],
        piece_bytes: int,
        threshold: int,
    ) -> None:
        self._owner, self._lane = owner, lane
        self.rank, self.right, self.left = owner.rank, lane.right, lane.left
        self._outgoing, self._incoming = outgoing, incoming
        self._right_address, self._left_address = addresses
        self.threshold = threshold
        self.sent_bytes = self.received_bytes = 0
        self._limit = piece_bytes
        self._scratch = memoryview(bytearray(piece_bytes))
        self._lock = threading.Lock()  # guards the four below
        self._ready = threading.Condition(self._lock)
        self._waiting: deque[_Outgoing] = deque()  # for the sender thread, in order
        self._writing = False  # a thread writes to the outgoing socket
        self._stopping = False  # close() was called, or the socket failed
        self._ended = False  # sockets shut down: errors on them are expected
        self._tls = isinstance(outgoing, ssl.SSLSocket)
        self._sender = threading.Thread(target=self._send_loop, name="commsched-bulk-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="commsched-bulk-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    @property
    def tls(self) -> bool:
        """True when both sockets carry TLS."""
        return isinstance(self._outgoing, ssl.SSLSocket) and isinstance(self._incoming, ssl.SSLSocket)

    def put(self, frame: DataFrame) -> None:
        """Sends a data frame (tracked by its op) to the right-hand neighbour: at once on this
        thread as far as the socket takes it without blocking, the rest from the sender thread."""
        op = frame.owner
        if op is not None and not op.borrow():
            return  # the op failed: its peers were told over the control streams
        header = _HEADER.pack(
            _DATA, _DTYPES.index(frame.dtype), frame.step, frame.piece, frame.seq, frame.offset, frame.count
        )
        item = _Outgoing([memoryview(header), memoryview(frame.payload).cast("B")], op)
        with self._lock:
            stopped = self._stopping
            # Inline only while nothing waits (frames leave in order) and never over TLS, whose
            # non-blocking writes must be retried with the same buffer.
            if not stopped and (self._waiting or self._writing or self._tls):
                self._waiting.append(item)
                self._ready.notify()
                return
            self._writing = not stopped
        if stopped:  # closed or failed: nobody would send it, and its op must not stay borrowed
            if op is not None:
                op.give_back()
            return
        # A piece forwarded by the receiving thread leaves without waking the sender thread: under
        # load that wake-up cost more than the send.
        try:
            _write(self._outgoing, item.parts, socket.MSG_DONTWAIT)
        except OSError as error:
            self._broken(item, error)
            return
        with self._lock:
            self._writing = False
            if item.parts:
                self._waiting.appendleft(item)
            # Only queued frames need the sender thread: waking it after every inline send cost a
            # context switch and a turn of the GIL per piece, for nothing.
            if self._waiting or self._stopping:
                self._ready.notify()
        if not item.parts:
            self._sent(item)

    # ---------------------------------------------------------------- sending

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while self._writing or not (self._waiting or self._stopping):
                    self._ready.wait()
                if not self._waiting:
                    break  # stopping, and everything queued left
                item = self._waiting.popleft()
                self._writing = True
            try:
                _write(self._outgoing, item.parts, 0)
            except (OSError, ValueError) as error:
                self._broken(item, error)
                return
            with self._lock:
                self._writing = False
            self._sent(item)
        with suppress(OSError, ValueError):  # the peer may be gone already; then it need not know
            self._outgoing.sendall(_HEADER.pack(_CLOSE, 0, 0, 0, 0, 0, 0))

    def _sent(self, item: _Outgoing) -> None:
        self.sent_bytes += item.nbytes
        if item.op is not None:
            item.op.give_back(sent=True)

    def _broken(self, item: _Outgoing, error: BaseException) -> None:
        """The socket failed: gives every borrowed op back, reports the peer unless that is no news."""
        with self._lock:
            self._writing = False
            self._stopping = True  # later frames are dropped: the job has failed
            dropped = [item, *self._waiting]
            self._waiting.clear()
            self._ready.notify_all()
        for each in dropped:
            if each.op is not None:
                each.op.give_back()
        if not self._quiet(self.right):
            self._owner.fail(
                f"rank {self.rank}: the bulk data connection to rank {self.right} at "
                f"{self._right_address} ended ({error or type(error).__name__})"
            )

    # ---------------------------------------------------------------- receiving

    def _read(self, view: memoryview) -> None:
        got, size = 0, view.nbytes
        plain = not isinstance(self._incoming, ssl.SSLSocket)
        while got < size:
            # MSG_WAITALL: one wake-up per piece rather than one per arriving segment.
            count = (
                self._incoming.recv_into(view[got:], size - got, socket.MSG_WAITALL)
                if plain
                else self._incoming.recv_into(view[got:], size - got)
            )
            if count == 0:
                raise EOFError("closed by the peer")
            got += count

    def _receive_loop(self) -> None:
        header = memoryview(bytearray(_HEADER.size))
        try:
            while True:
                self._read(header)
                kind, dtype, step, piece, seq, offset, count = _HEADER.unpack(header)
                if kind == _CLOSE:
                    return
                self._receive(kind, dtype, step, piece, seq, offset, count)
        except FrameError as error:
            self._owner.fail(
                f"rank {self.rank} rejected a frame from rank {self.left} on the bulk connection: {error}"
            )
        except (OSError, EOFError, ValueError) as error:
            if not self._quiet(self.left):
                self._owner.fail(
                    f"rank {self.rank}: lost the bulk data connection from rank {self.left} at "
                    f"{self._left_address} ({error or type(error).__name__})"
                )

    def _receive(
        self, kind: int, dtype: int, step: int, piece: int, seq: int, offset: int, count: int
    ) -> None:
        if kind != _DATA or dtype >= len(_DTYPES):
            raise FrameError(f"frame kind {kind}, dtype #{dtype}: not a data frame")
        frame = FrameView()
        frame.src, frame.seq, frame.step, frame.piece = self.left, seq, step, piece
        frame.dtype, frame.offset, frame.count = _DTYPES[dtype], offset, count
        nbytes = count * itemsize(frame.dtype)
        if nbytes > self._limit:
            raise FrameError(f"a piece of {nbytes} bytes, above the {self._limit}-byte piece size")
        frame.payload = self._scratch[:nbytes]  # its size is what landing() checks
        landing = self._lane.landing(frame)
        if landing is None:
            self._read(frame.payload)
            self._lane.apply(frame, reused=True)
        else:
            target, op = landing
            complete = False
            try:
                self._read(memoryview(target.view(np.uint8)))
                complete = True
            finally:
                self._lane.landed(frame, op, complete)
        self.received_bytes += nbytes

    # ---------------------------------------------------------------- ending

    def _quiet(self, peer: int) -> bool:
        """True when a socket error is no news: shutting down, already failed, or the peer left."""
        owner = self._owner
        return self._ended or owner.closing or bool(owner.failure) or peer in owner.departed

    def abort(self, delay_s: float = 0.5) -> None:
        """Shuts both sockets after `delay_s` (unblocking transfers of failed ops); the delay lets
        the abort sent over the control streams reach the peers before they see the sockets end."""
        timer = threading.Timer(delay_s, self._shut)
        timer.daemon = True
        timer.start()

    def _shut(self) -> None:
        self._ended = True
        for sock in (self._outgoing, self._incoming):
            with suppress(OSError, ValueError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Says goodbye to the right-hand neighbour, stops both threads and closes both sockets."""
        with self._lock:
            self._stopping = True
            self._ready.notify_all()
        try:
            self._sender.join(1.0)
            self._shut()
            self._receiver.join(2.0)
        finally:
            for sock in (self._outgoing, self._incoming):
                sock.close()


def open_link(
    owner: BulkOwner,
    lane: Lane,
    listener: socket.socket,
    right_address: str,
    token: str,
    tls: TlsFiles | None,
    timeout_s: float,
    piece_bytes: int,
    threshold: int = BULK_BYTES,
) -> BulkLink:
    """Connects to the right-hand neighbour's listener and takes the left one's connection on
    `listener`; raises GrpcError naming the address that could not be reached."""
    rank, right, left = owner.rank, lane.right, lane.left
    server, client = _contexts(tls) if tls is not None else (None, None)
    deadline = time.monotonic() + timeout_s
    accepted: list[tuple[socket.socket, str]] = []
    stop = threading.Event()

    def given_up() -> bool:  # by this rank, by the job, or by the left-hand rank itself
        return stop.is_set() or bool(owner.failure) or owner.closing or left in owner.departed

    accepting = threading.Thread(
        target=_accept,
        args=(listener, server, _hello_digest(token, left, rank), left, rank, deadline, accepted, given_up),
        name="commsched-bulk-accept",
        daemon=True,
    )
    accepting.start()  # before connecting: a TLS handshake needs the other end awake
    outgoing = None
    try:
        host, port = _split(right_address)
        try:
            outgoing = _connect(host, port, client, tls.server_name if tls else "", deadline)
            outgoing.sendall(_HELLO.pack(_MAGIC, rank, right, _hello_digest(token, rank, right)))
        except (OSError, ssl.SSLError) as error:
            raise GrpcError(
                f"rank {rank}: cannot open the bulk data connection to rank {right} at {right_address} "
                f"({error}); that address must be reachable from this host on any port: choose the "
                "interface every rank listens on with COMMSCHED_GRPC_BIND"
            ) from None
        accepting.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if not accepted:
            raise GrpcError(
                f"rank {rank}: rank {left} did not open its bulk data connection to "
                f"{_address(listener)} ({'it gave up' if given_up() else f'within {timeout_s:.0f}s'}); "
                f"that address must be reachable from rank {left}'s host: choose the interface every "
                "rank listens on with COMMSCHED_GRPC_BIND"
            )
        incoming, left_address = accepted[0]
    except BaseException:
        stop.set()
        accepting.join(6.0)  # its hello wait is at most 5 s
        if outgoing is not None:
            outgoing.close()
        for sock, _ in accepted:
            sock.close()
        raise
    for sock in (outgoing, incoming):
        sock.settimeout(None)
    return BulkLink(owner, lane, outgoing, incoming, (right_address, left_address), piece_bytes, threshold)


def start_link(owner: Any, lane: Lane) -> BulkLink | None:
    """Listens where the owner's gRPC server binds, trades the address and the bulk threshold over
    its exchange() (every rank calls this once, in open()) and connects the lane's sockets, with
    the owner's token, TLS files, join timeout, piece size and bulk threshold. None when every
    rank turned the bulk path off; a GrpcError when the ranks' thresholds differ (a piece one rank
    sends over the socket the other would wait for on gRPC)."""
    endpoint = owner.endpoint
    with ExitStack() as stack:
        listener = stack.enter_context(listen(endpoint.bind)) if owner.bulk_bytes > 0 else None
        address = advertised(listener, endpoint.advertise) if listener is not None else "-"
        mine = f"{owner.bulk_bytes} {address}"
        reports = [r.decode() for r in owner.exchange(mine.encode(), owner.join_timeout_s)]
        thresholds = [int(r.split(" ", 1)[0]) for r in reports]
        if len(set(thresholds)) != 1:
            listed = ", ".join(f"rank {r}: {t}" for r, t in enumerate(thresholds))
            raise GrpcError(
                f"the ranks disagree on the gRPC bulk threshold ({listed}); set COMMSCHED_GRPC_BULK_BYTES "
                "to the same value on every rank (0 turns the bulk sockets off)"
            )
        if listener is None:
            return None
        right_address = reports[lane.right].split(" ", 1)[1]
        return open_link(
            owner,
            lane,
            listener,
            right_address,
            owner.token,
            owner.tls,
            owner.join_timeout_s,
            max(owner.bulk_piece_bytes, 16),
            owner.bulk_bytes,
        )


def link_stats(link: BulkLink | None) -> dict[str, int | bool]:
    """Payload bytes a link sent and received, and whether it carries TLS (zeros without a link)."""
    if link is None:
        return {"sent_bytes": 0, "received_bytes": 0, "tls": False}
    return {"sent_bytes": link.sent_bytes, "received_bytes": link.received_bytes, "tls": link.tls}


def listen(bind: str) -> socket.socket:
    """A listening socket on the gRPC bind address and a port the kernel picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    with _closing_on_error(sock):
        _tune(sock)  # accepted sockets inherit the buffer sizes, which must precede the handshake
        sock.bind((bind, 0))
        sock.listen(8)
    return sock


def advertised(listener: socket.socket, host: str) -> str:
    """host:port at which the other ranks reach `listener` (IPv6 in brackets)."""
    port = listener.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect(
    host: str, port: int, client: ssl.SSLContext | None, server_name: str, deadline: float
) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    with _closing_on_error(sock):
        _tune(sock)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.connect((host, port))
        if client is None:
            return sock
        return client.wrap_socket(sock, server_hostname=server_name or host)


def _accept(
    listener: socket.socket,
    server: ssl.SSLContext | None,
    digest: bytes,
    left: int,
    rank: int,
    deadline: float,
    accepted: list[tuple[socket.socket, str]],
    given_up: Callable[[], bool],
) -> None:
    """Accepts connections until one proves to come from rank `left` (others are logged and closed)."""
    while not given_up() and (remaining := deadline - time.monotonic()) > 0:
        try:
            listener.settimeout(min(0.2, remaining))
            sock, peer = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return  # the listener was closed
        where = f"{peer[0]}:{peer[1]}"
        try:
            # A silent intruder holds the door this long at most.
            sock.settimeout(min(5.0, max(0.1, deadline - time.monotonic())))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if server is not None:
                sock = server.wrap_socket(sock, server_side=True)
            hello = bytearray(_HELLO.size)
            view, got = memoryview(hello), 0
            while got < len(hello):
                count = sock.recv_into(view[got:])
                if count == 0:
                    raise EOFError("closed before its hello")
                got += count
            magic, sender, receiver, proof = _HELLO.unpack(hello)
            if (
                magic != _MAGIC
                or (sender, receiver) != (left, rank)
                or not hmac.compare_digest(proof, digest)
            ):
                raise PermissionError(f"not rank {left}'s bulk connection with this job's token")
        except (OSError, EOFError, ssl.SSLError) as error:
            log.warning("grpc rank %d: refused a bulk data connection from %s: %s", rank, where, error)
            sock.close()
            continue
        if given_up():
            sock.close()
            return
        accepted.append((sock, where))
        return
