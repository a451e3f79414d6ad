"""The local launcher: `commsched-run -n N script.py` (or `python -m commsched.run`)."""

from __future__ import annotations

import os


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` right now (IPv4 or IPv6 address)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


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
