"""Why a TLS handshake between two gRPC ranks fails, known to both of them.

gRPC's Python API says nothing to a server about a handshake it refused, and a client only hears
that the channel does not come up. So the handshakes are repeated with Python's ssl and the same
COMMSCHED_GRPC_TLS_* files, where OpenSSL's reason reaches the side that refused:

- After the rendezvous, every rank tries a handshake with each peer's gRPC server. A pair where one
  side refuses the other is then named on both sides, as each is the other's client.
- Before it, a joining rank does not know rank 0's verdict on it, nor rank 0 the joining rank's:
  rank 0 listens for the length of the rendezvous on a check port next to its gRPC port
  (``gRPC port + 1``), where a joining rank whose channel does not come up repeats the handshake
  and tells rank 0 its own verdict, so rank 0 names the rank, the reason and the setting too.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import suppress

from commsched.transports.grpc_net import Endpoint
from commsched.transports.grpc_tls import (
    CA_VARIABLE,
    CERT_VARIABLE,
    SERVER_NAME_VARIABLE,
    TlsFiles,
    _reason,
    _validity,
    handshake_refusal,
)

log = logging.getLogger("commsched")

_HELLO = b"commsched-tls-check"
_OWN_PROBLEM_S = 2.5  # how long rank 0 with an unusable certificate waits to tell the joining ranks why
# How long a joining rank with an unusable certificate tries to tell rank 0 why: rank 0 may still
# be starting (its check port opens with its server), and after 2 s a rank 0 on a loaded host
# was missed and waited out its whole join window instead.
_TELL_OWN_PROBLEM_S = 5.0
_LINE_LIMIT = 2048  # a hello or a verdict; anything longer is not a rank of this job


def door_port(grpc_port: int) -> int:
    """The port rank 0's TLS check listens on during the rendezvous."""
    return grpc_port + 1 if grpc_port < 65535 else grpc_port - 1


def _digest(token: str, side: str) -> str:
    """Proof that a hello or an answer comes from this job, without showing the token."""
    return hashlib.sha256(f"commsched-tls-check|{side}|{token}".encode()).hexdigest()[:32]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _read_line(sock: socket.socket) -> bytes:
    """One line of at most _LINE_LIMIT bytes (without its newline), or what came before EOF."""
    data = b""
    while b"\n" not in data and len(data) < _LINE_LIMIT:
        chunk = sock.recv(_LINE_LIMIT - len(data))
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


def _is_name_mismatch(reason: str) -> bool:
    lowered = reason.lower()
    return "hostname" in lowered or "ip address mismatch" in lowered


class TlsDoor:
    """Rank 0's TLS check during the rendezvous: a joining rank repeats its handshake here with
    Python's ssl, so a refusal's reason reaches rank 0 (``on_refusal`` gets the sentence)."""

    def __init__(
        self,
        tls: TlsFiles,
        bind_host: str,
        grpc_port: int,
        token: str,
        on_refusal: Callable[[str], None],
        own_problem: str = "",
    ) -> None:
        self._tls = tls
        self._token = token
        self._on_refusal = on_refusal
        self._stopped = threading.Event()
        # Rank 0 that cannot use its own certificate only answers with why, and counts who heard it.
        self.own_problem = own_problem
        self.told: set[int] = set()
        self._server_context = None if own_problem else tls.ssl_contexts()[0]
        self.port = door_port(grpc_port)
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((bind_host, self.port))
            self._listener.listen(16)
        except OSError:
            self._listener.close()
            raise
        self._listener.settimeout(0.2)  # so close() is seen
        self._thread = threading.Thread(target=self._serve, name="commsched-tls-check", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops listening (idempotent)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection, suppress(OSError):
                connection.settimeout(2.0)
                self._answer(connection, f"{peer[0]}")

    def _answer(self, connection: socket.socket, peer_host: str) -> None:
        words = _read_line(connection).split(b" ", 3)
        if (
            len(words) < 4
            or words[0] != _HELLO
            or words[1].decode(errors="replace") != _digest(self._token, "ask")
        ):
            return  # not a rank of this job: nothing to say, nothing to learn
        try:
            rank = int(words[2])
        except ValueError:
            return
        who = f"rank {rank} at {peer_host}"
        answer = _HELLO + b" " + _digest(self._token, "answer").encode()
        if self.own_problem:
            connection.sendall(answer + b" own " + " ".join(self.own_problem.split()).encode() + b"\n")
            self.told.add(rank)
            return
        connection.sendall(answer + b"\n")
        request = words[3].decode(errors="replace")
        if request.startswith("verdict "):
            kind, _, reason = request[len("verdict ") :].partition(" ")
            self._on_refusal(self._verdict(who, kind, reason))
            return
        if request != "handshake" or self._server_context is None:
            return
        try:
            secure = self._server_context.wrap_socket(connection, server_side=True)
        except ssl.SSLCertVerificationError as error:
            self._on_refusal(
                f"the certificate of {who} does not verify against this rank's {self._tls.named(CA_VARIABLE)}: "
                f"{_reason(error)}; {who.split(' at ')[0]} needs a valid certificate signed by this CA in its "
                f"{CERT_VARIABLE} (or every rank the CA that signed it in {CA_VARIABLE})"
            )
            return
        except ssl.SSLError:
            return  # the joining rank refused this rank's certificate: its verdict follows
        with secure:
            secure.sendall(b"ok")

    def _verdict(self, who: str, kind: str, reason: str) -> str:
        """rank 0's sentence for a joining rank's verdict on the handshake."""
        reason = reason.strip()[:500]
        if kind == "own":
            return f"{who} gave up at start: {reason}; fix {CERT_VARIABLE}, COMMSCHED_GRPC_TLS_KEY and {CA_VARIABLE} there"
        mine = f"this rank's certificate ({self._tls.named(CERT_VARIABLE)}{_validity(self._tls.cert)})"
        if kind == "name":
            return (
                f"{who} does not accept {mine}: {reason}; the certificate must carry the name that rank "
                f"dials, or that rank must set {SERVER_NAME_VARIABLE} to a name the certificate carries"
            )
        return (
            f"{who} does not accept {mine}: {reason}; it must be valid and signed by the CA in "
            f"{who.split(' at ')[0]}'s {CA_VARIABLE}"
        )


def open_door(
    tls: TlsFiles | None,
    bind_host: str,
    grpc_port: int,
    token: str,
    on_refusal: Callable[[str], None],
    size: int,
    own_problem: str = "",
) -> TlsDoor | None:
    """Rank 0's TLS check port for the rendezvous, or None (no TLS, nobody to meet, or the port is taken)."""
    if tls is None or size == 1:
        return None
    try:
        return TlsDoor(tls, bind_host, grpc_port, token, on_refusal, own_problem)
    except OSError as error:
        log.debug("grpc rank 0: no TLS check port next to %d (%s)", grpc_port, error)
        return None


def own_problem_teller(endpoint: Endpoint, token: str, tls: TlsFiles) -> Callable[[str], object] | None:
    """What passes on why this rank's own certificate is unusable before it gives up: a joining rank
    tells rank 0's check port; rank 0 answers at its check port until every rank heard it (at most
    a few seconds). None without a rendezvous."""
    if endpoint.peers or endpoint.size == 1:
        return None
    if endpoint.rank:
        return lambda problem: tell_door(
            endpoint.master,
            token,
            endpoint.rank,
            "own",
            problem.replace("this rank's", "its"),
            _TELL_OWN_PROBLEM_S,
        )

    def answer_joiners(problem: str) -> None:
        problem = problem.replace("this rank's", "its")
        door = open_door(tls, endpoint.bind, endpoint.port, token, lambda _: None, endpoint.size, problem)
        if door is None:
            return
        deadline = time.monotonic() + _OWN_PROBLEM_S
        while len(door.told) < endpoint.size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        door.close()

    return answer_joiners


def _ask_door(
    master: str, token: str, rank: int, request: str, timeout_s: float
) -> tuple[socket.socket, str] | None:
    """A connection to rank 0's check port that answered as this job's, with the rest of its answer
    ("own <why>" from a rank 0 that gave up), or None (no check port there)."""
    host, port = _split(master)
    try:
        sock = socket.create_connection((host, door_port(port)), timeout=timeout_s)
    except OSError:
        return None
    try:
        sock.sendall(
            b" ".join([_HELLO, _digest(token, "ask").encode(), str(rank).encode(), request.encode()]) + b"\n"
        )
        words = _read_line(sock).split(b" ", 2)
    except OSError:
        sock.close()
        return None
    if len(words) < 2 or words[0] != _HELLO or words[1].decode(errors="replace") != _digest(token, "answer"):
        sock.close()
        return None
    return sock, (words[2].decode(errors="replace") if len(words) > 2 else "")


def tell_door(master: str, token: str, rank: int, kind: str, reason: str, timeout_s: float = 2.0) -> bool:
    """Tells rank 0's check port this rank's verdict on TLS (kind: verify, name or own); True if heard.
    Tries until `timeout_s` passes, as rank 0 may still be starting."""
    deadline = time.monotonic() + timeout_s
    line = f"verdict {kind} {' '.join(reason.split())}"
    while True:
        asked = _ask_door(master, token, rank, line, max(0.1, min(1.0, deadline - time.monotonic())))
        if asked is not None:
            asked[0].close()
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def door_refusal(master: str, tls: TlsFiles, token: str, rank: int, timeout_s: float = 2.0) -> str | None:
    """The handshake with rank 0 repeated at its check port: why it fails (rank 0 hears it too), ""
    if it succeeds, None if rank 0 has no check port."""
    asked = _ask_door(master, token, rank, "handshake", timeout_s)
    if asked is None:
        return None
    sock, rest = asked
    if rest.startswith("own "):
        sock.close()
        return (
            f"rank 0 at {master} gave up at start: {rest[4:]}; fix {CERT_VARIABLE}, "
            f"COMMSCHED_GRPC_TLS_KEY and {CA_VARIABLE} there"
        )
    host, _ = _split(master)
    name = tls.server_name or host
    _, context = tls.ssl_contexts()
    with sock:
        sock.settimeout(timeout_s)
        try:
            with context.wrap_socket(sock, server_hostname=name) as secure:
                answer = secure.recv(2)
        except ssl.SSLCertVerificationError as error:
            reason = _reason(error)
            mismatch = _is_name_mismatch(reason)
            tell_door(master, token, rank, "name" if mismatch else "verify", reason, timeout_s)
            if mismatch:
                return (
                    f"this rank does not accept the certificate of rank 0 at {master}: {reason} (the name "
                    f"checked is {name!r}); give rank 0 a certificate that carries it, or set "
                    f"{SERVER_NAME_VARIABLE} to the name it carries"
                )
            return (
                f"this rank does not accept the certificate of rank 0 at {master}: {reason}; it must be valid "
                f"and signed by the CA in this rank's {tls.named(CA_VARIABLE)} (check {CERT_VARIABLE} on rank 0)"
            )
        except ssl.SSLError as error:  # rank 0's alert on this rank's certificate
            return (
                f"rank 0 at {master} refused this rank's certificate ({tls.named(CERT_VARIABLE)}) in the TLS "
                f"handshake: {_reason(error)}{_validity(tls.cert)}; it must verify against rank 0's {CA_VARIABLE}"
            )
        except OSError:
            return None
    return "" if answer == b"ok" else None


def peer_refusals(addresses: list[str], rank: int, tls: TlsFiles, timeout_s: float = 2.0) -> list[str]:
    """Why this rank's TLS handshake with each peer's gRPC server fails, one sentence per peer that
    fails; each peer runs the same check against this rank, so a refusal is named on both sides."""
    peers = [peer for peer in range(len(addresses)) if peer != rank]
    if not peers:
        return []
    with futures.ThreadPoolExecutor(min(16, len(peers)), thread_name_prefix="commsched-tls-check") as pool:
        found = pool.map(
            lambda peer: handshake_refusal(addresses[peer], tls, f"rank {peer}", timeout_s), peers
        )
        return [text for text in found if text]
