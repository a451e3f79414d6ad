"""torchrun's elastic rendezvous as the membership service of an elastic job.

Under ``torchrun --nnodes MIN:MAX --rdzv-backend c10d`` the workers reach a TCPStore that an agent
hosts (MASTER_ADDR:MASTER_PORT, torch's shared rendezvous store). After a failure in generation G
every survivor writes `ask/ID` there (with the rank its error named, if any) and watches the others:
once every member of G asked or was named failed, or the join window has passed, the first survivor
to get there writes the new member list with compare_set, and every survivor reads that one list.
Members keep their order, so the lowest surviving rank becomes rank 0 and the state is synchronised
from it. The next generation's transport meets under its own prefix of the same store: a Gloo group
there, or, over gRPC, every rank writes the address its new server will listen on (a fresh port) and
reads the others' into COMMSCHED_GRPC_PEERS.

What torchrun itself does around this, and what follows:
- A worker's agent ends when its worker fails (--max-restarts 0) and with it the stores it hosts:
  the agent of group rank 0 holds MASTER_PORT's store, and the agent that bound --rdzv-endpoint
  holds the rendezvous (torch's other agents end their workers when it is gone). Losing a worker
  of one of those agents ends the job; a survivor then says so, naming the store.
- A node that joins makes every agent restart its workers (SIGTERM): each keeps its last commit for
  its successor on the same node, and the restarted group resumes from it (torchrun_resume.py). A
  worker that loses a peer to that SIGTERM waits for its own instead of re-forming without it.
  With torch 2.13 a node joins only with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its agents keep the
  first round's address of a shared store): worker rank 0 then hosts the workers' store at
  MASTER_PORT, and over gRPC the first generation's addresses meet there too (first_grpc_peers).
- torch's exit barrier at the end counts every agent, and one whose worker failed never arrives:
  the new rank 0 arrives for each agent whose workers were all lost (exit_barrier.py), so the
  survivors' agents end with their workers instead of after 300 s.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import time
from typing import Any

from commsched.elastic import exit_barrier
from commsched.elastic.membership import Assignment, MembershipError, ranks_text
from commsched.error_text import first_line

log = logging.getLogger("commsched")

# Set by torchrun's agents in every worker's environment.
RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"
# Ranks the job needs to go on; unset: torchrun's --nnodes minimum times the processes per node.
MIN_VARIABLE = "COMMSCHED_ELASTIC_MIN_NP"
# Seconds the ranks get to rejoin after the first survivor asked (commsched-run's --elastic-timeout).
TIMEOUT_VARIABLE = "COMMSCHED_ELASTIC_TIMEOUT"
_DEFAULT_WINDOW_S = 10.0
_POLL_S = 0.02
_STORE_TIMEOUT = datetime.timedelta(seconds=30)
# How long a worker waits for its agent's SIGTERM once another was stopped for a restart (torch's
# agents see a joining node within their --monitor-interval of each other).
_RESTART_WAIT_S = 30.0
# How long a worker whose store went away waits for its own SIGTERM before the job ends (agents see
# a joining node within about a second of each other).
_RESTART_GRACE_S = 5.0


# The transports whose ranks re-form under torchrun.
TRANSPORTS = ("gloo", "grpc")
# Where a gRPC rank finds every rank's address (commsched.transports.grpc_net.parse_peers).
PEERS_VARIABLE = "COMMSCHED_GRPC_PEERS"


def unsupported(transport: str) -> str:
    """Why the ranks on `transport` cannot re-form under torchrun, or "" when they can (Gloo, gRPC)."""
    if transport in TRANSPORTS:
        return ""
    return (
        f"under torchrun commsched re-forms the ranks over Gloo and gRPC only, not {transport} "
        "(COMMSCHED_TRANSPORT=gloo, the default under torchrun with PyTorch and host tensors, or grpc)"
    )


def active(environ: dict[str, str] | None = None) -> bool:
    """True in a worker started by torchrun's elastic agent (its rendezvous can re-form the ranks)."""
    env = os.environ if environ is None else environ
    return bool(env.get(RUN_ID_VARIABLE)) and "RANK" in env and "MASTER_PORT" in env


def _number(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: give a number >= {minimum:g}")
    return value


def window_s() -> float:
    """How long the survivors wait for the other ranks to rejoin (COMMSCHED_ELASTIC_TIMEOUT)."""
    return _number(TIMEOUT_VARIABLE, _DEFAULT_WINDOW_S, 0.1)


def _agent_argument(pid: int, *names: str) -> str | None:
    """The value of option `names` (any spelling) on the command line of torchrun's agent `pid`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            arguments = handle.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for index, argument in enumerate(arguments):
        if argument in names and index + 1 < len(arguments):
            return arguments[index + 1]
        if argument.split("=", 1)[0] in names and "=" in argument:
            return argument.split("=", 1)[1]
    return None


def _agent_min_nodes(pid: int) -> int | None:
    """The MIN of `--nnodes MIN:MAX` on the command line of torchrun's agent `pid`, if it has one."""
    value = _agent_argument(pid, "--nnodes")
    if value is None:
        return None
    first = value.split(":", 1)[0]
    return int(first) if first.isdigit() else None


def rendezvous_endpoint() -> str:
    """The --rdzv-endpoint of this worker's agent (its command line, else PET_RDZV_ENDPOINT)."""
    value = _agent_argument(os.getppid(), "--rdzv-endpoint", "--rdzv_endpoint")
    return value if value is not None else os.environ.get("PET_RDZV_ENDPOINT", "")


def min_ranks() -> int:
    """The fewest ranks the job goes on with: COMMSCHED_ELASTIC_MIN_NP, else torchrun's --nnodes
    minimum times LOCAL_WORLD_SIZE (an agent whose worker fails stops its other workers), else 1."""
    if os.environ.get(MIN_VARIABLE):
        return int(_number(MIN_VARIABLE, 1, 1))
    nodes = _agent_min_nodes(os.getppid())
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return nodes * per_node if nodes else 1


class _Job:
    """This worker's view of the job: the store, the members of its generation and its place."""

    def __init__(self) -> None:
        self.member = int(os.environ["RANK"])  # the rank at launch names the worker for the whole job
        self.address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
        self.prefix = ""
        self.members = list(range(int(os.environ["WORLD_SIZE"])))
        self.launched = list(self.members)
        self.generation = 0
        self.group = 0  # which worker group of the run this is (torchrun restarts them all on a join)
        self._store: Any = None

    def store(self) -> Any:
        """A client of torchrun's store, connected once."""
        if self._store is None:
            import torch.distributed as dist

            host, _, port = self.address.rpartition(":")
            try:
                self._store = dist.TCPStore(host, int(port), is_master=False, timeout=_STORE_TIMEOUT)
            except (RuntimeError, ValueError) as error:
                raise self.gone(error) from None
        return self._store

    def gone(self, error: BaseException) -> MembershipError:
        """The error for a store that stopped answering: its agent ended with its worker."""
        first = first_line(error)
        return MembershipError(
            f"torchrun's rendezvous store at {self.address} does not answer ({first}): the agent of "
            "group rank 0 hosts it (worker rank 0 itself with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and "
            "ends when its worker fails, so under torchrun the job cannot outlive the rank that started "
            "as 0; launch with `commsched-run -n N --min-np MIN` to survive the loss of any rank"
        )


_job: _Job | None = None


def job() -> _Job:
    """This process's job (made on first use)."""
    global _job
    if _job is None:
        _job = _Job()
    return _job


def start(broadcast_object: Any) -> None:
    """Called once by every worker of a worker group as its core starts: names the group's keys and
    records where this worker runs and under which agent."""
    current = job()
    run_id = os.environ[RUN_ID_VARIABLE]
    store = current.store()
    try:
        # Agents keep their store across their restarts: a count tells this group from earlier ones.
        group = store.add(f"commsched.elastic.{run_id}.groups", 1) if current.member == 0 else 0
    except RuntimeError as error:
        raise current.gone(error) from None
    group = int(broadcast_object(group))
    current.prefix = f"commsched.elastic.{run_id}.{group}"
    try:
        store.set(f"{current.prefix}/where/{current.member}", f"{socket.gethostname()} {os.getpid()}")
        exit_barrier.record_agent(store, current.prefix, current.member)
    except RuntimeError as error:
        raise current.gone(error) from None
    current.group = group


def record_group(transport: str, broadcast_object: Any) -> None:
    """start() as the core of a torchrun worker starts on a transport whose ranks re-form, before
    the training: a rank lost from then on is re-formed without. A job that cannot be elastic
    (another launcher, the store gone) starts as before, and commsched.elastic.run says why later."""
    if not active() or unsupported(transport) or job().prefix:
        return
    import functools

    try:
        start(functools.partial(broadcast_object, name="commsched.elastic.group"))
    except (MembershipError, RuntimeError) as error:  # RankFailure: lost before the group was named
        log.debug("commsched.elastic: torchrun's worker group not recorded at start (%s)", error)


def refuse_restarted() -> None:
    """Refuses workers that torchrun restarted after a failure: their commit ended with the old ones."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts > 0:
        raise MembershipError(
            "torchrun restarted the workers of this job after a failure (--max-restarts), and the state "
            "committed in memory ended with the old workers: commsched re-forms under torchrun without "
            "restarts. Launch with --max-restarts 0 (a node that joins keeps the last commit)"
        )


def stopping() -> None:
    """Tells the other workers that torchrun's agent is stopping this one (SIGTERM): a rank lost to
    that is no failure, and they wait for their own SIGTERM instead of re-forming without it."""
    current = job()
    if current.prefix:
        try:
            current.store().set(f"{current.prefix}/stopping", str(current.member))
        except (RuntimeError, MembershipError):
            pass  # the store is gone: the job is ending anyway


def _wait_for_the_restart(store: Any, prefix: str) -> None:
    """Waits for this worker's SIGTERM when torchrun's agents are stopping the workers to restart
    them (a node joined): its handler ends the wait, and the worker keeps its last commit."""
    if not store.check([f"{prefix}/stopping"]):
        return
    member = store.get(f"{prefix}/stopping").decode()
    time.sleep(_RESTART_WAIT_S)  # the SIGTERM handler raises out of the sleep
    raise MembershipError(
        f"torchrun's agent stopped rank {member} (numbered as at launch) to restart the workers, but "
        f"this worker's agent did not stop it within {_RESTART_WAIT_S:g}s"
    )


def _grace_for_a_restart() -> None:
    """Before a store that went away ends the job: if this worker keeps its commit on SIGTERM, waits
    a little for one. The worker that hosted the store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) may have
    ended for torchrun's restart of every worker, and this worker's agent then stops it too."""
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        time.sleep(_RESTART_GRACE_S)  # the SIGTERM handler raises out of the sleep


def request(failed_rank: int | None) -> Assignment:
    """Agrees with the other survivors on the next generation through torchrun's store."""
    current = job()
    if not current.prefix:
        raise MembershipError("commsched.elastic: the torchrun membership was not started (start())")
    try:
        _wait_for_the_restart(current.store(), current.prefix)
    except (RuntimeError, OSError) as error:
        _grace_for_a_restart()
        raise current.gone(error) from None
    named = (
        [current.members[failed_rank]]
        if failed_rank is not None and 0 <= failed_rank < len(current.members)
        else []
    )
    base = f"{current.prefix}/g{current.generation}"
    try:
        store = current.store()
        store.set(f"{base}/ask/{current.member}", json.dumps(named))
        decided = _decide(store, base, current.members, window_s())
    except MembershipError:
        raise
    except (RuntimeError, OSError) as error:
        _grace_for_a_restart()
        raise current.gone(error) from None
    lost = [member for member in current.members if member not in decided]
    if current.member not in decided:
        raise MembershipError(
            f"rank {current.member} (numbered as at launch) was left out of generation "
            f"{current.generation + 1}: the others re-formed without it (it was named lost, or did not "
            f"rejoin within {TIMEOUT_VARIABLE}={window_s():g}s: stopped or hung)"
        )
    needed = min_ranks()
    if len(decided) < needed:
        raise MembershipError(
            f"{ranks_text(lost)} (numbered as at launch) failed; {len(decided)} "
            f"{'rank is' if len(decided) == 1 else 'ranks are'} left, below the job's minimum of {needed} "
            f"(torchrun's --nnodes minimum times the processes per node, or {MIN_VARIABLE})"
        )
    if decided.index(current.member) == 0:
        _stop_left_out(store, current.prefix, lost)
        exit_barrier.arrive_later(
            current.address, current.prefix, current.launched, decided, rendezvous_endpoint()
        )
    current.members = decided
    current.generation += 1
    return Assignment(decided.index(current.member), len(decided), 0, current.generation)


def _decide(store: Any, base: str, members: list[int], window: float) -> list[int]:
    """The members of the next generation: written once by whichever survivor first sees every
    member asked or named failed, or the window past; read by all."""
    decision = f"{base}/members"
    deadline = time.monotonic() + window
    asked: dict[int, list[int]] = {}
    while True:
        if store.check([decision]):
            return [int(member) for member in json.loads(store.get(decision))]
        for member in members:
            if member not in asked and store.check([f"{base}/ask/{member}"]):
                asked[member] = json.loads(store.get(f"{base}/ask/{member}"))
        failed = {member for named in asked.values() for member in named}
        if all(member in asked or member in failed for member in members) or time.monotonic() >= deadline:
            proposal = json.dumps([member for member in members if member in asked])
            return [int(member) for member in json.loads(store.compare_set(decision, "", proposal))]
        time.sleep(_POLL_S)


def _stop_left_out(store: Any, prefix: str, lost: list[int]) -> None:
    """SIGKILLs left-out workers that are stopped (SIGSTOP) on this host: their agents wait for them
    forever otherwise. A worker on another host is its agent's to end."""
    here = socket.gethostname()
    for member in lost:
        where = f"{prefix}/where/{member}"
        try:
            if not store.check([where]):  # get() would wait for it
                continue
            host, pid = store.get(where).decode().split()
            if host != here:
                continue
            with open(f"/proc/{pid}/stat") as handle:
                stopped = handle.read().rpartition(")")[2].split()[0] == "T"
            if stopped:
                os.kill(int(pid), signal.SIGKILL)
        except (RuntimeError, OSError, ValueError):
            continue


def join(assignment: Assignment, timeout: datetime.timedelta, transport: str = "gloo") -> None:
    """Prepares the new generation's `transport`, meeting under its prefix of the store: joins its
    torch.distributed group (Gloo), or exchanges the gRPC servers' addresses (gRPC)."""
    import torch.distributed as dist

    current = job()
    base = f"{current.prefix}/g{assignment.generation}"
    if transport == "grpc":
        os.environ[PEERS_VARIABLE] = ",".join(_grpc_peers(current.store(), base, assignment, timeout))
        return
    store = dist.PrefixStore(f"{base}/pg", current.store())
    dist.init_process_group(
        "gloo", store=store, rank=assignment.rank, world_size=assignment.size, timeout=timeout
    )


def first_grpc_peers(rank: int, size: int, timeout: datetime.timedelta) -> list[str]:
    """Every rank's gRPC address as a worker group starts, exchanged through the workers' store, when
    no agent hosts that store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1); [] otherwise (gRPC then meets
    one port above the agent's store, at MASTER_PORT + 1).

    Without the agent's store worker rank 0 hosts it at MASTER_PORT, as torch.distributed's env://
    rendezvous would, for the whole life of the process: the elastic membership meets there, so
    rank 0's gRPC server must not take that port, and listens on a fresh one like every other rank's.
    """
    global _hosted
    if size < 2 or not active() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return []
    import torch.distributed as dist

    current = job()
    host, _, port = current.address.rpartition(":")
    if rank == 0 and _hosted is None:
        try:
            _hosted = dist.TCPStore(
                host.strip("[]"), int(port), is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT
            )
        except (RuntimeError, ValueError) as error:
            raise MembershipError(
                f"worker rank 0 could not host the workers' store at MASTER_PORT={port} ({error}): "
                "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun leaves that port to rank 0; is "
                "another process listening on it?"
            ) from None
    store = current.store()
    run_id = os.environ.get(RUN_ID_VARIABLE, "")
    try:
        return _grpc_peers(store, f"commsched.grpc.{run_id}.first", Assignment(rank, size, 0, 0), timeout)
    except RuntimeError as error:
        first = first_line(error)
        raise MembershipError(
            f"the {size} gRPC ranks did not all write their addresses to the workers' store at "
            f"{current.address} within {timeout.total_seconds():g}s ({first}): did every worker start? "
            "(the wait is the larger stall limit, COMMSCHED_STALL_TIMEOUT or COMMSCHED_STALL_SHUTDOWN)"
        ) from None


# The workers' store when this worker hosts it (first_grpc_peers): it lives as long as the process.
_hosted: Any = None


def _grpc_peers(store: Any, base: str, assignment: Assignment, timeout: datetime.timedelta) -> list[str]:
    """Every rank's gRPC address in the new generation, by rank: each writes its own (the address
    that reaches the store, or COMMSCHED_GRPC_BIND's, and a fresh port) and waits for the others'.

    A fresh port per generation: the failed generation's servers may still hold theirs, and a port
    from outside the ephemeral range is not one the other ranks' outgoing connections take meanwhile.
    """
    from commsched.config import resolve
    from commsched.run import free_port
    from commsched.transports.grpc_net import resolve_bind

    settings = resolve({})
    host, _, port = job().address.rpartition(":")
    _, advertise = resolve_bind(settings.grpc_bind, host.strip("[]"), int(port))
    shown = f"[{advertise}]" if ":" in advertise else advertise
    keys = [f"{base}/grpc/{rank}" for rank in range(assignment.size)]
    store.set(keys[assignment.rank], f"{shown}:{free_port(advertise)}")
    store.wait(keys, timeout)
    return [store.get(key).decode() for key in keys]
