"""Horovod's basics over the framework-free API, shared by commsched.torch and commsched.tensorflow.

init, ranks, build flags, reduction-op constants and process sets. Each function delegates to
``commsched``; one that this build of commsched lacks raises NotImplementedError naming it,
instead of guessing an answer. Process sets are commsched's own when it has them (the plug-ins
pass a set to the core with each collective); without core support only the global set exists.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import commsched

# Reduction ops, equal to commsched's (strings), so `op == hvd.Average` and op="average" both work.
Average: Any = getattr(commsched, "Average", "average")
Sum: Any = getattr(commsched, "Sum", "sum")
Min: Any = getattr(commsched, "Min", "min")
Max: Any = getattr(commsched, "Max", "max")
Product: Any = getattr(commsched, "Product", "product")
Adasum: Any = "adasum"
_OPS = {str(op).lower(): op for op in (Average, Sum, Min, Max, Product)}


def _core(name: str) -> Callable[..., Any]:
    function = getattr(commsched, name, None)
    if function is None:
        raise NotImplementedError(
            f"commsched.{name} is not available in this build of commsched; update commsched to one with "
            "the Horovod-compatible collectives"
        )
    return function  # type: ignore[no-any-return]


def init(comm: Any = None, process_sets: Any = None, **settings: Any) -> None:
    """Starts commsched (Horovod's hvd.init); a second call while it runs does nothing.

    `comm`: an mpi4py communicator (or a list of ranks of COMM_WORLD, as Horovod takes);
    `process_sets`: process sets to register at start; `settings`: commsched settings.
    """
    if not commsched.is_initialized():
        if isinstance(comm, (list, tuple)):
            from mpi4py import MPI

            group = MPI.COMM_WORLD.Get_group().Incl(list(comm))
            comm = MPI.COMM_WORLD.Create_group(group)
        commsched.init(comm=comm, **settings)
        _start_horovod_timeline()
    # As Horovod's: a second init() while running still binds its sets (to the ids their ranks have).
    if process_sets is not None and process_sets != "dynamic":
        if not _CORE:
            add_process_set(None)  # raises, naming what is missing
        from commsched.process_sets import register_at_init

        register_at_init(list(process_sets))


def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered set's id and ranks, the global set (id 0) included (Horovod's internal name)."""
    return dict(_core("get_process_sets")())


def _start_horovod_timeline() -> None:
    # Horovod's variables, for scripts that set them instead of COMMSCHED_TIMELINE. DYNAMIC is not a
    # file: as in Horovod, the trace starts only when the script calls hvd.start_timeline(path).
    path = os.environ.get("HOROVOD_TIMELINE")
    if path and path != "DYNAMIC" and not os.environ.get("COMMSCHED_TIMELINE"):
        mark_cycles = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0").lower() not in ("", "0", "false")
        start_timeline(path, mark_cycles=mark_cycles)


def shutdown() -> None:
    """Stops commsched on this process."""
    commsched.shutdown()


def is_initialized() -> bool:
    """True from init() to this rank's own shutdown(), as Horovod's (a peer's shutdown leaves it true)."""
    return commsched._state.initialized_here()


def size() -> int:
    """The number of ranks."""
    return commsched.size()


def rank() -> int:
    """This process's rank."""
    return commsched.rank()


def local_rank() -> int:
    """This process's rank on its host."""
    return commsched.local_rank()


def local_size() -> int:
    """The number of ranks on this host."""
    return int(_core("local_size")())


def cross_rank() -> int:
    """This host's index among the hosts."""
    return int(_core("cross_rank")())


def cross_size() -> int:
    """The number of hosts."""
    return int(_core("cross_size")())


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return size() == local_size() * cross_size()


def mpi_built() -> bool:
    """True when commsched has its MPI transport."""
    return bool(_core("mpi_built")())


def gloo_built() -> bool:
    """True when the Gloo transport can run here."""
    return bool(_core("gloo_built")())


def nccl_built() -> int:
    """NCCL's version code (e.g. 22105) when commsched's NCCL transport is built and NCCL loads, else 0.

    As Horovod's: scripts compare it with a version (`hvd.nccl_built() >= 2700`), so it is a number.
    """
    if not _core("nccl_built")():
        return 0
    from commsched import _nccl
    from commsched.transports import nccl

    try:
        return int(_nccl.version(nccl.load_api()))
    except RuntimeError:  # the extension is built but NCCL or CUDA does not load here: unusable
        return 0


def mpi_enabled() -> bool:
    """True while commsched runs on MPI."""
    return bool(_core("mpi_enabled")())


def gloo_enabled() -> bool:
    """True from init() on Gloo to this rank's own shutdown(), as mpi_enabled()."""
    return commsched._state.started_on("gloo")


def mpi_threads_supported() -> bool:
    """True under MPI: mpi4py starts MPI with MPI_THREAD_MULTIPLE, which commsched's thread needs."""
    return mpi_enabled()


def cuda_built() -> bool:
    """True when commsched can move CUDA tensors (its NCCL transport is built)."""
    return bool(_core("nccl_built")())


def rocm_built() -> bool:
    """Always False: commsched has no ROCm transport."""
    return False


def ddl_built() -> bool:
    """Always False: commsched has no DDL transport."""
    return False


def ccl_built() -> bool:
    """Always False: commsched has no oneCCL transport."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing commsched's Chrome-trace timeline to `file_path` (see also COMMSCHED_TIMELINE)."""
    _core("start_timeline")(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Stops the timeline started by start_timeline()."""
    _core("stop_timeline")()


def resolve_op(op: Any, average: bool | None = None, default: Any = Average, adasum: bool = False) -> str:
    """The commsched op for Horovod's (op, average) pair; refuses unknown ops (and Adasum unless `adasum`)."""
    if op is not None and average is not None:
        raise ValueError("op supersedes average; pass only one of them (op=hvd.Average or op=hvd.Sum)")
    if average is not None:
        warnings.warn(
            "average= is deprecated (as in Horovod); use op=hvd.Average or op=hvd.Sum", DeprecationWarning, 2
        )
        op = Average if average else Sum
    if op is None:
        op = default
    key = str(op).lower() if isinstance(op, str) else op
    if key == Adasum:
        if adasum:
            return Adasum  # type: ignore[no-any-return]
        raise NotImplementedError(
            "op=Adasum is not supported by this call; Adasum runs in allreduce (commsched.torch: also "
            "allreduce_async, allreduce_async_ and allreduce_); use op=hvd.Average or op=hvd.Sum here"
        )
    if key not in _OPS:
        raise ValueError(f"op must be hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product, not {op!r}")
    return str(_OPS[key])


# -- process sets ---------------------------------------------------------------------------------
_CORE = getattr(commsched, "ProcessSet", None) is not None


class _GlobalOnly:
    """The set of all ranks, for a commsched without process sets."""

    process_set_id = 0
    ranks: list[int] | None = None

    def size(self) -> int:
        """The number of ranks."""
        return commsched.size()

    def rank(self) -> int:
        """This process's rank."""
        return commsched.rank()

    def included(self) -> bool:
        """Every rank is in the global set."""
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


if _CORE:
    ProcessSet: Any = commsched.ProcessSet
    global_process_set: Any = commsched.global_process_set
    add_process_set: Any = commsched.add_process_set
    remove_process_set: Any = commsched.remove_process_set
else:
    ProcessSet = _GlobalOnly
    global_process_set = _GlobalOnly()

    def add_process_set(process_set: Any) -> Any:
        """Unavailable: this commsched has no process sets."""
        raise NotImplementedError(
            "process sets need a commsched whose core has them (commsched.add_process_set); "
            "this build runs every collective over all ranks"
        )

    def remove_process_set(process_set: Any) -> bool:
        """Unavailable: this commsched has no process sets."""
        return add_process_set(process_set)  # type: ignore[no-any-return]


def is_global(process_set: Any) -> bool:
    """True for the global set (or None)."""
    return process_set is None or process_set is global_process_set


def core_arguments(process_set: Any) -> dict[str, Any]:
    """The keyword arguments that hand `process_set` to a commsched collective (none for the global set)."""
    if is_global(process_set):
        return {}
    if not _CORE:
        add_process_set(process_set)  # raises, naming what is missing
    return {"process_set": process_set}


def set_size(process_set: Any) -> int:
    """The number of ranks in `process_set`."""
    return commsched.size() if is_global(process_set) else int(process_set.size())


def integer_average(op: str, integral: bool, postscale_factor: float, process_set: Any) -> tuple[str, float]:
    """(op, postscale) giving Horovod's average of integers: a sum scaled by postscale/size.

    Horovod averages by folding 1/size into the postscale factor, and the core casts a scaled integer
    back rounding toward zero, so -75 averaged over 2 ranks is -37 as in Horovod, not the floor -38.
    Floating and bool tensors, and other ops, are returned unchanged.
    """
    if op != Average or not integral:
        return op, postscale_factor
    return Sum, postscale_factor / set_size(process_set)


def set_rank(process_set: Any) -> int:
    """This process's rank within `process_set`."""
    return commsched.rank() if is_global(process_set) else int(process_set.rank())


def ranks_of(process_set: Any) -> Sequence[int]:
    """The global ranks in `process_set`, in order."""
    if is_global(process_set):
        return range(commsched.size())
    return list(process_set.ranks)
