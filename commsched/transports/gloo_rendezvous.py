"""The first rendezvous of a Gloo job launched with MASTER_ADDR/MASTER_PORT (torchrun, or by hand).

torch's default wait there is 30 minutes: a worker that died before init() (killed, out of memory, a
failed import) would hold every other one that long. commsched waits at most the larger stall limit
(COMMSCHED_STALL_TIMEOUT, COMMSCHED_STALL_SHUTDOWN), as gRPC's first meeting does, and then names
the ranks that never arrived where torchrun's store can tell: each worker marks its arrival there
before it joins.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from commsched.error_text import first_line
from commsched.launch import LaunchInfo

_MARK_TIMEOUT = datetime.timedelta(seconds=5)


def first_wait(settings: Any) -> datetime.timedelta:
    """The longest the first rendezvous waits: the larger stall limit."""
    if settings is None:
        from commsched.config import resolve

        settings = resolve({})
    return datetime.timedelta(seconds=max(settings.stall_timeout, settings.stall_shutdown))


def _arrivals(launch: LaunchInfo) -> tuple[Any, str] | None:
    """torchrun's agent store (it exists before any worker starts) and this group's arrival keys'
    prefix; None without an agent store, where rank 0 would host the only store there is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            launch.master_addr, int(launch.master_port), is_master=False, timeout=_MARK_TIMEOUT
        )
    except (RuntimeError, ValueError):
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return store, f"commsched.start.{run_id}.{restarts}.{launch.size}"


def _missing(arrivals: tuple[Any, str] | None, size: int) -> list[int]:
    """The ranks with no arrival mark ([] when unknown)."""
    if arrivals is None:
        return []
    store, prefix = arrivals
    try:
        return [rank for rank in range(size) if not store.check([f"{prefix}/{rank}"])]
    except (RuntimeError, OSError):
        return []


def init_default_group(launch: LaunchInfo, settings: Any) -> None:
    """torch.distributed's default Gloo group from the launcher's variables, waiting at most the
    larger stall limit for the other ranks; a clear error naming the ranks missing after that."""
    import torch.distributed as dist

    wait = first_wait(settings)
    arrivals = _arrivals(launch)
    if arrivals is not None:
        try:
            arrivals[0].set(f"{arrivals[1]}/{launch.rank}", str(os.getpid()))
        except (RuntimeError, OSError):
            arrivals = None
    try:
        dist.init_process_group("gloo", rank=launch.rank, world_size=launch.size, timeout=wait)
    except RuntimeError as error:
        missing = [rank for rank in _missing(arrivals, launch.size) if rank != launch.rank]
        first = first_line(error)
        if missing:
            from commsched.elastic.membership import ranks_text

            who = f"{ranks_text(missing)} never arrived (did it fail before commsched.init()? its launcher's output says)"
        else:
            who = "did every rank start and call commsched.init()?"
        raise RuntimeError(
            f"COMMSCHED_TRANSPORT=gloo: the {launch.size} ranks did not all meet at "
            f"{launch.master_addr}:{launch.master_port} within {wait.total_seconds():g}s ({first}): {who}. "
            "The wait is the larger stall limit, COMMSCHED_STALL_TIMEOUT or COMMSCHED_STALL_SHUTDOWN"
        ) from None
