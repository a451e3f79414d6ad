"""The local launcher: `commsched-run -n N script.py` (or `python -m commsched.run`)."""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys
import types
from typing import Any

_LOWEST_PORT = 10000  # below this, ports of well-known services cluster


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` right now (IPv4 or IPv6 address), outside the
    ephemeral range where possible.

    The other ranks' gRPC servers listen on a port the OS picks from the ephemeral range, so a
    rendezvous port from that range can be handed to one of them before rank 0 binds it (rank 1
    would then listen on MASTER_PORT and try to join itself).
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


_JOIN_WINDOW_S = 10.0  # elastic: how long the other ranks get to rejoin after the first asks
_GRACE_S = 5.0  # after a failure: before SIGTERM to the ranks still there, and again before SIGKILL
_POLL_S = 0.05


def _prog(argv0: str) -> str:
    """The name usage lines give: the command as started (commsched-run, or a wrapper's own name);
    "commsched-run" when started as a module or file (python -m commsched.run, python run.py)."""
    name = os.path.basename(argv0 or "")
    return name if name and not name.endswith(".py") and name not in ("-c", "-m") else "commsched-run"


def _parser(prog: str) -> Any:
    """The launcher's flags; `prog` names it in usage lines and errors."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument(
        "-n",
        "-np",
        "--nproc",
        type=int,
        required=True,
        help="ranks to start on this host (-np as horovodrun)",
    )
    parser.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument(
        "-m", dest="module", action="store_true", help="run PROGRAM as a module (python -m PROGRAM)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=_GRACE_S,
        help=f"seconds the other ranks get to exit by themselves after one failed, before SIGTERM, and "
        f"again before SIGKILL (default {_GRACE_S:g})",
    )
    parser.add_argument(
        "--bind-to",
        choices=BINDINGS,
        default="none",
        help="core: each rank on its own equal share of the CPUs the launcher may use, as mpiexec -bind-to core, "
        "so ranks do not take each other's cores (threads and child processes inherit it); "
        "none (default): every rank keeps the launcher's CPUs",
    )
    parser.add_argument(
        "--grpc-tls",
        action="store_true",
        help="gRPC over TLS with a throwaway CA and certificate made for this job (sets COMMSCHED_GRPC_TLS_*)",
    )
    parser.add_argument(
        "--min-np",
        type=int,
        help="elastic training: a failed rank is left out and the others re-form (commsched.elastic.run) "
        "while at least this many are left; below it the job ends naming the failed ranks",
    )
    parser.add_argument(
        "--max-np", type=int, help="elastic training: the most ranks the job may have (default -n)"
    )
    parser.add_argument(
        "--elastic-timeout",
        type=float,
        default=_JOIN_WINDOW_S,
        help="elastic training: seconds the ranks get to rejoin after a failure; one that has not by then "
        f"(stopped or hung) is killed and left out (default {_JOIN_WINDOW_S:g})",
    )
    parser.add_argument(
        "--host-discovery-script",
        help="elastic training: an executable printing `hostname:slots` lines (Horovod's format), run about "
        "once a second; new slots on this host (up to --max-np) start ranks that join at the next commit, "
        "slots gone stop ranks. Only this machine's names (localhost, 127.0.0.1, its hostname) are accepted",
    )
    parser.add_argument(
        "program",
        help="the script each rank runs with this Python (a module with -m), or a command to run as it is "
        "(an executable, e.g. `python train.py` as horovodrun takes it)",
    )
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="arguments passed on to PROGRAM")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`commsched-run -n N script.py ...` (or `-np N python script.py ...`, or `python -m commsched.run`): N local ranks, torchrun-style
    variables and a fresh COMMSCHED_JOB_TOKEN (unless one is set), so gRPC peers accept only this job.
    When a rank fails, the others are ended (SIGTERM, then SIGKILL), as torchrun does."""
    import secrets
    import sys
    import tempfile

    parser = _parser(_prog(sys.argv[0]))
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    if not 0 <= args.grace < math.inf:  # nan and inf too: the job would wait on a failed rank forever
        parser.error(f"--grace must be a number of seconds, 0 or more, not {args.grace}; e.g. --grace 5")
    if not 0 <= args.master_port <= 65535:
        parser.error(
            f"--master-port must be a TCP port, 1 to 65535, not {args.master_port}; or leave it out for a free one"
        )
    _check_elastic(parser, args)
    # After the flags: a flag's error says more than a missing script that the flags would not run.
    executable = None if args.module else _as_command(args.program)
    if not args.module and executable is None and not os.path.isfile(args.program):
        parser.error(
            f"{args.program}: no such file or command; give the script each rank runs (or -m MODULE, or a "
            "command such as `python train.py`)"
        )
    base = dict(os.environ)
    base.setdefault("COMMSCHED_JOB_TOKEN", secrets.token_hex(16))
    base.update(
        MASTER_ADDR=base.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(args.master_port or free_port()),
        WORLD_SIZE=str(args.nproc),
    )
    if executable is not None:
        command = [executable, *args.arguments]
    else:
        command = [sys.executable] + (["-m"] if args.module else []) + [args.program] + args.arguments
    cpus = None
    if args.bind_to == "core":
        if not hasattr(os, "sched_getaffinity"):
            parser.error("--bind-to core needs Linux (sched_setaffinity); use --bind-to none here")
        cpus = cpu_shares(sorted(os.sched_getaffinity(0)), args.nproc)
    with tempfile.TemporaryDirectory(prefix="commsched-tls-") as secrets_dir:
        if args.grpc_tls:
            from commsched.transports.grpc_tls import make_job_certificates

            base.update(make_job_certificates(secrets_dir, [base["MASTER_ADDR"]]))
        if args.min_np is None and args.max_np is None:
            return _Job(command, base, args.nproc, args.grace, cpus).run()
        from commsched.elastic.launcher import ElasticJob

        return ElasticJob(
            command,
            base,
            args.nproc,
            args.grace,
            cpus,
            min_np=args.min_np or 1,
            max_np=args.max_np or args.nproc,
            join_window_s=args.elastic_timeout,
            discovery_script=args.host_discovery_script,
        ).run()


def _as_command(program: str) -> str | None:
    """The executable to start as it is, where `program` is a command rather than a Python script.

    horovodrun and mpiexec take a command (`python train.py`); torchrun a script. A .py file, or a file
    that cannot run by itself, is a script for this Python; an executable file with a #! line or of
    machine code (an interpreter), or a name on PATH that is not a file here, is a command.
    """
    if program.endswith(".py"):
        return None
    if os.path.isfile(program):
        if not os.access(program, os.X_OK):
            return None
        with open(program, "rb") as head:
            start = head.read(4)
        return os.path.abspath(program) if start.startswith(b"#!") or start == b"\x7fELF" else None
    return shutil.which(program)


def _check_elastic(parser: Any, args: Any) -> None:
    """Refuses elastic flags that do not fit together, naming the fix."""
    low = args.min_np if args.min_np is not None else 1
    high = args.max_np if args.max_np is not None else args.nproc
    if not 1 <= low <= args.nproc <= high:
        parser.error(
            f"elastic sizes must satisfy 1 <= --min-np ({low}) <= -n ({args.nproc}) <= --max-np ({high})"
        )
    if not 0 < args.elastic_timeout < math.inf:
        parser.error(f"--elastic-timeout must be more than 0 seconds, not {args.elastic_timeout}; e.g. 30")
    if args.host_discovery_script is not None:
        from commsched.elastic import discovery

        try:
            slots = discovery.discover(args.host_discovery_script)
        except discovery.DiscoveryError as error:
            parser.error(str(error))
        if slots < args.nproc:
            parser.error(
                f"--host-discovery-script {args.host_discovery_script} gives {slots} slots on this host; "
                f"-n {args.nproc} needs at least as many (start with fewer ranks or list more slots)"
            )


BINDINGS = ("none", "core")


def cpu_shares(cpus: list[int], ranks: int) -> list[set[int]]:
    """Each rank's CPUs under --bind-to core: `cpus` cut into `ranks` equal consecutive shares (what is
    left over stays unused, so every rank gets as many); with more ranks than CPUs, one CPU each, in turn."""
    if not cpus:
        raise ValueError("no CPUs to bind ranks to")
    if ranks >= len(cpus):
        return [{cpus[rank % len(cpus)]} for rank in range(ranks)]
    share = len(cpus) // ranks
    return [set(cpus[rank * share : (rank + 1) * share]) for rank in range(ranks)]


class _Job:
    """The local ranks of one job: started in sessions of their own, supervised, ended together."""

    def __init__(
        self,
        command: list[str],
        environment: dict[str, str],
        ranks: int,
        grace_s: float,
        cpus: list[set[int]] | None = None,
    ) -> None:
        self._command = command
        self._cpus = cpus  # per rank under --bind-to core; None: the launcher's own
        self._environment = environment
        self._size = ranks
        self._grace_s = grace_s
        self._processes: dict[int, Any] = {}
        self._signals: list[int] = []

    def run(self) -> int:
        """Starts every rank and waits for them; returns the job's exit status (the first failure's)."""
        import signal
        import subprocess

        forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {number: signal.signal(number, self._on_signal) for number in forwarded}
        status = -1
        try:
            for rank in range(self._size):
                # A session of its own per rank: ending the rank ends whatever it started, too.
                start_rank = functools.partial(_start_rank, self._cpus[rank] if self._cpus else None)
                self._processes[rank] = subprocess.Popen(
                    self._command,
                    env=self._rank_environment(rank),
                    start_new_session=True,
                    preexec_fn=start_rank,  # noqa: PLW1509 - the launcher runs no threads
                )
            status = self._supervise()
            return status
        finally:
            if status != 0:  # a failed job leaves nothing behind: what the ranks started goes too
                self._send_all(signal.SIGKILL)
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _rank_environment(self, rank: int) -> dict[str, str]:
        return dict(self._environment, RANK=str(rank), LOCAL_RANK=str(rank))

    def _on_signal(self, number: int, _frame: Any) -> None:
        self._signals.append(number)

    def _supervise(self) -> int:
        """Waits for the ranks. After a failure the others get the grace period to notice and exit by
        themselves (commsched's error then names the rank and the tensor), then SIGTERM, then SIGKILL."""
        import signal
        import time

        status = 0
        failed_at: float | None = None  # when the first rank failed (or a signal came)
        sent = 0  # 0: nothing, 1: SIGTERM (or the forwarded signal), 2: SIGKILL
        running = dict(self._processes)
        while running:
            for rank, process in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[rank]
                if code != 0 and failed_at is None:
                    status = _exit_status(code)
                    _say(
                        f"rank {rank} (pid {process.pid}) {_how_it_ended(code)}; "
                        + (
                            f"the others ({_listed(running)}) have {self._grace_s:g}s to exit"
                            if running
                            else ""
                        )
                    )
                    failed_at = time.monotonic()
            now = time.monotonic()
            if self._signals and sent == 0:
                number = self._signals[0]
                status, failed_at, sent = status or 128 + number, now - self._grace_s, 1
                _say(f"got {signal.Signals(number).name}; passing it on to every rank")
                self._end(number)
            if not running:
                break
            waited = now - failed_at if failed_at is not None else 0.0
            if sent == 0 and failed_at is not None and waited >= self._grace_s:
                _say(f"{_listed(running)} still there {self._grace_s:g}s after the failure: SIGTERM")
                self._end(signal.SIGTERM)
                sent = 1
            elif sent == 0 and failed_at is not None and all(map(_stopped, running.values())):
                # A stopped rank cannot exit by itself, so the grace would only delay the job's end.
                _say(f"{_listed(running)} stopped (SIGSTOP) after the failure: SIGTERM and SIGCONT")
                self._end(signal.SIGTERM)
                failed_at, sent = now - self._grace_s, 1  # SIGKILL one grace period from now
            elif sent == 1 and (waited >= 2 * self._grace_s or len(self._signals) > 1):
                _say(f"{_listed(running)} still there: SIGKILL")
                self._send_all(signal.SIGKILL)
                sent = 2
            time.sleep(_POLL_S)
        return status

    def _end(self, number: int) -> None:
        """Sends `number` to every rank's session, and SIGCONT, so a stopped rank acts on it."""
        import signal

        self._send_all(number)
        self._send_all(signal.SIGCONT)

    def _send_all(self, number: int) -> None:
        for process in self._processes.values():
            try:
                os.killpg(process.pid, number)
            except (ProcessLookupError, PermissionError):
                pass  # the rank and everything it started are gone


def _start_rank(cpus: set[int] | None) -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux), so a killed commsched-run
    leaves no ranks behind in their own sessions; bound to `cpus` under --bind-to core, before the
    program starts any thread (threads inherit it)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own signal handling is all there is
    if cpus:
        os.sched_setaffinity(0, cpus)


def _stopped(process: Any) -> bool:
    """Whether the process is stopped by a signal (state T in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{process.pid}/stat", "rb") as stat:
            # The state follows the command name, which is in parentheses and may hold spaces.
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def _exit_status(code: int) -> int:
    """A child's Popen return code as a shell exit status (128 + N for signal N)."""
    return 128 - code if code < 0 else code


def _how_it_ended(code: int) -> str:
    import signal

    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _listed(ranks: dict[int, Any]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _say(message: str) -> None:
    import sys

    print(f"commsched-run: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())


class _LauncherModule(types.ModuleType):
    """commsched.run is this launcher's module and, called, Horovod's horovod.run(func, ...)."""

    def __call__(self, func: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs `func` on ranks of this host and returns their results (commsched.run_function.run)."""
        from commsched.run_function import run

        return run(func, *args, **kwargs)


if __name__ != "__main__":
    # `import horovod` scripts call horovod.run(func, num_proc=...); here that is commsched.run(...).
    sys.modules[__name__].__class__ = _LauncherModule
