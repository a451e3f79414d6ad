"""Starting commsched for one generation of an elastic job under ``commsched-run --min-np``.

Every rank checks in with the launcher's membership service before the rendezvous. A rank that dies
before it reaches ``init()`` (while it imports, builds its model, or re-forms) then costs the others a
re-forming at once, instead of a rendezvous that waits for it until the stall limits (or Gloo's 30
minutes). A rank lost during the rendezvous or the link probe fails the others' start; they ask for
the next generation and start again, at most ``MAX_FAILED_STARTS`` times in a row.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import commsched
from commsched import start_wait
from commsched.elastic.membership import (
    ADDRESS_VARIABLE,
    GENERATION_VARIABLE,
    ID_VARIABLE,
    Assignment,
    MembershipError,
    check_in,
    request,
)

log = logging.getLogger("commsched")
# Generations in a row that may fail to start before the error is the job's: a start that fails
# for a reason of its own (not a lost rank) would otherwise re-form forever.
MAX_FAILED_STARTS = 3


@dataclass
class Membership:
    """This process's place in an elastic job: the launch's worker id and the generation it is in."""

    address: str = field(default_factory=lambda: os.environ.get(ADDRESS_VARIABLE, ""))
    member: int = field(default_factory=lambda: int(os.environ.get(ID_VARIABLE, "-1") or -1))
    # A worker started to join an existing job is born into a later generation.
    generation: int = field(default_factory=lambda: int(os.environ.get(GENERATION_VARIABLE, "0") or 0))
    failed_starts: int = 0  # generations in a row that failed to start
    failed_rank: int | None = None  # the rank the last failure named, if it named one
    settings: dict[str, Any] = field(default_factory=dict)  # init()'s keyword settings, kept for re-forms
    started: bool = False  # a generation has started in this process

    @property
    def elastic(self) -> bool:
        """True under commsched-run --min-np/--max-np (the launcher's membership service re-forms)."""
        return bool(self.address) and self.member >= 0


def settings_module() -> Any:
    """The commsched.config module (the package's `config` attribute is the config() function)."""
    return importlib.import_module("commsched.config")


def rendezvous_timeout(settings: dict[str, Any] | None = None) -> datetime.timedelta:
    """The longest a generation's rendezvous waits: the larger stall limit."""
    resolved = settings_module().resolve(settings or {})
    return datetime.timedelta(seconds=max(resolved.stall_timeout, resolved.stall_shutdown))


def adopt(membership: Membership, assignment: Assignment) -> None:
    """Makes `assignment` this process's place: the variables the next init() reads."""
    os.environ.update(
        RANK=str(assignment.rank),
        LOCAL_RANK=str(assignment.rank),  # one host: the local rank is the rank
        WORLD_SIZE=str(assignment.size),
        MASTER_PORT=str(assignment.port),
    )
    membership.generation = assignment.generation
    log.info(
        "commsched.elastic: generation %d, rank %d of %d",
        assignment.generation,
        assignment.rank,
        assignment.size,
    )


def start(membership: Membership, transport: str | None) -> None:
    """Starts commsched in this rank's generation, re-forming while ranks are lost before it stands.

    `transport`: the previous generation's (None at the first start: chosen from the settings).
    Raises MembershipError when too few ranks are left, a SettingError for bad settings, and the
    last error once MAX_FAILED_STARTS generations in a row failed to start.
    """
    while True:
        try:
            assignment = check_in(
                membership.address,
                membership.member,
                membership.generation,
                rendezvous_timeout(membership.settings).total_seconds(),
            )
            if assignment is None:  # every member is at the rendezvous
                _rendezvous_and_init(membership, transport)
                membership.failed_starts, membership.started = 0, True
                return
            log.warning(
                "commsched.elastic: a rank of generation %d ended before it started; re-forming",
                membership.generation,
            )
        except (MembershipError, settings_module().SettingError, ValueError):
            raise  # the job cannot go on, or a setting every rank shares is wrong: no re-forming helps
        except Exception as error:  # a rank lost during the rendezvous: the others re-form again
            if not undo_failed_start(membership, error):
                raise
            assignment = request(membership.address, membership.member, membership.generation)
        adopt(membership, assignment)


def undo_failed_start(membership: Membership, error: Exception) -> bool:
    """Counts a generation that failed to start and takes down what of it started, for the next one;
    False (nothing undone: the caller raises) once MAX_FAILED_STARTS generations in a row failed."""
    membership.failed_starts += 1
    if membership.failed_starts > MAX_FAILED_STARTS:
        return False
    log.warning(
        "commsched.elastic: starting generation %d failed (%s); re-forming", membership.generation, error
    )
    commsched.shutdown()
    forget_torch_groups()
    return True


def _rendezvous_and_init(membership: Membership, transport: str | None) -> None:
    """Joins the generation's torch.distributed group (Gloo) and starts commsched, every wait on the
    other ranks bounded by start_wait_s(); then gives the group the stall limits as its timeout."""
    from commsched.launch import detect
    from commsched.transports import choose

    info = detect()
    settings = settings_module().resolve(membership.settings)
    kind = transport or choose(settings.transport, info, None, None)
    limits = rendezvous_timeout(membership.settings)
    with start_wait.starting():
        wait_s = start_wait.start_wait_s()
        bound = limits if wait_s is None else datetime.timedelta(seconds=wait_s)
        if kind == "gloo":
            import torch.distributed as dist

            if not dist.is_initialized():
                # torch's default wait is 30 minutes: a rank lost in the rendezvous would hold the rest.
                dist.init_process_group("gloo", rank=info.rank, world_size=info.size, timeout=bound)
        commsched._init_here(**membership.settings)
    if kind == "gloo":
        _set_group_timeouts(limits)


def _set_group_timeouts(world: datetime.timedelta) -> None:
    """After a start with short waits: the default group's collectives get `world` (the stall
    limits), the groups the transport made get torch's default (torch's private setter; where it is
    missing the groups keep the start's)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None or not dist.is_initialized():
        return
    for group in list(c10d._world.pg_map):
        setter(world if group is dist.group.WORLD else c10d.default_pg_timeout, group)


def forget_torch_groups() -> None:
    """Drops torch.distributed's process groups of the failed generation without destroying them.

    Destroying a Gloo group waits for its collectives, which wait for the lost rank (Gloo's timeout is
    30 minutes): the groups are kept alive, unreferenced, for the life of the process, and
    torch.distributed is left uninitialised so the next generation can rendezvous afresh.
    """
    import sys

    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    from commsched.transports.gloo import keep_forever

    world = c10d._world
    for group in list(world.pg_map):
        keep_forever(group)
    c10d._update_default_pg(None)
    for registry in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
