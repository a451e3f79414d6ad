"""The TCP baseline of `commsched-bench allreduce`: a ring allreduce over plain TCP sockets between
the bench's own processes, so a transport's busbw can be set against what the same processes move
over bare sockets in the same run.

Each rank connects one socket to its right-hand ring neighbour and accepts one from its left; the
addresses travel through commsched itself. Segments are received straight into the buffer (or into
one scratch array while reducing) and sent from the buffer, with one non-blocking loop per step, so
the baseline pays for the kernel's copies and numpy's sum and nothing else.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any

import numpy as np

from commsched.transports.grpc_ring import segments

_ADDRESS_BYTES = 64  # one fixed-width "host:port" record per rank in the allgather


class TcpRing:
    """A ring allreduce (float32 sum) over one TCP connection to each ring neighbour."""

    label = "TCP socket ring"

    def __init__(
        self, rank: int, size: int, sockets: tuple[socket.socket, socket.socket], timeout_s: float
    ) -> None:
        self.rank, self.size = rank, size
        self.right, self.left = sockets
        self.timeout_s = timeout_s
        self._selector = selectors.DefaultSelector()
        for sock in sockets:
            sock.setblocking(False)
        self._scratch = np.empty(0, np.float32)

    @classmethod
    def connect(cls, host: str, timeout_s: float) -> TcpRing:
        """Listens on `host`, trades addresses through commsched and connects the ring."""
        import commsched

        rank, size = commsched.rank(), commsched.size()
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            listener.bind((host, 0))
            listener.listen(1)
            mine = f"{host}|{listener.getsockname()[1]}".encode()
            record = np.zeros(_ADDRESS_BYTES, np.uint8)
            record[: len(mine)] = np.frombuffer(mine, np.uint8)
            table = np.asarray(commsched.allgather(record, name="bench.tcp_addresses")).reshape(size, -1)
            right_host, right_port = bytes(table[(rank + 1) % size]).rstrip(b"\0").decode().split("|")
            right = socket.create_connection((right_host, int(right_port)), timeout=timeout_s)
            listener.settimeout(timeout_s)
            left, _ = listener.accept()
        finally:
            listener.close()
        for sock in (right, left):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, size, (right, left), timeout_s)

    def allreduce(self, buffer: np.ndarray) -> None:
        """In-place float32 sum: ring reduce-scatter then ring all-gather, one segment per step."""
        if self.size == 1:
            return
        bounds = segments(buffer.size, self.size)
        if self._scratch.size < bounds[0][1]:
            self._scratch = np.empty(bounds[0][1], np.float32)
        for step in range(2 * (self.size - 1)):
            send_start, send_stop = bounds[(self.rank - step) % self.size]
            recv_start, recv_stop = bounds[(self.rank - step - 1) % self.size]
            outgoing = buffer[send_start:send_stop]
            if step < self.size - 1:
                incoming = self._scratch[: recv_stop - recv_start]
                self._trade(outgoing, incoming)
                buffer[recv_start:recv_stop] += incoming
            else:
                self._trade(outgoing, buffer[recv_start:recv_stop])

    def _trade(self, outgoing: np.ndarray, incoming: np.ndarray) -> None:
        """Sends `outgoing` to the right while receiving `incoming` from the left, neither blocking the other."""
        send_view = memoryview(outgoing).cast("B")
        recv_view = memoryview(incoming).cast("B")
        sent = received = 0
        if send_view.nbytes:
            self._selector.register(self.right, selectors.EVENT_WRITE)
        if recv_view.nbytes:
            self._selector.register(self.left, selectors.EVENT_READ)
        try:
            progress_at = time.monotonic()
            while sent < send_view.nbytes or received < recv_view.nbytes:
                events = self._selector.select(timeout=1.0)
                if not events and time.monotonic() - progress_at > self.timeout_s:
                    raise SystemExit(
                        f"rank {self.rank}: the TCP baseline moved nothing for {self.timeout_s:.0f}s "
                        f"({sent}/{send_view.nbytes} bytes sent, {received}/{recv_view.nbytes} received)"
                    )
                for key, _ in events:
                    if key.fileobj is self.right:
                        sent += self.right.send(send_view[sent:])
                        if sent == send_view.nbytes:
                            self._selector.unregister(self.right)
                    else:
                        got = self.left.recv_into(recv_view[received:])
                        if got == 0:
                            raise SystemExit(f"rank {self.rank}: the TCP baseline's left neighbour hung up")
                        received += got
                        if received == recv_view.nbytes:
                            self._selector.unregister(self.left)
                if events:
                    progress_at = time.monotonic()
        finally:
            for sock in (self.right, self.left):
                if sock in self._selector.get_map():
                    self._selector.unregister(sock)

    def close(self) -> None:
        """Closes both sockets."""
        self._selector.close()
        self.right.close()
        self.left.close()


def baseline_host(settings: dict[str, Any]) -> str:
    """The address this rank's baseline listens on: where its gRPC server would, else loopback."""
    import os

    from commsched.launch import detect
    from commsched.transports.grpc_net import parse_peers, resolve_bind, split_host_port

    peers = parse_peers(os.environ.get("COMMSCHED_GRPC_PEERS", ""))
    bind_setting = settings.get("grpc_bind") or ""
    if peers:
        master = split_host_port(peers[0], "COMMSCHED_GRPC_PEERS")[0]
    else:
        master = detect().master_addr or os.environ.get("MASTER_ADDR", "") or "127.0.0.1"
    return resolve_bind(bind_setting, master, 1)[1]
