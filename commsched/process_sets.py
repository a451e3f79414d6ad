"""Horovod's process sets: collectives over a subset of the ranks.

Every rank calls add_process_set() and remove_process_set() in the same order with the same
ranks (as in Horovod); ranks outside a set never call its collectives, and a collective on one
set does not wait for the ranks outside it. The core agrees every collective in one order and
runs a set's on a communicator of its members only. A collective is told its set through
``process_set=``; the functions here carry it to the core for the duration of that call.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import commsched as _api
from commsched import _core
from commsched import submission as _submission


class ProcessSet:
    """A set of ranks that runs collectives among themselves (Horovod's hvd.ProcessSet).

    `ranks_or_comm`: the global ranks in the set, or an mpi4py communicator, whose members are
    the set. As in Horovod, a communicator's ranks are known once init(process_sets=...) or
    add_process_set() registered it; the set is usable from then on.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        self.ranks: list[int] | None = None
        if _is_communicator(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
        elif ranks_or_comm is not None:
            self.ranks = _ranks_of(ranks_or_comm)

    def size(self) -> int:
        """The number of ranks in the set."""
        return len(self._registered_ranks())

    def rank(self) -> int:
        """This process's position within the set; -1 when it is not a member (as Horovod)."""
        ranks = self._registered_ranks()
        return ranks.index(_api.rank()) if _api.rank() in ranks else -1

    def included(self) -> bool:
        """True when this process is a member."""
        return _api.rank() in self._registered_ranks()

    def _registered_ranks(self) -> list[int]:
        if self.process_set_id == 0:
            return list(range(_api.size()))
        if self.process_set_id is None or self.ranks is None:
            raise ValueError(
                f"{self!r} is not registered; call add_process_set() with it on every rank first"
            )
        return self.ranks

    def __repr__(self) -> str:
        # Horovod's spelling: scripts and Horovod's own tests print and compare it.
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"
        )


def _is_communicator(value: Any) -> bool:
    return hasattr(value, "Get_group") and hasattr(value, "Allgather")


def _communicator_ranks(comm: Any) -> list[int]:
    """The members of mpi4py communicator `comm` as ranks of the job's global communicator."""
    if not _api.is_initialized() or not _api.mpi_enabled():
        raise NotImplementedError(
            "a ProcessSet built from an MPI communicator needs commsched running on MPI (launched with "
            "mpiexec, as Horovod requires); build the set from a list of ranks instead"
        )
    from mpi4py import MPI

    outer = global_process_set.mpi_comm or MPI.COMM_WORLD
    group, whole = comm.Get_group(), outer.Get_group()
    translated = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), whole)
    if any(rank == MPI.UNDEFINED for rank in translated):
        raise ValueError(
            f"the communicator of a ProcessSet has members outside the job's global communicator ({outer}); "
            "build process sets from sub-communicators of the communicator given to init()"
        )
    return sorted(int(rank) for rank in translated)


def _ranks_of(ranks: Any) -> list[int]:
    try:
        values = [_submission._integer(rank, "a process set rank", "a rank number") for rank in ranks]
    except TypeError:
        raise TypeError(f"a process set takes a list of ranks (or a ProcessSet), not {ranks!r}") from None
    if len(set(values)) != len(values):
        raise ValueError(f"process set ranks {values} name a rank twice; give each rank once")
    return sorted(values)


class _GlobalProcessSet(ProcessSet):
    """The set of every rank (id 0): its ranks are the running job's, None before init() (as Horovod's)."""

    def __init__(self) -> None:
        self.process_set_id = 0
        self.mpi_comm: Any = None  # the communicator given to init(comm=...), as Horovod's

    @property  # type: ignore[override]
    def ranks(self) -> list[int] | None:
        """Every rank of the job while commsched runs (the size may change in an elastic job)."""
        return list(range(_api.size())) if _api.is_initialized() else None


global_process_set: ProcessSet = _GlobalProcessSet()
_registered: dict[int, ProcessSet] = {}
_unnamed: dict[int, Iterator[int]] = {}
_local = threading.local()


def _reset() -> None:
    """Forgets every set but the global one (commsched.init() starts afresh)."""
    for process_set in _registered.values():
        process_set.process_set_id = None
    _registered.clear()
    _unnamed.clear()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set on every rank (all call it, in the same order) and returns it."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is registered already; remove it first, or make a new ProcessSet")
    if process_set.ranks is None and process_set.mpi_comm is not None:
        process_set.ranks = _communicator_ranks(process_set.mpi_comm)
    if process_set.ranks is None:
        raise ValueError("the global process set exists from init(); add_process_set takes a list of ranks")
    size = _api.size()
    ranks = process_set.ranks
    if not ranks or ranks[0] < 0 or ranks[-1] >= size:
        raise ValueError(f"process set ranks {ranks} must be between 0 and {size - 1}, at least one of them")
    if ranks == list(range(size)):
        raise ValueError(
            f"process set ranks {ranks} are every rank: that is hvd.global_process_set, which exists from init()"
        )
    for other in _registered.values():
        if other.ranks == ranks:
            raise ValueError(f"a process set with ranks {ranks} exists already: {other!r}")
    import numpy as np

    set_id = next(i for i in itertools.count(1) if i not in _registered)  # a freed id is reused, as Horovod's
    # Every rank must add the same ranks under the same id: checked over every rank before any
    # communicator is built, so a mismatch fails on every rank alike instead of hanging.
    mine = np.array([set_id, *ranks], dtype=np.int64)
    handle = _api.allgather_async(mine, name=f"process_set.{set_id}.add")
    gathered = handle.wait()
    rows, offset = [], 0
    for length in handle.layout_rows():
        rows.append(gathered[offset : offset + length].tolist())
        offset += length
    if any(row != rows[0] for row in rows):
        described = "; ".join(f"rank {r}: id {row[0]} ranks {row[1:]}" for r, row in enumerate(rows))
        raise ValueError(
            f"add_process_set was called with different process sets across ranks ({described}); every rank "
            "must call add_process_set with the same ranks in the same order"
        )
    _core.add_process_set(set_id, ranks)
    process_set.process_set_id = set_id
    _registered[set_id] = process_set
    # No member names the set before every rank registered it with its agreement.
    _api.barrier(name=f"process_set.{set_id}.ready")
    return process_set


def register_at_init(process_sets: Sequence[ProcessSet]) -> None:
    """Registers hvd.init(process_sets=...)'s sets as Horovod does, on every rank in the same order.

    Sets built from MPI communicators come first: every rank's communicator is gathered (one
    allgather), and each distinct set of ranks is registered in sorted order, so ranks passing the
    halves of a split communicator register both halves. Sets of listed ranks follow, in list
    order. A set whose ranks are registered already (an earlier init() in this job) takes over that
    id; a set that repeats another in the list, or the global set, is left unregistered and fails
    the call with ValueError after the others are registered, as in Horovod (commsched keeps running).
    """
    for process_set in process_sets:
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"init(process_sets=...) takes hvd.ProcessSet objects, not {process_set!r}")
    from_comms = [s for s in process_sets if s.ranks is None and s.mpi_comm is not None]
    own_ranks = {id(s): _communicator_ranks(s.mpi_comm) for s in from_comms}
    known = {tuple(ranks): set_id for set_id, ranks in get_process_sets().items()}
    wanted = _gathered_communicator_sets([own_ranks[id(s)] for s in from_comms])
    wanted += [tuple(s.ranks) for s in process_sets if s.ranks is not None]
    for ranks in wanted:
        if ranks not in known:
            known[ranks] = add_process_set(list(ranks)).process_set_id  # type: ignore[assignment]
    taken = {0}
    duplicates = []
    for index, process_set in enumerate(process_sets):
        if id(process_set) in own_ranks:
            process_set.ranks = own_ranks[id(process_set)]
        set_id = known[tuple(process_set.ranks or ())]
        if set_id in taken:
            if _registered.get(process_set.process_set_id or 0) is not process_set:
                process_set.process_set_id = None
            duplicates.append(f"entry number {index} ({process_set.ranks})")
            continue
        if _registered[set_id] is not process_set:
            _registered[set_id].process_set_id = None  # the older object no longer names the set
            process_set.process_set_id = set_id
            _registered[set_id] = process_set
        taken.add(set_id)
    if duplicates:
        raise ValueError(
            f"init(process_sets=...): {', '.join(duplicates)} repeats the ranks of an earlier entry or of the "
            "global set; give each set of ranks once (hvd.global_process_set always exists)"
        )


def _gathered_communicator_sets(mine: list[list[int]]) -> list[tuple[int, ...]]:
    """Every rank's communicator sets, gathered in one allgather: the distinct ones, sorted, per position."""
    import numpy as np

    flat = [len(mine)] + [value for ranks in mine for value in (len(ranks), *ranks)]
    handle = _api.allgather_async(np.array(flat, dtype=np.int64), name="process_set.init.communicators")
    gathered = handle.wait().tolist()
    per_rank, offset = [], 0
    for length in handle.layout_rows():
        row, offset = gathered[offset : offset + length], offset + length
        sets, at = [], 1
        for _ in range(row[0]):
            sets.append(tuple(row[at + 1 : at + 1 + row[at]]))
            at += 1 + row[at]
        per_rank.append(sets)
    counts = [len(sets) for sets in per_rank]
    if len(set(counts)) != 1:
        raise ValueError(
            f"init(process_sets=...) was given different numbers of sets built from MPI communicators by rank "
            f"({counts}); every rank must pass one communicator per position (as Horovod requires)"
        )
    every: list[tuple[int, ...]] = []
    for position in range(counts[0]):
        every += sorted({sets[position] for sets in per_rank})
    return every


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set on every rank (all call it); False for the global set or an unknown one."""
    set_id = process_set.process_set_id
    if not set_id or _registered.get(set_id) is not process_set:
        return False
    _api.barrier(name=f"process_set.{set_id}.remove")  # every rank is done with the set
    _core.remove_process_set(set_id)
    del _registered[set_id]
    _unnamed.pop(set_id, None)
    process_set.process_set_id = None
    return True


def get_process_sets() -> dict[int, list[int]]:
    """Every registered set's id and ranks, the global set (id 0) included, as Horovod's get_process_sets()."""
    return {0: list(range(_api.size())), **{i: list(s.ranks or []) for i, s in sorted(_registered.items())}}


def is_registered(process_set: Any) -> bool:
    """True when `process_set` is the set add_process_set() registered under its id."""
    set_id = getattr(process_set, "process_set_id", None)
    return set_id is not None and _registered.get(set_id) is process_set


def resolve(process_set: Any) -> int:
    """The id of `process_set` (None: the global set); raises ValueError unless this rank is a member."""
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet from add_process_set(), not {process_set!r}")
    set_id = process_set.process_set_id
    if set_id == 0:
        return 0
    if set_id is None or _registered.get(set_id) is not process_set:
        raise ValueError(
            f"{process_set!r} is not registered; call add_process_set() with it on every rank first"
        )
    if _api.rank() not in (process_set.ranks or []):
        raise ValueError(not_a_member(process_set))
    return set_id


def not_a_member(process_set: ProcessSet) -> str:
    """The refusal of a collective on a set this rank is not in, worded as the core words it."""
    return (
        f"rank {_api.rank()} is not a member of ProcessSet(process_set_id={process_set.process_set_id}, "
        f"ranks={process_set.ranks}); only its ranks may call collectives on it"
    )


@contextmanager
def scope(process_set: Any) -> Iterator[int]:
    """Runs the collectives called inside on `process_set` (this thread only); yields its id."""
    set_id = resolve(process_set)
    previous = getattr(_local, "set_id", 0)
    _local.set_id = set_id
    try:
        yield set_id
    finally:
        _local.set_id = previous


def current() -> int:
    """The id of the process set this thread's collective runs on (0: every rank)."""
    return getattr(_local, "set_id", 0)


def qualified(name: str) -> str:
    """The name the core agrees `name` under: each set has its own names, as in Horovod."""
    set_id = current()
    if set_id == 0:
        return name
    prefix = f"process_set.{set_id}/"
    return name if name.startswith(prefix) else prefix + name


def next_unnamed(global_counter: Iterator[int]) -> int:
    """The number of the next unnamed collective on the current set: ranks outside it do not count it."""
    set_id = current()
    if set_id == 0:
        return next(global_counter)
    return next(_unnamed.setdefault(set_id, itertools.count()))


def ranks() -> list[int]:
    """The global ranks of the current set."""
    set_id = current()
    return list(range(_api.size())) if set_id == 0 else list(_registered[set_id].ranks or [])


def size() -> int:
    """The number of ranks in the current set."""
    return len(ranks())


def position() -> int:
    """This rank's position in the current set."""
    return ranks().index(_api.rank())
