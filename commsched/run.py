"""The local launcher: `commsched-run -n N script.py` (or `python -m commsched.run`)."""

from __future__ import annotations

import os

_LOWEST_PORT = 10000  # below this, ports of well-known services cluster


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` right now (IPv4 or IPv6 address), outside the
    ephemeral range where possible.

    The other ranks' gRPC servers listen on a port the OS picks from the ephemeral range, so a
    rendezvous port from that range can be handed to one of them before rank 0 binds it (CI saw
    rank 1 listen on MASTER_PORT and try to join itself).
    """
    import random
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = _ephemeral_ports()
    outside = [(_LOWEST_PORT, low - 1), (high + 1, 65535)]
    outside = [(first, last) for first, last in outside if first <= last]
    pick = random.SystemRandom()
    for _ in range(64 if outside else 0):
        first, last = pick.choice(outside)
        port = pick.randint(first, last)
        with socket.socket(family) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue  # taken: try another
            return port
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _ephemeral_ports() -> tuple[int, int]:
    """The OS's range for port-0 binds (Linux's default where /proc does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(field) for field in handle.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def main(argv: list[str] | None = None) -> int:
    """`python -m commsched.run -n N script.py ...`: N local ranks, torchrun-style variables and a
    fresh COMMSCHED_JOB_TOKEN (unless one is set), so gRPC peers accept only this job."""
    import argparse
    import secrets
    import subprocess
    import sys
    import time

    parser = argparse.ArgumentParser(prog="python -m commsched.run", description=main.__doc__)
    parser.add_argument("-n", "--nproc", type=int, required=True, help="ranks to start on this host")
    parser.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument("-m", dest="module", action="store_true", help="run the program as a module")
    parser.add_argument("program")
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    base = dict(os.environ)
    base.setdefault("COMMSCHED_JOB_TOKEN", secrets.token_hex(16))
    base.update(
        MASTER_ADDR=base.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(args.master_port or free_port()),
        WORLD_SIZE=str(args.nproc),
    )
    command = [sys.executable] + (["-m"] if args.module else []) + [args.program] + args.arguments
    children = [
        subprocess.Popen(command, env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)))
        for rank in range(args.nproc)
    ]
    # One rank failing leaves the others waiting on it until their stall timeout; they report it
    # themselves, so the launcher only waits and returns the first failure.
    status = 0
    while children:
        for child in list(children):
            code = child.poll()
            if code is not None:
                children.remove(child)
                status = status or code
        time.sleep(0.05)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
