"""Transport selection: which transport a runtime uses, and building it."""

from __future__ import annotations

import logging
from typing import Any

from commsched.launch import LaunchInfo

log = logging.getLogger("commsched")


def choose(requested: str, launch: LaunchInfo, comm: Any, process_group: Any) -> str:
    """Resolves COMMSCHED_TRANSPORT=auto into a concrete transport and checks explicit choices."""
    if comm is not None and process_group is not None:
        raise ValueError("commsched.init() takes comm= (MPI) or process_group= (torch.distributed), not both")
    if requested == "auto":
        if comm is not None:
            chosen = "mpi"
        elif process_group is not None:
            chosen = "gloo"
        elif launch.launcher == "mpiexec" and launch.size != 1:
            chosen = "mpi"
        elif launch.launcher == "torchrun" and launch.size > 1:
            chosen = "gloo"
        else:
            chosen = "loopback"
        log.info("COMMSCHED_TRANSPORT=auto chose %s (launcher: %s)", chosen, launch.launcher)
        return chosen
    if requested == "loopback" and launch.size > 1:
        raise ValueError(
            f"COMMSCHED_TRANSPORT=loopback runs one rank, but the launcher started {launch.size}; "
            "use mpi (under mpiexec) or gloo (under torchrun)"
        )
    if requested == "mpi" and launch.launcher == "torchrun" and comm is None:
        raise ValueError(
            "COMMSCHED_TRANSPORT=mpi needs ranks started by mpiexec, but this process was started by torchrun "
            "(RANK/WORLD_SIZE); use COMMSCHED_TRANSPORT=gloo or launch with mpiexec"
        )
    return requested


def build(kind: str, launch: LaunchInfo, comm: Any, process_group: Any) -> tuple[str, Any]:
    """Returns the (transport kind, argument) pair that commsched._core.start() takes."""
    if kind == "loopback":
        return "loopback", None
    if kind == "mpi":
        from commsched.transports.mpi import factory_and_handle

        return "native", factory_and_handle(comm)
    if kind == "gloo":
        from commsched.transports.gloo import GlooTransport

        return "python", GlooTransport(launch, process_group)
    raise ValueError(f"unknown transport {kind!r}")
