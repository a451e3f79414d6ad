"""NCCL transport for CUDA buffers: a native transport of the core (csrc/transport/nccl).

Launches, event polls and error checks run in C++ on the core's thread; agreement reports and
NCCL's unique id go over a host transport (MPI under mpiexec, otherwise Gloo or gRPC). This module
only finds the libraries and assembles what commsched._core.start() takes. NCCL and the CUDA
runtime are found at run time: COMMSCHED_NCCL_LIBRARY / COMMSCHED_CUDART_LIBRARY, then pip's
nvidia-nccl-cu* / nvidia-cuda-runtime-cu* packages, then the system's libraries.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from commsched.launch import LaunchInfo

log = logging.getLogger("commsched")

_SYSTEM_NCCL = ["libnccl.so.2", "libnccl.so"]
_SYSTEM_CUDART = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]


def _nvidia_package_libraries(package: str, pattern: str) -> list[str]:
    """Shared libraries shipped by pip's nvidia-* wheels (nvidia/<package>/lib/<pattern>)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for root in spec.submodule_search_locations:
        found.extend(sorted(str(p) for p in (Path(root) / package / "lib").glob(pattern)))
    return found


def library_candidates(environ: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(NCCL paths, CUDA runtime paths) in the order they are tried."""
    env = dict(os.environ) if environ is None else environ
    nccl = [env["COMMSCHED_NCCL_LIBRARY"]] if env.get("COMMSCHED_NCCL_LIBRARY") else []
    cudart = [env["COMMSCHED_CUDART_LIBRARY"]] if env.get("COMMSCHED_CUDART_LIBRARY") else []
    nccl += _nvidia_package_libraries("nccl", "libnccl.so*") + _SYSTEM_NCCL
    cudart += _nvidia_package_libraries("cuda_runtime", "libcudart.so*") + _SYSTEM_CUDART
    return nccl, cudart


def load_api() -> Any:
    """Loads NCCL and the CUDA runtime; RuntimeError says what was tried and how to install them."""
    try:
        from commsched import _nccl
    except ImportError as error:
        raise RuntimeError(
            f"commsched was built without its NCCL extension ({error}); reinstall commsched"
        ) from None
    try:
        return _nccl.load(*library_candidates())
    except RuntimeError as error:
        raise RuntimeError(
            f"COMMSCHED_TRANSPORT=nccl: {error}\nInstall NCCL and the CUDA runtime (pip install "
            "nvidia-nccl-cu12 nvidia-cuda-runtime-cu12) or point COMMSCHED_NCCL_LIBRARY and "
            "COMMSCHED_CUDART_LIBRARY at them"
        ) from None


def host_control_kind(launch: LaunchInfo, comm: Any, process_group: Any) -> str:
    """The host transport that carries the agreement next to NCCL, from what the launch allows."""
    if launch.size == 1 and comm is None and process_group is None:
        return "loopback"
    if launch.launcher == "mpiexec" or comm is not None:
        return "mpi"
    if process_group is not None or importlib.util.find_spec("torch") is not None:
        return "gloo"
    return "grpc"


def build(
    launch: LaunchInfo, comm: Any, process_group: Any, settings: Any, device: int | None = None
) -> tuple[str, Any]:
    """The (kind, argument) pair commsched._core.start() takes for NCCL around a host transport.

    `device` is the CUDA device of the tensors (default: the local rank). The argument holds the
    maker object, which must stay alive until the core has started.
    """
    api = load_api()
    from commsched import _nccl, transports

    count = _nccl.device_count(api)
    if count == 0:
        raise RuntimeError("COMMSCHED_TRANSPORT=nccl: NCCL loaded, but CUDA sees no GPU on this host")
    device = launch.local_rank if device is None or device < 0 else device
    if device >= count:
        raise RuntimeError(
            f"COMMSCHED_TRANSPORT=nccl: this rank would use cuda:{device} (its local rank), but CUDA sees "
            f"{count} GPU(s) here; start at most one rank per GPU, or put each rank's tensors on its own "
            "device (torch.cuda.set_device(local_rank))"
        )
    control = host_control_kind(launch, comm, process_group)
    control_kind, control_argument = transports.build(control, launch, comm, process_group, settings)
    log.info(
        "nccl transport: agreement over %s, NCCL %s from %s on cuda:%d",
        control,
        _nccl.version_text(_nccl.version(api)),
        library_candidates()[0][0],
        device,
    )
    maker = _nccl.TransportMaker(api, device)
    return "device", (maker.capsule(), control_kind, control_argument, maker)
