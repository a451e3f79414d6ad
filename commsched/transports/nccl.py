"""NCCL transport for CUDA buffers, driven through the core's trampoline.

Agreement reports go over a host transport (Gloo, gRPC or MPI, whichever the launch allows);
data goes through NCCL on commsched's own CUDA stream (commsched._nccl). NCCL and the CUDA
runtime are found at run time: COMMSCHED_NCCL_LIBRARY / COMMSCHED_CUDART_LIBRARY, then pip's
nvidia-nccl-cu* / nvidia-cuda-runtime-cu* packages, then the system's libraries.

Not yet verified on a GPU (no GPU was available while it was written); see csrc/transport/nccl/README.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from commsched.buffers import BufferView
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


class NcclTransport:
    """Agreement over a host transport, data over NCCL on commsched's own stream.

    Device tensors are never fused (the core's fusion buffer is host memory, and NCCL needs device
    memory), so init() runs it with COMMSCHED_FUSION_BYTES=0; op="average" runs as ncclAvg.
    """

    name = "nccl"
    host_memory = False  # the core must not read the tensors itself (no payloads in reports)
    poll_interval_us = 50  # test() is one cudaEventQuery: cheap, but keep the GIL mostly free

    def __init__(self, control: Any, api: Any, device: int) -> None:
        from commsched import _nccl

        self.rank, self.size = control.rank, control.size
        self.device = device
        self._control = control
        # The unique id travels over the core's bootstrap: the host transport's exchange.
        mine = _nccl.unique_id(api) if self.rank == 0 else b""
        unique_id = control.exchange(mine, 300.0)[0]
        self._comm = _nccl.Communicator(api, unique_id, self.rank, self.size, device)

    @classmethod
    def from_launch(
        cls, launch: LaunchInfo, comm: Any, process_group: Any, settings: Any, device: int | None = None
    ) -> NcclTransport:
        """Builds the host transport the launch allows (MPI under mpiexec, else Gloo or gRPC) and NCCL on it.

        `device` is the CUDA device of the tensors (default: the local rank).
        """
        api = load_api()
        from commsched import _nccl

        if _nccl.device_count(api) == 0:
            raise RuntimeError("COMMSCHED_TRANSPORT=nccl: NCCL loaded, but CUDA sees no GPU on this host")
        from commsched import transports

        if launch.size == 1 and comm is None and process_group is None:
            control: Any = _SingleControl()
        elif launch.launcher == "mpiexec" or comm is not None:
            control = _MpiControl(comm)
        elif process_group is not None or importlib.util.find_spec("torch") is not None:
            control = transports.build("gloo", launch, comm, process_group, settings)[1]
        else:
            control = transports.build("grpc", launch, comm, process_group, settings)[1]
        device = launch.local_rank if device is None or device < 0 else device
        log.info(
            "nccl transport: agreement over %s, NCCL from %s on cuda:%d",
            control.name,
            library_candidates()[0][0],
            device,
        )
        return cls(control, api, device)

    def submitted(self, view: BufferView, name: str, op: str) -> None:
        """Called on the submitting thread before the core sees the tensor: checks the device and records
        the ordering event on the caller's stream, so the collective runs after what produced the bytes."""
        if view.device is not None and view.device not in (-1, self.device):
            raise ValueError(
                f"tensor '{name}' is on cuda:{view.device}, but commsched's NCCL communicator is on "
                f"cuda:{self.device}; move it there, or start one process per GPU with "
                "torch.cuda.set_device(local_rank) and commsched.init(device='cuda') on each"
            )
        try:
            self._comm.submitted(view.address, view.nbytes, op == "average", view.stream)
        except ValueError as error:
            raise ValueError(f"tensor '{name}': {error}") from None

    def forget(self, view: BufferView) -> None:
        """Drops what submitted() recorded, for a tensor the core refused."""
        self._comm.forget(view.address)

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Agreement reports go over the host transport."""
        return list(self._control.exchange(report, timeout_s))

    def start(self, address: int, count: int, dtype: str, kind: str, root: int) -> Any:
        """Queues an NCCL allreduce or broadcast on commsched's stream, after the submit-time event."""
        if kind == "allreduce":
            return self._comm.allreduce(address, count, dtype)
        return self._comm.broadcast(address, count, dtype, root)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """The core's fusion copy: cudaMemcpyAsync on commsched's stream, complete on return."""
        self._comm.copy(dst, src, nbytes)

    def scale(self, address: int, count: int, dtype: str, divisor: float) -> None:
        """The core's average step: NCCL already averaged (ncclAvg), so this only checks that it did."""
        self._comm.scale(address, count, dtype, divisor)


class _SingleControl:
    """A lone rank agrees with itself."""

    name, rank, size = "single", 0, 1

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Returns this rank's own report."""
        return [report]


class _MpiControl:
    """Agreement over mpi4py with raw byte buffers (lengths, then Allgatherv), never pickle."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Allgathers one byte string per rank (MPI has no timeout; a dead rank ends the job)."""
        import numpy as np

        lengths = np.zeros(self.size, np.int64)
        self._comm.Allgather(np.array([len(report)], np.int64), lengths)
        gathered = np.empty(int(lengths.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        mine = np.frombuffer(report, np.uint8) if report else np.empty(0, np.uint8)
        self._comm.Allgatherv(mine, [gathered, lengths, offsets, self._mpi.BYTE])
        return [gathered[o : o + n].tobytes() for o, n in zip(offsets, lengths)]
