"""Elastic training with Horovod's API: ``commsched.elastic.run``, ``State``, ``ObjectState``.

Under ``commsched-run --min-np N --max-np M`` a rank that dies or hangs costs the others seconds:
their collectives fail with RankFailure, ``run`` restores the last ``commit()`` from memory, shuts
commsched down, asks the launcher's membership service for the new rank and size, starts commsched
again at that size, synchronises the state from the lowest surviving rank, runs the reset callbacks
and calls the training function again. Under ``torchrun --nnodes MIN:MAX --rdzv-backend c10d`` the
survivors agree on the new membership through torchrun's rendezvous store instead
(commsched.elastic.torchrun). Under mpiexec the membership is fixed: ``run`` says so and a failure
ends the job.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import sys
from collections.abc import Callable
from typing import Any

import commsched
from commsched.elastic import generation, torchrun
from commsched.elastic.generation import forget_torch_groups as _forget_torch_groups
from commsched.elastic.generation import rendezvous_timeout as _rendezvous_timeout
from commsched.elastic.membership import NOTICE_VARIABLE, MembershipError, request
from commsched.launch import detect

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "MembershipError",
    "ObjectState",
    "State",
    "run",
    "run_fn",
]

log = logging.getLogger("commsched")


class HorovodInternalError(RuntimeError):
    """A collective failed because the ranks changed: ``run`` restores the last commit and re-forms."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: ``run`` re-forms at the new size without restoring the state."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


class State:
    """State kept in memory on every rank, committed, restored and synchronised together (Horovod's API)."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[float, bool]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Adds callbacks run after every re-forming (e.g. to scale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run`` after the ranks re-formed: reset(), then the callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, removed: bool) -> None:
        """Queues a notice that hosts changed; the next check_host_updates() acts on it."""
        self._host_messages.put((timestamp, removed))

    def commit(self) -> None:
        """Copies the state to memory (the point a failure rolls back to), then checks for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank together when a host-update notice came."""
        if self._last_updated_timestamp == 0.0 and self._host_messages.empty() and not _notices_possible():
            return  # nothing can send notices in this job: no collective needed to agree on none
        _read_notice(self)
        previous = latest = self._last_updated_timestamp
        removed = False
        while not self._host_messages.empty():
            timestamp, was_removed = self._host_messages.get()
            if timestamp > latest:
                latest, removed = timestamp, removed or was_removed
        # Every rank must raise at the same commit: rank 0's view decides.
        previous, self._last_updated_timestamp, removed = self._bcast_object((previous, latest, removed))
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(removed)

    def save(self) -> None:
        """Saves the state to host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Restores the last committed state, undoing what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjusts objects to the new membership before the state is synchronised."""

    def tracked(self) -> dict[str, Any]:
        """The objects with a state_dict() this state commits, by name (none here; TorchState's)."""
        return {}


class ObjectState(State):
    """State of plain picklable Python objects, given as keyword arguments and kept as attributes."""

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(
            bcast_object=bcast_object or commsched.broadcast_object, get_rank=get_rank or commsched.rank
        )

    def save(self) -> None:
        """Copies the current attribute values as the committed state."""
        import copy

        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        """Sets the attributes back to the committed values."""
        self._set_attrs()

    def sync(self) -> None:
        """Broadcasts rank 0's committed values and sets them on every rank."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def committed_objects(self) -> dict[str, Any]:
        """The plain objects as last committed, by name."""
        return dict(self._saved_state)

    def load_committed_objects(self, values: dict[str, Any]) -> None:
        """Takes `values` as the committed plain objects and sets the attributes to them."""
        self._saved_state = dict(values)
        self._set_attrs()

    def _set_attrs(self) -> None:
        import copy

        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


def _notices_possible() -> bool:
    """True when the launcher sends host-update notices (commsched-run --host-discovery-script)."""
    return bool(os.environ.get(NOTICE_VARIABLE))


def _read_notice(state: State) -> None:
    """Queues the launcher's latest host-update notice, if it is newer than the last one acted on."""
    path = os.environ.get(NOTICE_VARIABLE)
    if not path:
        return
    try:
        with open(path) as handle:
            timestamp, removed = handle.read().split()
    except (OSError, ValueError):
        return  # no notice yet (the file is replaced whole, never half-written)
    if float(timestamp) > state._last_updated_timestamp:
        state.on_hosts_updated(float(timestamp), removed == "1")


_Membership = generation.Membership


_membership = _Membership()


def start_first_generation(settings: dict[str, Any]) -> None:
    """init() of a rank under commsched-run --min-np: checks in with the membership service, then
    starts; a rank lost before or while the ranks start makes the others re-form, not fail."""
    if settings or not _membership.started:  # a bare init() after a failure keeps the first settings
        _membership.settings = dict(settings)
    if _membership.started:
        # Stopped since (a rank lost before run() took over, or a shutdown()): this generation is
        # over for every rank, so all of them ask for the next one.
        reform()
        return
    generation.start(_membership, None)


def _check_launcher() -> bool:
    """True when the launcher re-forms the ranks after a failure; otherwise says why not, once."""
    if _membership.elastic:
        return True
    launcher = detect().launcher
    if torchrun.active():
        why = torchrun.unsupported(commsched._state.transport)
        if not why:
            if not torchrun.job().prefix:  # the core did not record it as it started (torchrun.record_group)
                torchrun.start(functools.partial(commsched.broadcast_object, name="commsched.elastic.group"))
            torchrun.refuse_restarted()
            return True
    elif launcher == "mpiexec":
        why = "MPI keeps the ranks it started (fixed membership)"
    elif launcher == "single":
        return False  # one rank: nothing to lose
    else:
        why = "this launcher does not re-form the ranks"
    print(
        f"commsched.elastic.run: {why}, so a failed rank ends the job; launch with "
        "`commsched-run -n N --min-np MIN --max-np MAX` or `torchrun --nnodes MIN:MAX --rdzv-backend c10d` "
        "for elastic training",
        file=sys.stderr,
        flush=True,
    )
    return False


def reform() -> None:
    """Shuts commsched down and starts it again at the membership the launcher's service hands out.

    Raises MembershipError when the job cannot go on (fewer ranks left than --min-np).
    """
    transport = commsched._state.transport  # the failed generation's: the next one uses the same
    commsched.shutdown()  # the core stopped on the failure already: this returns at once
    _forget_torch_groups()
    if _membership.elastic:
        generation.adopt(
            _membership, request(_membership.address, _membership.member, _membership.generation)
        )
        generation.start(_membership, transport)
    else:
        _reform_under_torchrun(transport)
    _restart_names()


def _reform_under_torchrun(transport: str) -> None:
    """The new generation from torchrun's rendezvous store; a rank lost while it starts makes the
    others agree on the next one at once, as commsched-run's generations do (generation.start)."""
    while True:
        assignment = torchrun.request(_membership.failed_rank)
        os.environ.update(RANK=str(assignment.rank), WORLD_SIZE=str(assignment.size))
        _membership.generation = assignment.generation
        log.info(
            "commsched.elastic: generation %d, rank %d of %d",
            assignment.generation,
            assignment.rank,
            assignment.size,
        )
        try:
            torchrun.join(assignment, _rendezvous_timeout(), transport)
            commsched.init()
        except (MembershipError, generation.settings_module().SettingError):
            raise
        except Exception as error:  # a rank lost during the rendezvous: the survivors re-form again
            if not generation.undo_failed_start(_membership, error):
                raise
            _membership.failed_rank = None  # numbered in the generation that never started
            continue
        _membership.failed_starts = 0
        return


def _restart_names() -> None:
    """Numbers unnamed collectives from 0 again, as a worker that just joined does: the names of the
    state sync must match on every rank of the new generation."""
    import itertools

    for module, counter in (
        ("commsched.torch.functions", "_calls"),
        ("commsched.torch.collectives", "_unnamed"),
    ):
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, counter):
            setattr(loaded, counter, itertools.count())


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wraps `func(state, ...)`: on a rank failure, restore, `reset()` (re-form), sync and call it again."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        from commsched.elastic import torchrun_resume

        try:
            return attempts(state, *args, **kwargs)
        except torchrun_resume.Stopping:  # torchrun restarts the workers: the commit outlives them
            torchrun_resume.keep_and_exit(state)
        finally:
            torchrun_resume.unwatch()

    def attempts(state: State, *args: Any, **kwargs: Any) -> Any:
        # A generation that stopped before run() took over (a rank lost since init()) re-forms below,
        # and the state's objects (a sharded optimizer's rank count) are reset to the new one.
        lost_before = not commsched.is_initialized() and _started_here()
        if not commsched.is_initialized() and not lost_before:
            if commsched._state.initialized_here():
                # Stopped on a lost rank that no membership service can re-form without: say so,
                # rather than start again and wait for that rank.
                from commsched import _core

                _core.raise_if_stopped("commsched.elastic.run()")
            commsched.init()
        if not lost_before and not _check_launcher():
            state.sync()
            return func(state, *args, **kwargs)
        resuming = torchrun.active() and not _membership.elastic
        if resuming:
            from commsched.elastic import torchrun_resume

            if lost_before:
                torchrun.refuse_restarted()
            torchrun_resume.watch(state)
        skip_sync = False
        reforming = lost_before
        while True:
            try:
                # Inside the try: a rank lost while re-forming, resuming or synchronising fails
                # this generation too, and the survivors re-form again.
                if reforming:
                    reset()
                    state.on_reset()
                    reforming = False
                if resuming:  # the commit kept across torchrun's restart, if any (once it agreed)
                    torchrun_resume.resume(state)
                    resuming = False
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except (HorovodInternalError, commsched.RankFailure) as error:
                log.warning("commsched.elastic: %s; restoring the last commit and re-forming", error)
                # Only a lost connection names a dead rank; a rank that stopped on its own is alive.
                lost = "lost contact" in str(error)
                _membership.failed_rank = getattr(error, "rank", None) if lost else None
                state.restore()
                skip_sync, reforming = False, True
            except HostsUpdatedInterrupt as interrupt:
                _membership.failed_rank = None
                skip_sync, reforming = interrupt.skip_sync, True

    return wrapper


def _started_here() -> bool:
    """True when this process's first generation started under a membership service that can re-form
    it: commsched-run --min-np, or torchrun's store once the core recorded its worker group."""
    if _membership.elastic:
        return _membership.started
    return torchrun.active() and bool(torchrun.job().prefix) and commsched._state.initialized_here()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: runs `func(state, ...)` elastically, re-forming the ranks when one fails (Horovod's API)."""
    return run_fn(func, reform)
