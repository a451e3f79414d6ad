"""commsched: a communication scheduler for data-parallel training.

Gradients go to the core as soon as they are ready; the core partitions, fuses and
orders them by the priority the next forward pass needs, and every rank launches the
same collectives in the same order.

Errors. An argument the caller can fix (a bad name, dtype, op, root or priority, a read-only
or non-contiguous array, a name already in flight) raises TypeError or ValueError at once. A
tensor refused on one rank fails on every rank: the others' handles for that name raise
CollectiveError naming the rank and the reason. Everything that goes wrong at run time is a
CommschedError, whose `rank` attribute names the rank it started on when known:

    CommschedError (RuntimeError)   any failure at run time (a transport error, for one)
    +-- CollectiveError             one collective failed on every rank, commsched goes on: the ranks
    |                               submitted different metadata under one name, or a rank refused it
    +-- NotRunningError             commsched is not running: never initialised, shut down, or stopped;
        |                           raised by submissions and by handles pending when it stopped
        +-- RankFailure             it stopped because a rank failed, lost contact or stalled past
                                    COMMSCHED_STALL_SHUTDOWN

Handle.wait(timeout) raises the builtin TimeoutError when the collective is still running.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import sys
from typing import Any


def _source_tree_error() -> ImportError | None:
    """The error to raise when this package is a checkout's source folder with no built core: run
    from the repository root after a non-editable install, Python imports the folder, not the install.
    None when there is no such trap, or when an installed copy of this very package lends the folder
    its modules (then `__path__` leads there)."""
    import hashlib
    import importlib.machinery
    from pathlib import Path

    package = Path(__file__).resolve().parent
    if not (package.parent / "setup.py").is_file() or any(package.glob("_core*.so")):
        return None
    # The installed copy elsewhere on sys.path; used only when its __init__.py is this one, so the
    # checkout's own code runs with the modules built from it (a newer checkout would not match them).
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != package.parent]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    installed = Path(spec.origin).parent if spec and spec.origin else None
    if installed and any(installed.glob("_core*.so")):
        digests = {hashlib.sha256((p / "__init__.py").read_bytes()).digest() for p in (package, installed)}
        if len(digests) == 1:
            # Both name the installed copy, as from any other folder (commsched-info reads __file__).
            __path__[:] = [str(installed)]
            globals()["__file__"] = str(installed / "__init__.py")
            return None
        found = f"; the commsched installed at {installed} is from other sources"
    else:
        found = ""
    return ImportError(
        f"commsched was imported from its source folder {package}, which has no built C++ core "
        f"(commsched._core){found}: Python looks in the current directory first. Run from outside the "
        "checkout (cd elsewhere) to use the installed commsched, reinstall it from this checkout "
        "(`pip install .`), or build it in place with `pip install -e .` in the checkout."
    )


try:
    from commsched import _core
except ImportError:
    _trap = _source_tree_error()
    if _trap is not None:
        raise _trap from None
    from commsched import _core  # from the installed copy, or the first error again

from commsched import config as _config
from commsched import launch as _launch
from commsched import link_probe, transports
from commsched._core import CollectiveError, CommschedError, NotRunningError, RankFailure
from commsched.handles import Handle

# Horovod's name for a failed collective, for scripts that catch it (hvd.HorovodInternalError).
HorovodInternalError = CommschedError

__all__ = [
    "Average",
    "CollectiveError",
    "CommschedError",
    "GroupHandle",
    "Handle",
    "HorovodInternalError",
    "Max",
    "Min",
    "NotRunningError",
    "ProcessSet",
    "Product",
    "RankFailure",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "autotune_step",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "config",
    "cross_rank",
    "cross_size",
    "get_process_sets",
    "global_process_set",
    "gloo_built",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "rank",
    "reconfigure",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "run",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
__version__ = "0.1.0"

log = logging.getLogger("commsched")
# Reduction ops, as Horovod names them (hvd.Average, ...); op= takes these or the strings, in any case.
Average, Sum, Min, Max, Product = "average", "sum", "min", "max", "product"

# Shared with the plug-ins (commsched._state, commsched._caller_drives).
from commsched.runtime_state import _caller_drives as _caller_drives
from commsched.runtime_state import _state


def init(comm: Any = None, process_group: Any = None, **settings: Any) -> None:
    """Starts commsched on this process; settings override COMMSCHED_* variables.

    device="cuda" (COMMSCHED_DEVICE) sends GPU tensors through NCCL; with the default "auto" and
    COMMSCHED_TRANSPORT=auto, a process where PyTorch or CuPy sees a GPU picks its transport when
    the first tensor is submitted (NCCL if it is on a GPU).
    """
    if comm is None and process_group is None and not is_initialized() and _elastic_member():
        # Under commsched-run --min-np a rank lost while the ranks start re-forms them, not the job.
        from commsched import elastic

        elastic.start_first_generation(settings)
        return
    _init_here(comm, process_group, **settings)


def _elastic_member() -> bool:
    """True in a rank that commsched-run started for elastic training (it has a membership service)."""
    return bool(os.environ.get("COMMSCHED_ELASTIC_ADDRESS")) and bool(os.environ.get("COMMSCHED_ELASTIC_ID"))


def _init_here(comm: Any = None, process_group: Any = None, **settings: Any) -> None:
    """init() of this process as launched, without the elastic check-in."""
    with _state.lock:
        if _core.running() or _state.pending is not None:
            # As Horovod's init(): a second call while running changes nothing (shutdown() first to restart).
            log.debug("commsched.init() called again while initialised: nothing to do")
            return
        resolved = _config.resolve(settings)
        logging.basicConfig()
        log.setLevel(resolved.log_level.upper() if resolved.log_level != "trace" else logging.DEBUG)
        info = _launch.detect()
        _state.settings = resolved
        _state.launcher = info.launcher
        _state.unnamed = itertools.count()
        _process_sets._reset()
        # Sets built from MPI communicators are read as ranks of this one (Horovod's global_process_set.mpi_comm).
        _process_sets.global_process_set.mpi_comm = comm if _process_sets._is_communicator(comm) else None
        _state.user_given = _config.user_given(settings)
        defer = resolved.device == "auto" and resolved.transport == "auto" and comm is None
        if defer and process_group is None and info.size > 0 and _gpu_visible():
            # Every rank submits the same first tensor, so every rank makes the same choice.
            _state.pending = (info, info.rank, info.size)
            _state.local_rank = info.local_rank
            _state.local_size = _launch.local_size(info.size)
            log.info(
                "COMMSCHED_TRANSPORT=auto with a GPU visible: the transport is chosen when the first tensor "
                "is submitted (init(device='cuda' or 'cpu') chooses now)"
            )
        else:
            cuda = resolved.device.startswith("cuda") or resolved.transport == "nccl"
            index = int(resolved.device.split(":")[1]) if resolved.device.startswith("cuda:") else None
            try:
                _start(info, comm, process_group, cuda, index)
            except BaseException:
                _core.stop()  # a core that came up before the failure stops again: nothing half started
                _state.settings = None  # not initialised: config() must say so
                raise
    if _state.pending is None:
        _after_start()
    if resolved.autotune:
        _start_autotune(resolved)


def _start_autotune(resolved: _config.Settings) -> None:
    """Starts the auto-tuner after init(); a failure stops commsched again, naming the variable."""
    from commsched import autotune

    try:
        autotune.start()
    except OSError as error:
        shutdown()  # init() fails as a whole: nothing stays half started
        raise _config.SettingError(
            f"COMMSCHED_AUTOTUNE_LOG={resolved.autotune_log!r}: cannot write the log of trials there "
            f"({error.strerror or error}); use a writable file path, or leave it unset"
        ) from error
    except BaseException:
        shutdown()
        raise


def _gpu_visible() -> bool:
    """True when PyTorch or CuPy, already imported by the caller, sees a CUDA device (imports neither)."""
    try:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return True
        cupy = sys.modules.get("cupy")
        return cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0
    except (RuntimeError, AttributeError, OSError):  # a broken or driverless CUDA install: no GPU
        return False


def _start(info: _launch.LaunchInfo, comm: Any, process_group: Any, cuda: bool, device: int | None) -> None:
    """Chooses and builds the transport and starts the core; the caller holds _state.lock."""
    resolved = _state.settings
    assert resolved is not None
    kind = transports.choose(resolved.transport, info, comm, process_group, cuda_buffers=cuda)
    core_kind, argument = transports.build(
        kind, info, comm, process_group, resolved, device, device_memory=cuda
    )
    rank, size = _probe_rank_size(core_kind, argument, info)
    resolved = link_probe.fit_to_link(
        resolved, _state.user_given, kind, comm, process_group, size, device_memory=cuda
    )
    resolved = dataclasses.replace(resolved, credit_bytes=resolved.credit_for(size))
    _core.start(
        policy=resolved.policy,
        partition_bytes=resolved.partition_bytes,
        credit_bytes=resolved.credit_bytes,
        fusion_bytes=resolved.fusion_bytes,
        inline_bytes=resolved.inline_bytes,
        cycle_time_s=resolved.cycle_time,
        stall_timeout_s=resolved.stall_timeout,
        stall_shutdown_s=resolved.stall_shutdown,
        timeline_path=_config.timeline_path_for(resolved.timeline, rank, size),
        log_level=resolved.log_level,
        transport_kind=core_kind,
        transport_argument=argument,
        control_channel=resolved.control_channel,
        control_address=resolved.control_address,
        link_latency_s=resolved.link_latency or 0.0,
        poll_interval_s=-1.0 if resolved.poll_interval is None else resolved.poll_interval,
    )
    for prefix, hint in _STALL_HINTS.items():
        _core.add_stall_hint(prefix, hint)
    _state.settings = resolved
    _state.transport = kind
    _state.device_memory = core_kind == "device"
    _state.local_rank, _state.local_size = _local_rank_and_size(kind, comm, info, size)
    _state.pending = None
    if _state.timeline_request is not None:
        from commsched.timeline import apply_pending_request

        apply_pending_request()


def _start_pending(cuda: bool, device: int | None = None) -> None:
    """Starts a core that init() left waiting for the first tensor (no-op otherwise)."""
    with _state.lock:
        if _state.pending is None:
            return
        _start(_state.pending[0], None, None, cuda, device)
    _after_start()


def _after_start() -> None:
    """Once the core runs: under torchrun, names this worker group's keys in torchrun's store, so a
    rank lost before commsched.elastic.run() takes over is re-formed without, not fatal."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        from commsched.elastic import torchrun

        torchrun.record_group(_state.transport, broadcast_object)


def _probe_rank_size(core_kind: str, argument: Any, info: _launch.LaunchInfo) -> tuple[int, int]:
    """Rank and size as the transport will see them, needed before the core starts (timeline path)."""
    if core_kind == "device":  # NCCL around a host transport, which knows the ranks
        return _probe_rank_size(argument[1], argument[2], info)
    if core_kind == "python":
        return argument.rank, argument.size
    if core_kind == "native":
        if (
            len(argument) > 2
        ):  # (factory, handle, owner): a native transport whose owner knows the ranks (Gloo)
            return argument[2].rank, argument[2].size
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return 0, 1


def _local_rank_and_size(kind: str, comm: Any, info: _launch.LaunchInfo, size: int) -> tuple[int, int]:
    """Rank and rank count on this host, asked once at start: under MPI it is a collective call, which
    a later local_size() on one rank alone would leave waiting."""
    if kind == "mpi":
        from commsched.transports.mpi import local_rank_and_size

        return local_rank_and_size(comm)
    return info.local_rank, _launch.local_size(size)


def shutdown() -> None:
    """Stops commsched on every rank; pending handles fail with a clear error."""
    with _state.lock:
        if _state.tuner is not None:
            _state.tuner.close()
            _state.tuner = None
        _core.stop()
        _state.settings = None
        _state.pending = None
        _state.timeline_request = None
        _state.device_memory = False


atexit.register(shutdown)


def _excepthook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """Tells the other ranks this one is exiting on an uncaught exception, then reports it as usual.

    Without it, the at-exit shutdown() would reach the others as a plain, deliberate shutdown.
    """
    _previous_excepthook(kind, error, trace)
    if _core.running() and not issubclass(kind, KeyboardInterrupt):
        _core.abort(f"rank {_core.rank()} is exiting on an uncaught {kind.__name__}: {error}")


_previous_excepthook = sys.excepthook
sys.excepthook = _excepthook


# Name prefix -> what usually leaves such a tensor waiting; the plug-ins add theirs at import.
_STALL_HINTS: dict[str, str] = {}


def _add_stall_hint(prefix: str, hint: str) -> None:
    """Adds `hint` to the stall warnings and failures of tensors whose names start with `prefix`."""
    _STALL_HINTS[prefix] = hint
    if _core.running():
        _core.add_stall_hint(prefix, hint)


def is_initialized() -> bool:
    """True from init() until shutdown() or until the core stops (a peer's shutdown, a rank's failure)."""
    return bool(_core.running()) or _state.pending is not None


def rank() -> int:
    """This process's rank."""
    pending = _state.pending
    return pending[1] if pending is not None else int(_core.rank())


def size() -> int:
    """The number of ranks."""
    pending = _state.pending
    return pending[2] if pending is not None else int(_core.size())


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    if _state.pending is None:
        _core.rank()  # raises the not-initialised error
    return _state.local_rank


def config() -> dict[str, Any]:
    """The effective settings, transport and launch details as a dict."""
    if _state.settings is None:
        raise NotRunningError("commsched.config() needs commsched.init() first")
    result = _state.settings.as_dict()
    if _state.pending is not None:
        result.update(transport="auto (chosen at the first tensor)", launcher=_state.launcher)
        result.update(rank=rank(), size=size(), local_rank=_state.local_rank)
        result.update(credit_bytes=_state.settings.credit_for(size()))
        return result
    result.update(_core.scheduling_settings())  # reconfigure() may have changed these
    result.update(
        transport=_state.transport,
        launcher=_state.launcher,
        rank=rank(),
        size=size(),
        local_rank=_state.local_rank,
    )
    return result


def reconfigure(**settings: Any) -> None:
    """Switches policy, partition, credit or fusion size on every rank at the same cycle.

    Every rank calls it; the switch happens once all have, with rank 0's values. Tensors
    already cut into chunks finish under the old settings.
    """
    allowed = {"policy", "partition_bytes", "credit_bytes", "fusion_bytes"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise _config.SettingError(
            f"commsched.reconfigure() got {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}"
        )
    current = config()
    merged = {name: current[name] for name in allowed}
    merged.update({name: value for name, value in settings.items() if value is not None})
    resolved = _config.resolve(merged, environ={})
    with _state.lock:
        if _state.pending is not None and _state.settings is not None:
            # No core yet: it starts with these settings at the first tensor.
            _state.settings = dataclasses.replace(
                _state.settings, **{name: getattr(resolved, name) for name in allowed}
            )
            return
    _core.reconfigure(resolved.policy, resolved.partition_bytes, resolved.credit_bytes, resolved.fusion_bytes)


def autotune_step() -> None:
    """Marks the end of a training iteration for the auto-tuner; does nothing unless it is on."""
    tuner = _state.tuner
    if tuner is not None:
        tuner.step()


def stats() -> dict[str, int]:
    """Counters of the running core: cycles, launches, fused launches, bytes, peak bytes in flight.

    Empty while init() waits for the first tensor to choose the transport.
    """
    if _state.pending is not None:
        return {}
    return dict(_core.stats())


# Process sets and the collectives beyond allreduce and broadcast live in their own modules.
from commsched import process_sets as _process_sets
from commsched.collectives import (
    GroupHandle,
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    barrier,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_built,
    grouped_allreduce,
    grouped_allreduce_async,
    join,
    local_size,
    mpi_built,
    mpi_enabled,
    nccl_built,
    reducescatter,
    reducescatter_async,
)
from commsched.inplace import allreduce, allreduce_async, broadcast, broadcast_async
from commsched.process_sets import (
    ProcessSet,
    add_process_set,
    get_process_sets,
    global_process_set,
    remove_process_set,
)
from commsched.timeline import start_timeline, stop_timeline


def __getattr__(name: str) -> Any:
    """commsched.run on first use: the launcher's module, callable as Horovod's horovod.run(func, ...).

    Imported lazily, so `python -m commsched.run` does not find it imported already.
    """
    if name == "run":
        import importlib

        return importlib.import_module("commsched.run")
    raise AttributeError(f"module 'commsched' has no attribute {name!r}")
