#!/usr/bin/env python3
"""Shaped-network rig: N ranks in their own network namespaces behind rate-limited veths.

Topology (one rig)::

    ns <prefix>n0 --veth <prefix>r0 ==tbf==|                 |
    ns <prefix>n1 --veth <prefix>r1 ==tbf==| bridge <prefix>b | ns <prefix>h (hub)
    ...                                    |  (tbf on every   |
                                           |   hub-side port) |

Every rank-side veth is shaped in egress and every hub-side port too, so both
directions of each rank's link are a real ``tc tbf`` bottleneck. Rank i owns
10.77.0.(i+1)/24. Links are created directly inside the namespaces, so the host
namespace never holds a rig interface and concurrent rigs cannot collide on
interface names; namespace names carry the creating pid for ``cleanup_stale``.

Usage::

    with NetRig(n_ranks=2, rate="1gbit") as rig:
        subprocess.run(rig.mpiexec_argv(["python", "train.py"]))

CLI::

    python benchmarks/netrig.py --ranks 2 --rate 1gbit -- python my_mpi4py_script.py
    python benchmarks/netrig.py --ranks 2 --rate 1gbit --check
    python benchmarks/netrig.py --cleanup-stale
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

DEFAULT_PREFIX = "cs"
# MPICH picks recursive halving and doubling for allreduce at 4 ranks: each step talks to another
# partner, so collectives in flight together collide on a receiver's link, and replays ran 0-16%
# slower than the simulator, which models a ring (at 2 and 3 ranks its choice fit the model).
# The rig runs the ring unless told otherwise; at 4 ranks it was also the faster of the two.
# The same holds for all-gathers under 512 KiB at 4 ranks (recursive doubling): the 4-rank
# shard=True replays of ResNet-50 and BERT-base ran 1.284x and 1.156x the best for the split with
# MPICH's choice, 1.148x and 1.071x with the ring (medians, 2026-11-27). Reduce-scatter has no
# ring in MPICH.
MPI_ALLREDUCE_CHOICES = ("ring", "auto")
RING_COLLECTIVES_ENV = {
    "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring",
    "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "tsp_ring",
    "MPIR_CVAR_IALLGATHERV_INTRA_ALGORITHM": "sched_ring",
}
# The queue under each tbf: fifo (tbf's own), or priority: pfifo_fast, whose band 0 serves packets
# marked low-delay (IP_TOS 0x10, SO_PRIORITY 6, as commsched's control channel marks them) ahead of
# bulk data, as a host's default qdisc does on a real NIC.
QUEUES = ("fifo", "priority")
SUBNET = "10.77.0"
_instance_counter = itertools.count()
_IFNAMSIZ = 15

# tc(8) units: the "bit" family is bits per second, the "bps" family BYTES per second.
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SCALE |= {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_RATE_UNITS = {"": 1.0} | {f"{p}bit": f for p, f in _SCALE.items()}
_RATE_UNITS |= {f"{p}bps": 8 * f for p, f in _SCALE.items()}
_SIZE_UNITS = {"": 1.0} | {f"{p}b": f for p, f in _SCALE.items()}


def _steer_receive(namespace: str, dev: str) -> None:
    """Receives each flow on one CPU (RPS by flow hash), so the veth does not reorder packets.

    Without it a packet is received on whichever CPU its sender ran on; a sender that moves
    between CPUs got its TCP segments reordered, and every rank saw 6-115 spurious fast
    retransmits per 4-rank replay, which a real link does not cause.
    """
    mask = format((1 << (os.cpu_count() or 1)) - 1, "x")
    setting = f"/sys/class/net/{dev}/queues/rx-0/rps_cpus"
    # A kernel without RPS has no such file: the rig still works, only less like a wire.
    _run(["ip", "netns", "exec", namespace, "sh", "-c", f"[ ! -w {setting} ] || echo {mask} > {setting}"])


class RigError(RuntimeError):
    """A rig could not be built or torn down."""


def parse_rate(rate: str) -> float:
    """Convert a tc rate string such as "4gbit" or "500mbps" into bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(
            f"bad rate {rate!r}: expected a number with a tc unit "
            f"(bit, kbit, mbit, gbit, tbit, or bytes per second: bps, mbps, gbps)"
        )
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def parse_size(size: str) -> int:
    """Convert a size such as "64MiB" or "512KB" into bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"bad size {size!r}: expected e.g. 64MiB, 512KB or 1048576")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def expected_allreduce_seconds(nbytes: int, n_ranks: int, rate_bps: float) -> float:
    """Bandwidth-bound allreduce time: each rank moves 2(n-1)/n of the buffer over its link."""
    return 2.0 * (n_ranks - 1) / n_ranks * nbytes * 8.0 / rate_bps


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short admin command, raising RigError with its stderr on failure."""
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RigError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def available() -> tuple[bool, str]:
    """Say whether this process can build a rig, and if not, why."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "building network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the '{tool}' command (iproute2) is not installed"
    probe = f"{DEFAULT_PREFIX}{os.getpid()}probe"
    proc = _run(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return False, f"'ip netns add' does not work here: {proc.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def list_namespaces() -> list[str]:
    """Names of all named network namespaces on this machine."""
    proc = _run(["ip", "netns", "list"], check=False)
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str, grace_s: float = 2.0) -> None:
    """Stop every process still inside ns; a namespace outlives its name while one remains."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_pid_alive(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if _pid_alive(p)]


def _pid_alive(pid: int) -> bool:
    """Whether pid names a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def _delete_namespace(ns: str) -> None:
    """Kill what runs in ns, then delete it; its veths and bridge go with it."""
    _kill_namespace_pids(ns)
    _run(["ip", "netns", "del", ns], check=False)


_RIG_NS = re.compile(r"^(?P<prefix>[a-z]+)(?P<pid>\d+)(?P<tag>[a-z]+)(?:h|n\d+)$")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, include_live: bool = False) -> list[str]:
    """Delete rig namespaces whose name starts with prefix and whose creator is gone."""
    removed = []
    for ns in list_namespaces():
        m = _RIG_NS.match(ns)
        if not m or not ns.startswith(prefix):
            continue
        if not include_live and int(m.group("pid")) != os.getpid() and _pid_alive(int(m.group("pid"))):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


def _instance_tag(k: int) -> str:
    """Letters a, b, ..., z, ba, bb, ... so several rigs in one process get distinct names."""
    tag = ""
    while True:
        tag = chr(ord("a") + k % 26) + tag
        k //= 26
        if k == 0:
            return tag


class NetRig:
    """N network namespaces joined through a hub bridge by tbf-shaped veth links."""

    def __init__(
        self,
        n_ranks: int = 2,
        rate: str = "4gbit",
        burst: str = "256kb",
        latency: str = "50ms",
        prefix: str = DEFAULT_PREFIX,
        handle_signals: bool = True,
        mpi_allreduce: str = "ring",
        queue: str = "fifo",
    ) -> None:
        if not 2 <= n_ranks <= 4:
            raise ValueError(f"n_ranks must be 2 to 4, got {n_ranks}")
        if mpi_allreduce not in MPI_ALLREDUCE_CHOICES:
            raise ValueError(f"mpi_allreduce must be one of {MPI_ALLREDUCE_CHOICES}, got {mpi_allreduce!r}")
        self.mpi_allreduce = mpi_allreduce
        if queue not in QUEUES:
            raise ValueError(f"queue must be one of {QUEUES}, got {queue!r}")
        self.queue = queue
        if not re.fullmatch(r"[a-z]+", prefix):
            raise ValueError(f"prefix must be lowercase letters, got {prefix!r}")
        self.rate_bps = parse_rate(rate)
        self.n_ranks = n_ranks
        self.rate, self.burst, self.latency = rate, burst, latency
        self.prefix = f"{prefix}{os.getpid()}{_instance_tag(next(_instance_counter))}"
        if len(self.prefix) + 2 > _IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} makes interface names longer than {_IFNAMSIZ}")
        self.hub = f"{self.prefix}h"
        self.bridge = f"{self.prefix}b"
        self.namespaces = [f"{self.prefix}n{i}" for i in range(n_ranks)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n_ranks)]
        self._handle_signals = handle_signals
        self._old_handlers: dict[int, Any] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        # Reentrant: a signal handler may call down() while the main thread is inside it.
        self._lock = threading.RLock()
        self._up = False

    # -- names -------------------------------------------------------------

    def interface(self, i: int) -> str:
        """Name of the veth inside rank i's namespace."""
        return f"{self.prefix}r{self._check_rank(i)}"

    def hub_port(self, i: int) -> str:
        """Name of rank i's peer veth, a port of the hub bridge."""
        return f"{self.prefix}p{self._check_rank(i)}"

    def _check_rank(self, i: int) -> int:
        if not 0 <= i < self.n_ranks:
            raise IndexError(f"rank {i} out of range for a {self.n_ranks}-rank rig")
        return i

    # -- lifecycle ---------------------------------------------------------

    def up(self) -> Self:
        """Create namespaces, bridge and shaped links; tear down what was built on failure."""
        self._install_signal_handlers()
        atexit.register(self.down)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        hub = self.hub
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", self.bridge, "up"])
        for i, ns in enumerate(self.namespaces):
            veth, port = self.interface(i), self.hub_port(i)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Created straight into both namespaces: nothing ever appears in the host one.
            _run(
                ["ip", "link", "add", veth, "netns", ns, "type", "veth"]
                + ["peer", "name", port, "netns", hub]
            )
            _run(["ip", "-n", hub, "link", "set", port, "master", self.bridge])
            _run(["ip", "-n", hub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", veth])
            _run(["ip", "-n", ns, "link", "set", veth, "up"])
            for where, dev in ((ns, veth), (hub, port)):
                _run(
                    ["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf"]
                    + ["rate", self.rate, "burst", self.burst, "latency", self.latency]
                )
                if self.queue == "priority":
                    child = ["parent", "1:1", "handle", "10:", "pfifo_fast"]
                    _run(["tc", "-n", where, "qdisc", "add", "dev", dev, *child])
                _steer_receive(where, dev)
        self._wait_links_up()

    def _wait_links_up(self, timeout_s: float = 5.0) -> None:
        """Block until every rank veth reports carrier, so the first packet is not lost."""
        deadline = time.monotonic() + timeout_s
        for i, ns in enumerate(self.namespaces):
            while True:
                out = _run(["ip", "-n", ns, "-j", "link", "show", "dev", self.interface(i)]).stdout
                if json.loads(out)[0].get("operstate") == "UP":
                    break
                if time.monotonic() > deadline:
                    raise RigError(f"{self.interface(i)} in {ns} did not come up")
                time.sleep(0.05)

    def down(self) -> None:
        """Stop processes started through the rig and delete its namespaces; idempotent."""
        with self._lock:
            if not self._up:
                return
            self._up = False
        # Hold SIGINT/SIGTERM until teardown is complete, then let them act normally.
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._teardown()
        finally:
            self._restore_signal_handlers()
            atexit.unregister(self.down)
            if in_main:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _teardown(self) -> None:
        # Poll liveness instead of Popen.wait: a signal may have interrupted a wait on
        # the same Popen, whose lock is then held and a second wait would deadlock.
        for proc in self._procs:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if not _pid_alive(proc.pid):
                    break
                proc.send_signal(sig)
                deadline = time.monotonic() + 3.0
                while _pid_alive(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        for ns in [*self.namespaces, self.hub]:
            _delete_namespace(ns)

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def _install_signal_handlers(self) -> None:
        # signal.signal only works from the main thread; elsewhere rely on __exit__/atexit.
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            # An ignored signal (e.g. SIGINT of a background job) stays ignored.
            if signal.getsignal(sig) != signal.SIG_IGN:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Tear the rig down first, then let the signal do what it would have done."""
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.down()
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # -- launching ---------------------------------------------------------

    def command_for(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """Argv that runs argv inside rank i's namespace with extra environment env."""
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["ip", "netns", "exec", self.namespaces[self._check_rank(i)], "env", *pairs, *argv]

    def mpi_env(self, i: int) -> dict[str, str]:
        """Environment that makes MPICH's rank i talk over its veth only."""
        return {
            # Without this MPICH sees one host and uses shared memory, skipping the link.
            "MPIR_CVAR_NOLOCAL": "1",
            # This MPICH is built with ucx and ofi; ucx is picked by default and ignores FI_*.
            "MPIR_CVAR_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": self.interface(i),
            **(RING_COLLECTIVES_ENV if self.mpi_allreduce == "ring" else {}),
        }

    def mpiexec_argv(
        self,
        argv: Sequence[str] | Sequence[Sequence[str]],
        env: Mapping[str, str] | None = None,
        mpiexec: str | None = None,
    ) -> list[str]:
        """MPMD hydra launch with one rank per namespace: one argv for all, or one per rank."""
        per_rank = _per_rank_argv(argv, self.n_ranks)
        cmd = [mpiexec or find_mpiexec()]
        for i, rank_argv in enumerate(per_rank):
            if i:
                cmd.append(":")
            # Hydra's proxy stays in the host namespace and hands PMI to the rank
            # through an inherited fd, so only the ranks' data uses the veth.
            cmd += ["-n", "1", *self.command_for(i, rank_argv, {**self.mpi_env(i), **(env or {})})]
        return cmd

    def torch_env(self, i: int, port: int = 29500) -> dict[str, str]:
        """Environment for torch.distributed (gloo, env://) rank i through the rig."""
        return {
            "GLOO_SOCKET_IFNAME": self.interface(i),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(port),
            "RANK": str(self._check_rank(i)),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(self.n_ranks),
            "LOCAL_WORLD_SIZE": "1",
        }

    def torch_argvs(
        self, argv: Sequence[str] | Sequence[Sequence[str]], port: int = 29500
    ) -> list[list[str]]:
        """One argv per rank that runs a torch.distributed program in its namespace."""
        per_rank = _per_rank_argv(argv, self.n_ranks)
        return [self.command_for(i, a, self.torch_env(i, port)) for i, a in enumerate(per_rank)]

    def spawn(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Popen that the rig terminates when it goes down."""
        proc: subprocess.Popen[Any] = subprocess.Popen(list(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(received, sent) byte counters of rank i's veth, to prove data crossed the link."""
        ns, dev = self.namespaces[self._check_rank(i)], self.interface(i)
        stats = json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]).stdout)[0]
        return int(stats["stats64"]["rx"]["bytes"]), int(stats["stats64"]["tx"]["bytes"])


def _per_rank_argv(argv: Sequence[str] | Sequence[Sequence[str]], n_ranks: int) -> list[list[str]]:
    """Accept either one argv for every rank or a list of n argvs."""
    if argv and not isinstance(argv[0], str):
        per_rank = [list(a) for a in argv]
        if len(per_rank) != n_ranks:
            raise ValueError(f"got {len(per_rank)} argvs for {n_ranks} ranks")
        return per_rank
    return [list(argv) for _ in range(n_ranks)]  # type: ignore[arg-type]


def find_mpiexec() -> str:
    """The mpiexec next to this interpreter (a venv's MPICH) or else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise RigError("mpiexec not found next to the interpreter or on PATH")
    return found


# -- CLI -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Run ranks in network namespaces joined by tbf-shaped veth links.",
        epilog="Example: netrig.py --ranks 2 --rate 1gbit -- python train.py",
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks, 2 to 4")
    p.add_argument("--rate", default="4gbit", help="tc rate of each link, e.g. 1gbit")
    p.add_argument("--burst", default="256kb", help="tbf burst")
    p.add_argument("--latency", default="50ms", help="tbf queue latency bound (not a delay)")
    p.add_argument("--launcher", choices=("mpi", "torch"), default="mpi", help="how to start ranks")
    p.add_argument(
        "--mpi-allreduce",
        choices=MPI_ALLREDUCE_CHOICES,
        default="ring",
        help="MPICH's allreduce and all-gather algorithms on the ranks: ring (the default; what commsched-sim "
        "models) or auto (MPICH's own choice, at 4 ranks recursive halving and doubling)",
    )
    p.add_argument(
        "--queue",
        choices=QUEUES,
        default="fifo",
        help="the queue under each link's tbf: fifo, or priority (pfifo_fast: low-delay packets first)",
    )
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT for --launcher torch")
    p.add_argument("--check", action="store_true", help="measure allreduce time vs the rate")
    p.add_argument("--backend", choices=("mpi", "gloo", "both"), default="both", help="for --check")
    p.add_argument("--size", default="64MiB", help="allreduce size for --check")
    p.add_argument("--repeats", type=int, default=3, help="timed allreduces for --check")
    p.add_argument("--json", action="store_true", help="print --check results as JSON")
    p.add_argument("--cleanup-stale", action="store_true", help="delete leftover rig namespaces")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    p.add_argument("command", nargs=argparse.REMAINDER, help="command to run on every rank")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.cleanup_stale:
        for ns in cleanup_stale(args.prefix):
            print(f"deleted {ns}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.check and not command:
        _parser().error("give --check, --cleanup-stale or a command after --")
    ok, why = available()
    if not ok:
        print(f"netrig: cannot build a rig: {why}", file=sys.stderr)
        return 2
    options = {"prefix": args.prefix, "mpi_allreduce": args.mpi_allreduce, "queue": args.queue}
    with NetRig(args.ranks, args.rate, args.burst, args.latency, **options) as rig:
        if args.check:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from netrig_check import run_check

            backends = ["mpi", "gloo"] if args.backend == "both" else [args.backend]
            results = [run_check(rig, parse_size(args.size), b, args.repeats) for b in backends]
            for r in results:
                print(json.dumps(asdict(r)) if args.json else r.summary(), flush=True)
            return 0
        try:
            if args.launcher == "mpi":
                return rig.spawn(rig.mpiexec_argv(command)).wait()
            procs = [rig.spawn(a) for a in rig.torch_argvs(command, args.port)]
            return max(abs(p.wait()) for p in procs)
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())
