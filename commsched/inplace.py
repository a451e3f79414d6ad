"""Allreduce and broadcast in place: the two collectives every transport runs, with the fast path
a named host buffer takes straight into the core."""

from __future__ import annotations

from typing import Any

import commsched as _api
from commsched import _core
from commsched import collectives as _collectives
from commsched import process_sets as _process_sets
from commsched import submission as _submission


def allreduce_async(
    array: Any,
    name: str | None = None,
    priority: int = 0,
    op: str = "sum",
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> _api.Handle:
    """Starts an in-place allreduce; smaller priority numbers go on the wire first.

    op: sum, average (integers floor-divide, as Horovod), min, max or product (bool: min and
    product are logical and, max is logical or). prescale_factor multiplies this rank's data before
    the reduction, postscale_factor the result after it. process_set: the ProcessSet it runs on
    (default: every rank); average divides by the set's size.
    """
    if process_set is not None:
        with _process_sets.scope(process_set):
            return allreduce_async(array, name, priority, op, prescale_factor, postscale_factor)
    if prescale_factor == 1.0 and postscale_factor == 1.0:
        # A named host buffer goes to the core in one call, as allreduce's does: the Python checks
        # and view cost ~7 us per tensor, a third of a ResNet-50 replay's iteration on shared memory.
        if _submission.host_fast_path(name, priority):
            core_handle = _core.allreduce_buffer_async(array, name, op, priority, _submission.wakes_core())
            if core_handle is not None:
                return _api.Handle(core_handle, array, None)
        return _submission._submit(array, name, "allreduce", op, 0, priority)
    name, root, priority = _submission._checked(name, "allreduce", op, 0, priority)
    scales = _collectives._scales(name, prescale_factor, postscale_factor)
    return _submission._enqueue(array, name, "allreduce", _submission._op_name(op), root, priority, **scales)


def allreduce(
    array: Any,
    name: str | None = None,
    priority: int = 0,
    op: str = "sum",
    timeout: float | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Any:
    """Allreduces in place and returns the array (op, scale factors and process_set as allreduce_async)."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return allreduce(array, name, priority, op, timeout, prescale_factor, postscale_factor)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        handle = allreduce_async(array, name, priority, op, prescale_factor, postscale_factor)
        return handle.wait(timeout)
    # The common call, a named buffer on a transport that takes host memory, goes straight to the
    # core, which checks name, op and priority itself and hands anything doubtful back (-2): on
    # shared memory a small allreduce costs ~2 us, and each Python call layer ~50 ns.
    if _submission.host_fast_path(name, priority):
        done = _core.allreduce_buffer(array, name, op, priority, -1.0 if timeout is None else timeout)
        if done != -2:  # -1: valid arguments, not a host buffer the core takes: no second try
            return _submission._buffer_outcome(done, array, name, "allreduce", op, 0, priority, timeout)
    return _submission._run_now(array, name, "allreduce", op, 0, priority, timeout)


def broadcast_async(
    array: Any, root: int = 0, name: str | None = None, priority: int = 0, process_set: Any = None
) -> _api.Handle:
    """Starts an in-place broadcast from `root` (a global rank, a member of process_set when given)."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return broadcast_async(array, root, name, priority)
    return _submission._submit(array, name, "broadcast", "sum", root, priority)


def broadcast(
    array: Any,
    root: int = 0,
    name: str | None = None,
    priority: int = 0,
    timeout: float | None = None,
    process_set: Any = None,
) -> Any:
    """Broadcasts in place from `root` and returns the array (process_set as broadcast_async)."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return broadcast(array, root, name, priority, timeout)
    return _submission._run_now(array, name, "broadcast", "sum", root, priority, timeout)
