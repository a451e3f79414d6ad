"""A small authenticated service that lets compute workers and training ranks find each other.

Horovod's tf.data service support (commsched.tensorflow.data) runs TensorFlow data-service
dispatchers and workers on separate "compute" ranks; this service, started on one of them, is
where dispatchers register their addresses, workers report ready and training asks for both, and
where shutdown is announced. It speaks one JSON line per request over TCP, each line signed with
HMAC-SHA256 under a shared secret key, so only holders of the key can talk to it.

Every wait has a timeout: a waiting request returns at least once a second, and the client keeps
asking until its own deadline, raising TimeoutException (a TimeoutError) naming what did not arrive. A client whose
service has gone away raises ConnectionError naming the addresses it tried.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

_LONGEST_SERVER_WAIT_S = 1.0  # a waiting request answers at least this often, so no socket waits forever
_ERRORS: dict[str, type[Exception]] = {"IndexError": IndexError, "ValueError": ValueError}


class TimeoutException(TimeoutError):
    """A wait at the compute service that ran past its timeout (Horovod's name; a TimeoutError)."""


def make_secret_key() -> bytes:
    """A fresh random key for a service and its clients (Horovod's secret.make_secret_key)."""
    return secrets.token_bytes(32)


def _sign(key: bytes, body: dict[str, Any]) -> bytes:
    text = json.dumps(body, sort_keys=True)
    mac = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    return (json.dumps({"body": text, "mac": mac}) + "\n").encode()


def _verify(key: bytes, line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    expected = hmac.new(key, message["body"].encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, str(message.get("mac", ""))):
        raise PermissionError("a message to or from the compute service was not signed with its key")
    return dict(json.loads(message["body"]))


def interface_addresses(port: int) -> dict[str, list[tuple[str, int]]]:
    """Every network interface's IPv4 address with `port`, loopback included, as Horovod lists them."""
    found: dict[str, list[tuple[str, int]]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
                )  # SIOCGIFADDR
            except OSError:
                continue  # an interface without an IPv4 address
            found[name] = [(socket.inet_ntoa(packed[20:24]), port)]
    return found or {"lo": [("127.0.0.1", port)]}


class ComputeService:
    """The service: `dispatchers` dispatchers, each with `workers_per_dispatcher` workers; serves until shutdown()."""

    def __init__(self, dispatchers: int, workers_per_dispatcher: int, key: bytes, nics: Any = None) -> None:
        if int(dispatchers) < 1:
            raise ValueError(f"The number of dispatchers must be larger than 0: {dispatchers}")
        if int(workers_per_dispatcher) < 1:
            raise ValueError(
                f"The number of workers per dispatcher must be larger than 0: {workers_per_dispatcher}"
            )
        self._dispatchers, self._workers_per_dispatcher, self._key = (
            int(dispatchers),
            int(workers_per_dispatcher),
            key,
        )
        self._changed = threading.Condition()
        self._addresses: dict[int, str] = {}
        self._workers: dict[int, set[int]] = {}
        self._shut_down = False
        service = self

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    request = _verify(service._key, self.rfile.readline())
                except (ValueError, KeyError, PermissionError):
                    return  # unsigned or malformed: no answer
                self.wfile.write(_sign(service._key, service._answer(request)))

        self._server = socketserver.ThreadingTCPServer(("0.0.0.0", 0), _Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self._port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="commsched-compute", daemon=True
        )
        self._thread.start()

    def addresses(self) -> dict[str, list[tuple[str, int]]]:
        """Where clients reach the service: interface name -> [(address, port)]."""
        return interface_addresses(self._port)

    def shutdown(self) -> None:
        """Tells every waiting client to stop, then stops serving."""
        with self._changed:
            self._shut_down = True
            self._changed.notify_all()
        time.sleep(0.05)  # lets clients blocked in wait_for_shutdown hear it before the socket closes
        self._server.shutdown()
        self._server.server_close()

    def _check_dispatcher(self, index: Any) -> int:
        if not isinstance(index, int) or not 0 <= index < self._dispatchers:
            raise IndexError(f"Dispatcher id must be within [0..{self._dispatchers - 1}]: {index}")
        return index

    def _wait(self, ready: Any, timeout: Any) -> bool:
        deadline = time.monotonic() + min(max(float(timeout), 0.0), _LONGEST_SERVER_WAIT_S)
        with self._changed:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"result": self._serve(request)}
        except (IndexError, ValueError) as error:
            return {"error": type(error).__name__, "message": str(error)}

    def _serve(self, request: dict[str, Any]) -> Any:
        kind = request.get("kind")
        if kind == "register_dispatcher":
            index, address = self._check_dispatcher(request["dispatcher"]), str(request["address"])
            with self._changed:
                if self._addresses.get(index, address) != address:
                    raise ValueError(
                        f"Dispatcher with id {index} has already been registered under different address "
                        f"{self._addresses[index]}: {address}"
                    )
                self._addresses[index] = address
                self._changed.notify_all()
            return None
        if kind == "wait_dispatcher":
            index = self._check_dispatcher(request["dispatcher"])
            found = self._wait(lambda: index in self._addresses, request["timeout"])
            return self._addresses[index] if found else None
        if kind == "register_worker":
            index = self._check_dispatcher(request["dispatcher"])
            with self._changed:
                self._workers.setdefault(index, set()).add(int(request["worker"]))
                self._changed.notify_all()
            return None
        if kind == "wait_workers":
            index = self._check_dispatcher(request["dispatcher"])
            return self._wait(
                lambda: len(self._workers.get(index, ())) >= self._workers_per_dispatcher, request["timeout"]
            )
        if kind == "shutdown":
            with self._changed:
                self._shut_down = True
                self._changed.notify_all()
            return None
        if kind == "wait_shutdown":
            return self._wait(lambda: self._shut_down, request["timeout"])
        raise ValueError(f"the compute service has no request {kind!r}")


class ComputeClient:
    """Talks to a ComputeService at `compute_addresses` (as its addresses() gives them) with its `key`."""

    def __init__(
        self, compute_addresses: Mapping[str, Sequence[tuple[str, int]]], key: bytes, verbose: int = 1
    ) -> None:
        self._candidates = [
            (str(host), int(port)) for pairs in compute_addresses.values() for host, port in pairs
        ]
        if not self._candidates:
            raise ValueError("ComputeClient needs at least one address of the compute service")
        self._key, self._verbose = key, verbose
        self._reachable: tuple[str, int] | None = None

    def register_dispatcher(self, dispatcher_id: int, dispatcher_address: str) -> None:
        """Records where dispatcher `dispatcher_id` serves."""
        self._call(
            {"kind": "register_dispatcher", "dispatcher": dispatcher_id, "address": dispatcher_address}
        )

    def wait_for_dispatcher_registration(self, dispatcher_id: int, timeout: float) -> str:
        """The address of dispatcher `dispatcher_id` once registered; TimeoutError after `timeout` seconds."""
        address = self._until(
            {"kind": "wait_dispatcher", "dispatcher": dispatcher_id},
            timeout,
            f"dispatcher {dispatcher_id} to register. Try to find out what takes the dispatcher so long to register",
        )
        return str(address)

    def register_worker_for_dispatcher(self, dispatcher_id: int, worker_id: int) -> None:
        """Reports worker `worker_id` ready for dispatcher `dispatcher_id`."""
        self._call({"kind": "register_worker", "dispatcher": dispatcher_id, "worker": worker_id})

    def wait_for_dispatcher_worker_registration(self, dispatcher_id: int, timeout: float) -> None:
        """Returns once every worker of dispatcher `dispatcher_id` is ready; TimeoutError after `timeout` seconds."""
        self._until(
            {"kind": "wait_workers", "dispatcher": dispatcher_id},
            timeout,
            f"workers for dispatcher {dispatcher_id} to register. Try to find out what takes the workers so long "
            "to register",
        )

    def shutdown(self) -> None:
        """Asks every compute worker to stop."""
        self._call({"kind": "shutdown"})

    def wait_for_shutdown(self) -> None:
        """Returns once shutdown was asked for, or the service has gone (it stops after announcing it)."""
        while True:
            try:
                if self._call({"kind": "wait_shutdown", "timeout": _LONGEST_SERVER_WAIT_S}):
                    return
            except ConnectionError:
                return

    def _until(self, request: dict[str, Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + float(timeout)
        while True:
            left = deadline - time.monotonic()
            answer = self._call({**request, "timeout": max(min(left, _LONGEST_SERVER_WAIT_S), 0.0)})
            if answer not in (None, False):
                return answer
            if time.monotonic() >= deadline:
                # Horovod's wording, which its scripts and tests match.
                raise TimeoutException(
                    f"Timed out waiting for {what} or increase timeout. Timeout after {timeout} seconds."
                )

    def _call(self, request: dict[str, Any]) -> Any:
        tried = [self._reachable] if self._reachable else []
        tried += [c for c in self._candidates if c != self._reachable]
        failures = []
        for host, port in tried:
            try:
                with socket.create_connection(
                    (host, port), timeout=_LONGEST_SERVER_WAIT_S + 10
                ) as connection:
                    connection.sendall(_sign(self._key, request))
                    line = connection.makefile("rb").readline()
            except OSError as error:
                failures.append(f"{host}:{port} ({error})")
                continue
            if not line:
                failures.append(f"{host}:{port} (closed without an answer: another key?)")
                continue
            self._reachable = (host, port)
            answer = _verify(self._key, line)
            if "error" in answer:
                raise _ERRORS.get(answer["error"], RuntimeError)(answer["message"])
            return answer["result"]
        raise ConnectionError(f"the compute service is not reachable at {', '.join(failures)}")
