"""The native MPI transport's Python side: finds mpi4py and hands the communicator over."""

from __future__ import annotations

from typing import Any


def factory_and_handle(comm: Any) -> tuple[Any, int]:
    """The factory capsule of commsched._mpi and the communicator handle for it."""
    try:
        from commsched import _mpi
    except ImportError as error:
        raise RuntimeError(
            "COMMSCHED_TRANSPORT=mpi: commsched was built without MPI (" + str(error) + "); install MPI "
            "(pip install mpich mpi4py) and reinstall commsched, or use COMMSCHED_TRANSPORT=gloo"
        ) from None
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError("COMMSCHED_TRANSPORT=mpi needs mpi4py: pip install mpi4py") from None
    _ensure_initialized(MPI)
    communicator = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(communicator, MPI.Comm):
        raise TypeError(f"comm= must be an mpi4py communicator, not {type(communicator).__name__}")
    return _mpi.transport_factory(), int(MPI._handleof(communicator))


def _ensure_initialized(MPI: Any) -> None:
    """Starts MPI when the program told mpi4py not to (mpi4py.rc.initialize = False), as Horovod does."""
    if MPI.Is_finalized():
        raise RuntimeError(
            "COMMSCHED_TRANSPORT=mpi: MPI was already finalized in this process (MPI.Finalize() was called); "
            "MPI cannot start again, so call commsched.init() before finalizing MPI"
        )
    if not MPI.Is_initialized():
        # The core's own thread calls MPI, hence MPI_THREAD_MULTIPLE; mpi4py finalizes it at exit.
        MPI.Init_thread(MPI.THREAD_MULTIPLE)


def cuda_aware_build(comm: Any, device: int) -> tuple[str, Any]:
    """MPI on GPU memory: (kind, argument) for commsched._core.start(), if the MPI library is CUDA-aware."""
    mpi_factory = factory_and_handle(comm)
    from commsched import _mpi

    if not _mpi.cuda_aware():
        raise RuntimeError(
            "init(device='cuda') with COMMSCHED_TRANSPORT=mpi needs a CUDA-aware MPI, but this MPI library does not "
            "report CUDA support (MPIX_Query_cuda_support); use COMMSCHED_TRANSPORT=nccl for GPU tensors, or an MPI "
            f"built with CUDA support (linked: {_mpi.library_version().splitlines()[0].strip()})"
        )
    from commsched.transports.nccl import library_candidates

    maker = _mpi.CudaAwareMaker(library_candidates()[1], device)
    return "device", (maker.capsule(), "native", mpi_factory, maker)


def local_rank_and_size(comm: Any) -> tuple[int, int]:
    """This process's rank among the processes of its host, and their number (a collective call)."""
    from mpi4py import MPI

    communicator = MPI.COMM_WORLD if comm is None else comm
    shared = communicator.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return shared.Get_rank(), shared.Get_size()
    finally:
        shared.Free()
