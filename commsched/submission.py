"""Submitting one collective to the core: the checks of its arguments, the view of its memory, the
enqueue, and the one-call path for plain host buffers. A refused argument is told to the other ranks."""

from __future__ import annotations

import operator
import sys
from typing import Any

import commsched as _api
from commsched import _core, buffers
from commsched import process_sets as _process_sets
from commsched.handles import Handle, _timed_out
from commsched.runtime_state import _state, _submitter

_OPS = ("sum", "average", "min", "max", "product")


def host_fast_path(name: Any, priority: Any) -> bool:
    """True when a host buffer may skip the Python checks: a str name and int priority, a started core
    on host memory, no tuner recording, the global process set (the core checks the rest and hands
    back the doubtful)."""
    return (
        type(name) is str
        and type(priority) is int
        and _state.pending is None
        and not _state.device_memory
        and _state.tuner is None
        and _process_sets.current() == 0
    )


def wakes_core() -> bool:
    """Whether a collective submitted now should wake the core's thread: not when this thread drives it."""
    return not getattr(_submitter, "drives", False)


def _run_now(
    array: Any, name: str | None, kind: str, op: str, root: int, priority: int, timeout: float | None
) -> Any:
    """Submits and waits on this thread; a plain host buffer or GPU array goes to the core in one call."""
    # Plain: no process set to qualify the name for, no core still to start, no tuner recording.
    tuner = _state.tuner
    plain = _state.pending is None and _process_sets.current() == 0 and (tuner is None or not tuner.recording)
    if plain and kind == "allreduce" and _state.device_memory:
        done = _run_device_allreduce(array, name, op, priority, timeout)
        if done is not None:
            return done
    name, root, priority = _checked(name, kind, op, root, priority)
    op = _op_name(op)
    if plain and not _state.device_memory:
        limit = -1.0 if timeout is None else timeout
        if kind == "broadcast":
            done = _core.broadcast_buffer(array, name, root, priority, limit)
        else:
            done = _core.allreduce_buffer(array, name, op, priority, limit)
        return _buffer_outcome(done, array, name, kind, op, root, priority, timeout)
    return _enqueue(array, name, kind, op, root, priority, waits_next=True).wait(timeout)


def _run_device_allreduce(
    array: Any, name: str | None, op: str, priority: int, timeout: float | None
) -> Any | None:
    """The allreduce of a GPU array in one core call (a plain call, see _run_now): the array once done;
    None where the full path must run (it checks and names what is wrong and numbers unnamed tensors)."""
    if (
        type(name) is not str
        or type(priority) is not int
        # nan, negative or not a number: the full path says what to pass
        or (timeout is not None and not (type(timeout) in (int, float) and timeout >= 0))
    ):
        return None
    try:
        view = buffers.view(array, name)
    except (TypeError, ValueError):
        return None  # the full path refuses it, telling the other ranks
    if not view.on_gpu:
        return None
    described = (
        view.address,
        view.count,
        view.dtype,
        view.device,
        view.stream,
        view.owner,
        _trailing_dims(array),
    )
    done = _core.allreduce_device(name, op, priority, -1.0 if timeout is None else timeout, described)
    if done == -2:
        return None
    if done == 0:
        raise _timed_out(name, timeout)
    return array


def _buffer_outcome(
    done: int, array: Any, name: str, kind: str, op: str, root: int, priority: int, timeout: float | None
) -> Any:
    """The array once the core's buffer call says done (1), a timeout (0), or the view path (-1)."""
    if done > 0:
        return array
    if done == 0:
        raise _timed_out(name, timeout)
    # Torch and GPU tensors and buffers the core cannot take go through the view, which names the problem.
    return _enqueue(array, name, kind, op, root, priority, waits_next=True).wait(timeout)


def _submit(array: Any, name: str | None, kind: str, op: str, root: int, priority: int) -> Handle:
    name, root, priority = _checked(name, kind, op, root, priority)
    return _enqueue(array, name, kind, _op_name(op), root, priority)


def _checked(name: str | None, kind: str, op: str, root: Any, priority: Any) -> tuple[str, int, int]:
    """(name, root, priority) once the call's arguments are checked; raises naming the problem.

    A None name is numbered in call order (like Horovod), which must then match across ranks.
    Once the name is known, a refused call is told to the other ranks, whose collectives under
    that name then fail instead of waiting for this one.
    """
    if name is None:
        name = f"{kind}.unnamed.{_process_sets.next_unnamed(_state.unnamed)}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor name must be a non-empty string, not {name!r}")
    name = _process_sets.qualified(name)
    try:
        root = _integer(root, f"root of '{name}'", "a rank number")
        priority = _integer(priority, f"priority of '{name}'", "a 32-bit integer")
        if not -(2**31) <= priority < 2**31:
            raise TypeError(f"priority of '{name}' must be a 32-bit integer, not {priority}")
        if not -(2**31) <= root < 2**31:  # smaller ones the core checks against the number of ranks
            ranks = f"between 0 and {_core.size() - 1}" if _core.running() else "from 0 up"
            raise ValueError(f"root of '{name}' is {root}, which is not a rank; use a rank {ranks}")
        if _op_name(op) not in _OPS:
            raise ValueError(
                f"op of '{name}' must be one of {', '.join(_OPS)} (any case, or commsched.Sum etc.), not {op!r}"
            )
    except (TypeError, ValueError) as error:
        _refuse(name, error)
        raise
    return name, root, priority


def _op_name(op: Any) -> str:
    """An op as the core names it: the strings (and commsched.Sum etc.) in any case."""
    return op.lower() if isinstance(op, str) else repr(op)


def _factor(value: Any, what: str, name: str) -> float:
    """A scale factor as a float; refuses what is no real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{what} of '{name}' must be a number, not {value!r}")
    return float(value)


def _integer(value: Any, what: str, form: str) -> int:
    """`value` as an int: Python and numpy integers are taken, bools and floats refused."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        raise TypeError(f"{what} must be {form}, not the boolean {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be {form}, not {value!r}") from None


def _refuse(name: str, error: BaseException) -> None:
    """Tells the other ranks this rank refused `name`, so their collectives under it fail now."""
    if _state.pending is None and _core.running():
        _core.refuse(name, str(error), process_set=_process_sets.current())


def _enqueue(
    array: Any,
    name: str,
    kind: str,
    op: str,
    root: int,
    priority: int,
    waits_next: bool = False,
    **extra: Any,
) -> Handle:
    """Submits one collective; `extra`: prescale, postscale, row_shape, splits for the core."""
    view, core_handle = _submit_view(array, name, kind, op, root, priority, waits_next, **extra)
    return Handle(core_handle, array, view)


def _submit_view(
    array: Any, name: str, kind: str, op: str, root: int, priority: int, waits_next: bool, **extra: Any
) -> tuple[buffers.BufferView, Any]:
    """Views `array` and hands it to the core: (view, core handle)."""
    try:
        view = buffers.view(array, name)
    except (TypeError, ValueError) as error:
        _refuse(name, error)
        raise
    if kind in _SHAPED_KINDS and "row_shape" not in extra:
        extra["row_shape"] = _trailing_dims(array)
    if _state.pending is not None:
        _api._start_pending(view.on_gpu, view.device)
    if _state.settings is not None:  # else the core's enqueue says to call init() first
        try:
            _check_memory(view, name, _state.device_memory)
        except TypeError as error:
            _refuse(name, error)
            raise
    # A caller that waits next runs the core itself: waking the core's thread would only take a
    # CPU from it. The core holds the owner until the collective ends, even if the handle is
    # dropped. A GPU tensor's stream goes along: the core records there, on this thread, the point
    # its collectives wait for.
    core_handle = _core.enqueue(
        name,
        view.address,
        view.count,
        view.dtype,
        op,
        kind,
        root,
        priority,
        wake_core=not waits_next and wakes_core(),
        owner=view.owner,
        device=view.on_gpu,
        device_id=-1 if view.device is None else view.device,
        stream=view.stream,
        process_set=_process_sets.current(),
        **extra,
    )
    tuner = _state.tuner
    if tuner is not None and tuner.recording and kind == "allreduce":
        tuner.observe(name, view.count, view.dtype, priority, core_handle)
    return view, core_handle


# Kinds whose ranks must agree on the whole shape, not only the element count (Horovod's check).
_SHAPED_KINDS = ("allreduce", "broadcast")


def _trailing_dims(array: Any) -> list[int]:
    """The array's shape after its first dim ([] for 0-d and 1-d arrays and for shapeless buffers)."""
    shape = getattr(array, "shape", None)
    if shape is None:
        return []
    return [int(extent) for extent in tuple(shape)[1:]]


def _check_memory(view: buffers.BufferView, name: str, device_transport: bool) -> None:
    """Refuses a tensor whose memory (host or GPU) the running transport cannot move."""
    if view.on_gpu and not device_transport:
        raise TypeError(
            f"tensor '{name}' lives on a GPU, but commsched runs the {_state.transport} transport, which moves "
            "host memory only; start commsched with init(device='cuda') (or COMMSCHED_DEVICE=cuda, "
            "COMMSCHED_TRANSPORT=nccl) to send GPU tensors through NCCL, or move this one to the CPU (.cpu())"
        )
    if not view.on_gpu and device_transport:
        raise TypeError(
            f"tensor '{name}' is in host memory, but commsched runs the {_state.transport} transport on GPU "
            "memory (init(device='cuda')); move it to the GPU (tensor.cuda(), cupy.asarray), or use init(device='cpu') in a "
            "job whose tensors all stay on the CPU"
        )
