"""Host discovery for elastic jobs: runs a script in Horovod's format (one `hostname:slots` line per
host) and counts the slots this machine may use. commsched-run starts ranks on this host only, with
no ssh launching, so a host that is not this machine is an error naming the script and the line."""

from __future__ import annotations

import errno
import ipaddress
import socket
import subprocess

# How often the launcher runs the script (Horovod polls about once a second) and how long one run may take.
POLL_S = 1.0
SCRIPT_TIMEOUT_S = 10.0


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something that is not `hostname:slots` lines."""


def _local_names() -> set[str]:
    names = {"localhost", "localhost.localdomain", "ip6-localhost"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name.lower())
    return names


def is_local(host: str) -> bool:
    """True when `host` names this machine: localhost, a loopback address or this host's own name."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() in _local_names()


def parse(script: str, text: str) -> dict[str, int]:
    """The slots per host in the script's output `text` (a bare `hostname` line counts one slot)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host, colon, slots = line.rpartition(":") if ":" in line else (line, "", "1")
        where = f"--host-discovery-script {script}, line {number} ({raw!r})"
        if colon and (not slots.isdigit() or int(slots) < 1) or not host or any(c.isspace() for c in host):
            raise DiscoveryError(f"{where}: expected `hostname:slots` with slots a whole number >= 1")
        if not is_local(host):
            raise DiscoveryError(
                f"{where}: host {host} is not this machine; commsched-run starts ranks on this host only "
                "(no ssh launching): list localhost or 127.0.0.1 with its slots"
            )
        hosts[host] = hosts.get(host, 0) + int(slots)
    return hosts


def discover(script: str) -> int:
    """Runs the discovery script and returns the slots it gives this machine (0 when it lists no host)."""
    try:
        done = _run(script)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DiscoveryError(
            f"--host-discovery-script {script} could not be run ({error}); give an executable file "
            "that prints `hostname:slots` lines"
        ) from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise DiscoveryError(
            f"--host-discovery-script {script} exited with status {done.returncode} ({last[0]})"
        )
    return sum(parse(script, done.stdout).values())


def _run(script: str) -> subprocess.CompletedProcess[str]:
    """Runs the script; one without a `#!` line goes to /bin/sh, as a shell runs it (and Horovod does)."""
    try:
        return subprocess.run([script], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False)
    except OSError as error:
        if error.errno != errno.ENOEXEC:
            raise
    return subprocess.run(
        ["/bin/sh", script], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False
    )
