"""Transport selection: which transport a runtime uses, and building it."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Any

from commsched.launch import LaunchInfo

log = logging.getLogger("commsched")


def _torch_present() -> bool:
    return importlib.util.find_spec("torch") is not None


def choose(
    requested: str, launch: LaunchInfo, comm: Any, process_group: Any, cuda_buffers: bool = False
) -> str:
    """Resolves COMMSCHED_TRANSPORT=auto into a concrete transport and checks explicit choices.

    auto: NCCL for CUDA buffers, MPI under mpiexec, otherwise Gloo if PyTorch is installed,
    otherwise gRPC; a lone rank uses loopback. init() sets `cuda_buffers` for device="cuda" or
    when the first submitted tensor is on a GPU.
    """
    if comm is not None and process_group is not None:
        raise ValueError("commsched.init() takes comm= (MPI) or process_group= (torch.distributed), not both")
    if requested == "auto":
        if cuda_buffers:
            chosen, why = "nccl", "the buffers live on a GPU"
        elif comm is not None:
            chosen, why = "mpi", "comm= was given"
        elif process_group is not None:
            chosen, why = "gloo", "process_group= was given"
        elif launch.launcher == "mpiexec" and launch.size != 1:
            chosen, why = "mpi", "launched by mpiexec"
        elif launch.launcher == "torchrun" and launch.size > 1:
            torch = _torch_present()
            chosen = "gloo" if torch else "grpc"
            why = "RANK/WORLD_SIZE set and PyTorch " + ("installed" if torch else "not installed")
        else:
            chosen, why = "loopback", "a single rank"
        log.info("COMMSCHED_TRANSPORT=auto chose %s (%s; launcher: %s)", chosen, why, launch.launcher)
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


def build(
    kind: str,
    launch: LaunchInfo,
    comm: Any,
    process_group: Any,
    settings: Any = None,
    device: int | None = None,
    device_memory: bool = False,
) -> tuple[str, Any]:
    """Returns the (transport kind, argument) pair that commsched._core.start() takes.

    `device`: the CUDA device for NCCL or CUDA-aware MPI (None or -1: the local rank).
    `device_memory`: the tensors live on a GPU (init(device="cuda")); MPI then needs CUDA support.
    """
    if kind == "loopback":
        return "loopback", None
    if kind == "mpi":
        from commsched.transports.mpi import cuda_aware_build, factory_and_handle

        if device_memory:
            return cuda_aware_build(comm, launch.local_rank if device is None or device < 0 else device)
        return "native", factory_and_handle(comm)
    if kind == "gloo":
        from commsched.transports import gloo

        return gloo.build(launch, process_group, settings)
    if kind == "grpc":
        return "python", _grpc(launch, settings)
    if kind == "nccl":
        from commsched.transports import nccl

        return nccl.build(launch, comm, process_group, settings, device)
    raise ValueError(f"unknown transport {kind!r}")


def _grpc(launch: LaunchInfo, settings: Any) -> Any:
    """Builds the gRPC transport from the launcher's variables and the settings."""
    try:
        from commsched.transports.grpc_transport import GrpcTransport
    except ImportError as error:
        raise RuntimeError(
            f"COMMSCHED_TRANSPORT=grpc needs grpcio and protobuf ({error}): pip install grpcio protobuf"
        ) from None
    # `commsched.config` the attribute is the config() function; the module is reached by import.
    settings_module = importlib.import_module("commsched.config")
    from commsched.transports.grpc_net import endpoint_from, fallback_token, parse_peers

    if settings is None:
        settings = settings_module.resolve({})
    if launch.size < 1:
        raise ValueError("COMMSCHED_TRANSPORT=grpc needs the number of ranks: set WORLD_SIZE")
    peers = parse_peers(os.environ.get("COMMSCHED_GRPC_PEERS", ""))
    if not peers:  # under torchrun without the agent's store: through the store rank 0 hosts
        import datetime

        from commsched.elastic import torchrun

        wait = datetime.timedelta(seconds=max(settings.stall_timeout, settings.stall_shutdown))
        peers = torchrun.first_grpc_peers(launch.rank, launch.size, wait)
    endpoint = endpoint_from(
        launch.rank,
        launch.size,
        launch.master_addr or os.environ.get("MASTER_ADDR", ""),
        launch.master_port or int(os.environ.get("MASTER_PORT", "0") or 0),
        peers,
        settings.grpc_bind,
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )
    token = settings_module.job_token()
    if not token:
        token = fallback_token(
            endpoint.master or ",".join(peers), launch.size, os.environ.get("TORCHELASTIC_RUN_ID", "")
        )
        if launch.size > 1:
            log.warning(
                "COMMSCHED_JOB_TOKEN is not set: gRPC peers are checked against a token derived from the "
                "rendezvous address, which keeps other jobs out but is no secret; launch with "
                "`commsched-run` (python -m commsched.run) or set COMMSCHED_JOB_TOKEN on every rank"
            )
    from commsched.transports.grpc_tls import TlsFiles

    # The rendezvous waits as long as a stalled tensor may (ranks start at different times); the data
    # path's own timeout stays the stall warning's.
    return GrpcTransport(
        endpoint,
        token,
        timeout_s=settings.stall_timeout,
        tls=TlsFiles.from_settings(settings),
        join_timeout_s=max(settings.stall_timeout, settings.stall_shutdown),
        join_limit_setting=(
            "COMMSCHED_STALL_SHUTDOWN"
            if settings.stall_shutdown >= settings.stall_timeout
            else "COMMSCHED_STALL_TIMEOUT"
        )
        + ", the larger stall limit",
        bulk_bytes=settings.grpc_bulk_bytes,
    )
