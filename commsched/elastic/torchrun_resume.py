"""The last commit across torchrun's restart of every worker, when a node joins an elastic job.

torchrun's agents restart all their workers when a node joins the rendezvous (membership changes do
not count against --max-restarts): each agent sends its workers SIGTERM, waits up to 30 s, and starts
new ones at the new size. The state committed in memory would end with the old workers, so on that
SIGTERM each worker restores its last commit and keeps it in a file in /dev/shm named after the run
id, its agent's pid and its local rank, where its successor on the same node finds it. The new
worker group gathers which ranks found one; the ranks that did come first (they are renumbered if
the group's own numbering puts a joining node first), each loads its own, the reset callbacks run,
and the state sync makes every rank rank 0's, the joining node's workers included. A
DistributedOptimizer(shard=True) is kept in its plain form and laid out afresh at the new size on
every rank, as after a failure (elastic_shard).

A SIGTERM during commit() waits until the commit is whole. A file whose agent ended without
starting new workers is removed by a small watcher process once that agent is gone.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from commsched.elastic import torchrun
from commsched.elastic.membership import Assignment, MembershipError

log = logging.getLogger("commsched")

_SHARED_MEMORY = Path("/dev/shm")
# The watcher: removes the kept commit once the agent that would restart this worker has ended.
_WATCHER = """
import os, sys, time
path, agent = sys.argv[1], int(sys.argv[2])
while os.path.exists(path):
    try:
        os.kill(agent, 0)
    except ProcessLookupError:
        os.unlink(path)
        break
    time.sleep(1.0)
"""


class Stopping(BaseException):
    """torchrun's agent sent SIGTERM: the worker keeps its last commit and exits (not an Exception,
    so that training code's own `except Exception` does not swallow it)."""


class _Guard:
    """SIGTERM handling of this process: raises Stopping, unless a commit is being saved."""

    def __init__(self) -> None:
        self.saving = False
        self.pending = False
        self.installed = False

    def handle(self, number: int, frame: FrameType | None) -> None:
        torchrun.stopping()
        if self.saving:
            self.pending = True  # raised once the commit is whole
            return
        raise Stopping()


_guard = _Guard()
_resumed = False


def kept_path(environ: dict[str, str] | None = None) -> Path:
    """Where this worker keeps its last commit for its successor on the same node."""
    env = os.environ if environ is None else environ
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", env.get(torchrun.RUN_ID_VARIABLE, "none"))
    folder = _SHARED_MEMORY if _SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return folder / f"commsched-elastic-{run_id}-{os.getppid()}-{env.get('LOCAL_RANK', '0')}.commit"


def watch(state: Any) -> None:
    """Makes SIGTERM keep `state`'s last commit (unless the program handles SIGTERM itself)."""
    if _guard.installed or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    if not getattr(state, "_commsched_guarded", False):
        save = state.save

        def guarded_save() -> None:
            _guard.saving = True
            try:
                save()
            finally:
                _guard.saving = False
            if _guard.pending:
                raise Stopping()

        object.__setattr__(state, "save", guarded_save)
        object.__setattr__(state, "_commsched_guarded", True)
    signal.signal(signal.SIGTERM, _guard.handle)
    _guard.installed = True


def unwatch() -> None:
    """Gives SIGTERM its default action back (training is over)."""
    if _guard.installed:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _guard.installed = False


def keep_and_exit(state: Any) -> None:
    """Restores `state`'s last commit, writes it where this worker's successor finds it, and exits
    as SIGTERM would have ended the process."""
    import commsched

    path = kept_path()
    try:
        # Shut down (no settings): the signal came while the ranks re-formed, after run() restored
        # the commit. A core that only stopped on a failure still restores.
        if commsched._state.settings is not None:
            state.restore()
        partial = path.with_suffix(".partial")
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
            handle.write(_dump(_snapshot(state)))
        partial.replace(path)  # whole or not at all, for the successor
        subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(path), str(os.getppid())],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        print(f"commsched.elastic: SIGTERM: the last commit is kept in {path}", file=sys.stderr, flush=True)
    except Exception as error:  # noqa: BLE001 - the process ends either way; say why nothing was kept
        print(
            f"commsched.elastic: SIGTERM: the last commit was not kept ({error})", file=sys.stderr, flush=True
        )
    sys.stdout.flush()
    # Not a normal exit: commsched's shutdown would wait for ranks that are ending too.
    os._exit(128 + signal.SIGTERM)


def _tracked(state: Any) -> dict[str, Any]:
    """The objects with a state_dict() that `state` commits (a State of the program's own: none)."""
    tracked = getattr(state, "tracked", None)
    return tracked() if callable(tracked) else {}


def _snapshot(state: Any) -> dict[str, Any]:
    """The restored state: each tracked object's state_dict() (TorchState) and the plain objects.

    A DistributedOptimizer(shard=True) gives its plain per-parameter form here: restore() joined
    every rank's shard of the commit and took it back to before its layout (elastic_shard).
    """
    committed = getattr(state, "committed_objects", None)
    return {
        "objects": {name: value.state_dict() for name, value in _tracked(state).items()},
        "plain": committed() if callable(committed) else {},
    }


def _dump(snapshot: dict[str, Any]) -> bytes:
    if "torch" in sys.modules:
        import torch

        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        return buffer.getvalue()
    return pickle.dumps(snapshot)


def _load(data: bytes) -> dict[str, Any]:
    # This worker's predecessor wrote it, on this node, readable by this user only.
    if data[:2] == b"PK" and "torch" in sys.modules:
        import torch

        return dict(torch.load(io.BytesIO(data), weights_only=False))
    return dict(pickle.loads(data))


def _apply(state: Any, snapshot: dict[str, Any]) -> None:
    """Loads a snapshot into `state` and commits it."""
    tracked = _tracked(state)
    for name, saved in snapshot["objects"].items():
        if name in tracked:
            tracked[name].load_state_dict(saved)
    if snapshot["plain"]:
        state.load_committed_objects(snapshot["plain"])
    # Only the workers that kept the commit save it (the others are in the state sync meanwhile).
    save_local = getattr(state, "save_local", None)
    (save_local if callable(save_local) else state.save)()


def _lay_out_afresh(state: Any) -> None:
    """Takes every DistributedOptimizer(shard=True) of `state` back to before its layout, on every rank.

    Built as the group started (without model=), its state is cut for that group's ranks: the kept
    commit (the plain form) then loads as a whole optimizer's, the keepers' commit of it gathers no
    shards from the joining worker, which is in the state sync meanwhile, the sync hands every rank
    the plain form, and every rank lays its buckets out and cuts the state again at its next
    forward or first gradient, as after a re-forming (elastic_shard).
    """
    sharded = [value for value in _tracked(state).values() if getattr(value, "sharded", False)]
    if not sharded:
        return
    from commsched.torch import elastic_shard

    for optimizer in sharded:
        if elastic_shard.built(optimizer):
            elastic_shard.unbuild(optimizer)


def resume(state: Any) -> bool:
    """In a worker group torchrun (re)started: loads the commit its predecessors kept, if any rank
    has one, so that the state sync hands it to every rank. Returns True when it did."""
    global _resumed
    import commsched

    if _resumed:
        return False
    current = torchrun.job()
    path = kept_path()
    # A rank lost before the commit is applied fails this call, and elastic.run calls it again.
    held = commsched.allgather_object(path.is_file(), name="commsched.elastic.kept")
    if not any(held):
        _resumed = True
        if current.group > 1:
            raise MembershipError(
                "torchrun restarted the workers of this job (a node joined its rendezvous), and no "
                "worker kept the last commit (they end on SIGTERM only with commsched.elastic.run's "
                "handler; was SIGTERM handled by the program, or were the workers killed?)"
            )
        return False
    _lay_out_afresh(state)
    order = [rank for rank, has in enumerate(held) if has] + [
        rank for rank, has in enumerate(held) if not has
    ]
    if order != list(range(len(held))):
        _renumber(order)
    if path.is_file():
        _apply(state, _load(path.read_bytes()))
        path.unlink(missing_ok=True)
    _resumed = True
    log.warning(
        "commsched.elastic: resumed at %d ranks from the commit kept across torchrun's restart "
        "(%d of them kept it)",
        len(held),
        sum(held),
    )
    state.on_reset()
    return True


def _renumber(order: list[int]) -> None:
    """Starts commsched again with the ranks in `order` (those holding the commit first)."""
    import commsched
    from commsched import elastic

    current = torchrun.job()
    transport = commsched._state.transport
    rank = order.index(commsched.rank())
    commsched.shutdown()
    elastic._forget_torch_groups()
    current.members = [current.members[old] for old in order]
    current.generation += 1
    assignment = Assignment(rank, len(order), 0, current.generation)
    os.environ.update(RANK=str(rank))
    torchrun.join(assignment, elastic._rendezvous_timeout(), transport)
    commsched.init()
    elastic._restart_names()
