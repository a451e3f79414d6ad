"""Where a gRPC rank listens and whom it meets: bind address, rendezvous address, peer list, job token."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import queue
import socket
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("commsched")


@dataclass(frozen=True)
class Endpoint:
    """One rank's network plan: listen on bind:port, advertise advertise:port, meet at master."""

    rank: int
    size: int
    bind: str  # address the server listens on
    advertise: str  # address other ranks reach this one at
    port: int  # 0: any free port
    master: str = ""  # host:port of rank 0's rendezvous (empty with an explicit peer list)
    peers: list[str] = field(default_factory=list)  # explicit host:port per rank, index = rank

    def bind_host(self) -> str:
        """The bind address as gRPC wants it (IPv6 in brackets)."""
        return f"[{self.bind}]" if ":" in self.bind else self.bind


def split_host_port(text: str, what: str) -> tuple[str, int]:
    """Splits host:port or [v6]:port; raises ValueError naming `what`."""
    host, colon, port = text.strip().rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {text!r} is not host:port")
    return host.strip("[]"), int(port)


def parse_peers(text: str) -> list[str]:
    """Parses COMMSCHED_GRPC_PEERS: comma-separated host:port, one per rank in rank order."""
    peers = [item.strip() for item in text.split(",") if item.strip()]
    for item in peers:
        split_host_port(item, "COMMSCHED_GRPC_PEERS")
    return peers


def _interface_address(name: str) -> str | None:
    """The IPv4 address of a network interface (Linux), or None if `name` is no interface."""
    if name not in {entry[1] for entry in socket.if_nameindex()}:
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
            )  # SIOCGIFADDR
        except OSError:
            raise ValueError(f"COMMSCHED_GRPC_BIND={name}: the interface has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


def route_to(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (no packet is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {host!r}: {error}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def resolve_bind(setting: str, reach_host: str, reach_port: int) -> tuple[str, str]:
    """(bind, advertise) for COMMSCHED_GRPC_BIND: an IP, a host name or an interface; default: the
    address that reaches the rendezvous host."""
    setting = setting.strip()
    if not setting:
        local = route_to(reach_host, reach_port)
        return local, local
    address = _interface_address(setting)
    if address is None:
        try:
            address = str(ipaddress.ip_address(setting.strip("[]")))
        except ValueError:
            try:
                address = socket.getaddrinfo(setting, None)[0][4][0]
            except socket.gaierror:
                raise ValueError(
                    f"COMMSCHED_GRPC_BIND={setting!r} is neither an interface ({', '.join(n for _, n in socket.if_nameindex())}), "
                    "an IP address nor a resolvable host name"
                ) from None
    if ipaddress.ip_address(address).is_unspecified:  # 0.0.0.0 listens everywhere but is no address to call
        return address, route_to(reach_host, reach_port)
    return address, address


def fallback_token(master: str, size: int, run_id: str) -> str:
    """A token every rank can derive when COMMSCHED_JOB_TOKEN is unset: keeps stray jobs apart, no secret."""
    return hashlib.sha256(f"commsched|{master}|{size}|{run_id}".encode()).hexdigest()


def endpoint_from(
    rank: int,
    size: int,
    master_addr: str,
    master_port: int,
    peers: list[str],
    bind_setting: str,
    agent_store: bool,
) -> Endpoint:
    """Plans bind address, port and rendezvous from launcher variables or an explicit peer list."""
    if peers:
        if len(peers) != size:
            raise ValueError(f"COMMSCHED_GRPC_PEERS lists {len(peers)} addresses for WORLD_SIZE={size}")
        own_host, own_port = split_host_port(peers[rank], "COMMSCHED_GRPC_PEERS")
        first_host, first_port = split_host_port(
            peers[0 if rank else min(1, size - 1)], "COMMSCHED_GRPC_PEERS"
        )
        bind, advertise = resolve_bind(bind_setting or own_host, first_host, first_port)
        return Endpoint(rank, size, bind, advertise, own_port, peers=peers)
    if size == 1 and not (master_addr and master_port):
        return Endpoint(0, 1, "127.0.0.1", "127.0.0.1", 0)  # nobody to meet
    if not master_addr or not master_port:
        raise ValueError(
            "COMMSCHED_TRANSPORT=grpc needs MASTER_ADDR and MASTER_PORT (torchrun sets them) "
            "or COMMSCHED_GRPC_PEERS=host:port,... listing every rank"
        )
    # Under torchrun the elastic agent's store already listens on MASTER_PORT; meet one port above.
    port = master_port + 1 if agent_store else master_port
    bind, advertise = resolve_bind(bind_setting, master_addr, port)
    master_host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return Endpoint(rank, size, bind, advertise, port if rank == 0 else 0, master=f"{master_host}:{port}")


class DaemonExecutor(futures.Executor):
    """A thread pool whose threads never hold up interpreter exit.

    gRPC's server runs each open stream on a pool thread for the stream's life. With a plain
    ThreadPoolExecutor, Python joins those threads before atexit handlers run, so a process whose
    core stopped on an error would hang at exit before commsched could close the streams.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers, self._name = max_workers, name
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        """Runs fn(*args, **kwargs) on a pool thread, starting one if none is idle."""
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            if self._idle == 0 and self._threads < self._max_workers:
                self._threads += 1
                threading.Thread(
                    target=self._worker, name=f"{self._name}-{self._threads}", daemon=True
                ).start()
            else:
                self._idle -= 1
        self._work.put((future, fn, args, kwargs))
        return future

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(error)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Lets the pool threads end once their current work is done."""
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._work.put(None)
