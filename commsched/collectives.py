"""Collectives beyond allreduce and broadcast, with Horovod's names and arguments.

Every one goes through the core's agreement and priority queue like allreduce: every rank
launches them in the same order, and the timeline shows them. Results of allgather, reducescatter
and alltoall are new arrays the core allocates once every rank's submission is known (numpy
arrays; torch tensors when the input was a torch tensor). Objects travel as pickled bytes inside
an allgather of uint8 on this process only; commsched's own wire never carries pickle.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import pickle
import time
from collections.abc import Sequence
from typing import Any

import commsched as _api
from commsched import _core
from commsched import process_sets as _process_sets
from commsched import submission as _submission
from commsched.handles import deadline_of

# commsched dtype -> numpy dtype of the result (bfloat16 as its raw 16 bits, which torch views back).
_NUMPY_DTYPES = {
    "float16": "float16",
    "bfloat16": "uint16",
    "float32": "float32",
    "float64": "float64",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "int8": "int8",
    "bool": "bool",
}
_barriers = itertools.count()


class OutputHandle(_api.Handle):
    """A collective whose result is a new array: wait() returns it (alltoall: with the received splits)."""

    def __init__(
        self,
        core_handle: Any,
        array: Any,
        view: Any,
        row_shape: tuple[int, ...],
        kind: str,
        dtype: str | None = None,
    ) -> None:
        super().__init__(core_handle, array, view)
        self._row_shape = row_shape
        self._kind = kind
        self._dtype = view.dtype if dtype is None else dtype
        self._result: Any = None
        # alltoall: this rank's index in its set's layout, read while the set's scope is current
        self._me = _process_sets.position() if kind == "alltoall" else 0

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until done and returns the result; raises TimeoutError or a CommschedError."""
        if self._result is None:
            super().wait(timeout)
            self._result = self._build()
        return self._result

    def layout_rows(self) -> list[int]:
        """Rows each rank contributed (allgather), kept (reducescatter) or sent here (alltoall)."""
        _, _, layout = self._core_handle.output()
        row = _row_elements(self._row_shape)
        size = len(layout) if self._kind != "alltoall" else math.isqrt(len(layout))
        if self._kind == "alltoall":
            counts = [layout[source * size + self._me] for source in range(size)]
        else:
            counts = list(layout)
        return [count // row if row else 0 for count in counts]

    def _build(self) -> Any:
        import numpy as np

        memory, elements, _ = self._core_handle.output()
        dtype = self._dtype
        if _api._state.device_memory:
            from commsched.device_output import device_result

            result = device_result(memory, elements, dtype, self._row_shape, self._array)
            return (result, self.layout_rows()) if self._kind == "alltoall" else result
        result = np.frombuffer(memory, dtype=_NUMPY_DTYPES[dtype], count=elements)
        result = (
            result.reshape((-1, *self._row_shape))
            if _row_elements(self._row_shape)
            else result.reshape((0, *self._row_shape))
        )
        if _is_torch(self._array):
            import torch

            tensor = torch.from_numpy(result)
            result = tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
        if self._kind == "alltoall":
            return result, self.layout_rows()
        return result


class GroupHandle:
    """Collectives submitted and agreed together; wait() returns their results in order."""

    def __init__(self, handles: list[_api.Handle]) -> None:
        self._handles = handles

    def done(self) -> bool:
        """True once every member finished (or failed)."""
        return all(handle.done() for handle in self._handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Waits for every member; returns their arrays in the order given."""
        deadline = deadline_of(timeout, f"a group of {len(self._handles)}")
        results = []
        for handle in self._handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            results.append(handle.wait(left))
        return results


def _is_torch(array: Any) -> bool:
    return type(array).__module__.startswith("torch") and hasattr(array, "data_ptr")


def _row_elements(row_shape: tuple[int, ...]) -> int:
    elements = 1
    for extent in row_shape:
        elements *= extent
    return elements


def _rows_and_shape(array: Any, name: str) -> tuple[Any, int, tuple[int, ...]]:
    """(array, first dimension, row shape); a 0-d array counts as one row of shape ()."""
    shape = tuple(int(extent) for extent in getattr(array, "shape", ()) or ())
    if not shape:
        if hasattr(array, "reshape"):
            array = array.reshape(1)
            shape = (1,)
        else:
            shape = (len(memoryview(array)),)
    return array, shape[0], shape[1:]


def _finite_factor(value: Any, what: str, name: str) -> float:
    """A scale factor as a finite float; refuses what is no number, NaN and infinity by name."""
    try:
        factor = _submission._factor(value, what, name)
    except OverflowError:  # an int beyond float's range
        factor = math.inf
    if not math.isfinite(factor):
        # NaN never equals itself, so the ranks' agreement would blame a mismatch; infinity turns
        # every element into inf or NaN. Either is a mistake of the caller's, refused here.
        raise ValueError(
            f"{what} of '{name}' is {factor}; a scale factor must be a finite number: pass a finite "
            f"{what} (1.0 scales nothing)"
        )
    return factor


def _scales(name: str, prescale_factor: Any, postscale_factor: Any) -> dict[str, float]:
    """The core's scale arguments, checked; a refusal also ends the other ranks' collectives of `name`."""
    try:
        return {
            "prescale": _finite_factor(prescale_factor, "prescale_factor", name),
            "postscale": _finite_factor(postscale_factor, "postscale_factor", name),
        }
    except (TypeError, ValueError) as error:
        _submission._refuse(name, error)
        raise


def _submit_output(
    array: Any,
    name: str | None,
    kind: str,
    op: str,
    priority: int,
    splits: list[int] | None = None,
    **extra: Any,
) -> OutputHandle:
    name, _, priority = _submission._checked(name, kind, op, 0, priority)
    array, _, row_shape = _rows_and_shape(array, name)
    if splits is not None:
        extra["splits"] = splits
    view, core_handle = _submission._submit_view(
        array, name, kind, _submission._op_name(op), 0, priority, False, row_shape=list(row_shape), **extra
    )
    return OutputHandle(core_handle, array, view, row_shape, kind)


def _submit_buffer(array: Any, name: Any, kind: str, op: Any, priority: Any) -> OutputHandle | None:
    """A named host buffer's reducescatter or allgather in one core call, as allreduce_async's;
    None where the full path must check the arguments (and name what is wrong)."""
    if not _submission.host_fast_path(name, priority):
        return None
    memory = array
    if _is_torch(array):
        try:
            memory = array.numpy()  # a view of a CPU tensor's memory (bfloat16, GPU and autograd refuse)
        except (TypeError, RuntimeError):
            return None
    submitted = _core.output_buffer_async(memory, name, kind, op, priority, _submission.wakes_core())
    if submitted is None:
        return None
    core_handle, dtype, row_shape = submitted
    return OutputHandle(core_handle, array, None, row_shape, kind, dtype)


def allgather_async(
    array: Any, name: str | None = None, priority: int = 0, process_set: Any = None
) -> OutputHandle:
    """Starts an allgather: every rank's array concatenated on the first dimension (which may differ);
    with process_set, its members' arrays in rank order."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return allgather_async(array, name, priority)
    return _submit_buffer(array, name, "allgather", "sum", priority) or _submit_output(
        array, name, "allgather", "sum", priority
    )


def allgather(
    array: Any,
    name: str | None = None,
    priority: int = 0,
    timeout: float | None = None,
    process_set: Any = None,
) -> Any:
    """Returns every rank's (process_set: every member's) array concatenated on the first dimension, in rank order."""
    return allgather_async(array, name, priority, process_set).wait(timeout)


def allgather_object(
    obj: Any, name: str | None = None, timeout: float | None = None, process_set: Any = None
) -> list[Any]:
    """Returns the list of every rank's (process_set: every member's) picklable object, in rank order."""
    import numpy as np

    if process_set is not None:
        with _process_sets.scope(process_set):
            return allgather_object(obj, name, timeout)
    payload = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8)
    unnamed = _process_sets.next_unnamed(_api._state.unnamed)
    handle = allgather_async(payload, name or f"allgather_object.unnamed.{unnamed}")
    gathered = bytes(handle.wait(timeout))
    objects, offset = [], 0
    for length in handle.layout_rows():
        objects.append(pickle.loads(gathered[offset : offset + length]))
        offset += length
    return objects


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    timeout: float | None = None,
    process_set: Any = None,
) -> Any:
    """Returns root_rank's (picklable) object on every rank (of process_set): an allgather only the root fills."""
    import numpy as np

    if process_set is not None:
        with _process_sets.scope(process_set):
            return broadcast_object(obj, root_rank, name, timeout)
    root = _submission._integer(root_rank, "root_rank of broadcast_object", "a rank number")
    if root not in _process_sets.ranks():
        raise ValueError(f"root_rank {root} is not a rank of the set; use one of {_process_sets.ranks()}")
    mine = pickle.dumps(obj) if _api.rank() == root else b""
    payload = np.frombuffer(bytearray(mine), dtype=np.uint8)
    unnamed = _process_sets.next_unnamed(_api._state.unnamed)
    gathered = allgather(payload, name or f"broadcast_object.unnamed.{unnamed}", timeout=timeout)
    return obj if _api.rank() == root else pickle.loads(bytes(gathered))


def reducescatter_async(
    array: Any,
    op: str = "sum",
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> OutputHandle:
    """Starts a reducescatter: the reduction (sum or average) of every rank's array, cut on the
    first dimension; rank r keeps part r, the first (rows % size) ranks one row more (as Horovod).
    With process_set, over its members, numbered by their position in the set."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return reducescatter_async(array, op, name, priority, prescale_factor, postscale_factor)
    if prescale_factor == 1.0 and postscale_factor == 1.0:
        handle = _submit_buffer(array, name, "reducescatter", op, priority)
        if handle is not None:
            return handle
    checked = _submission._checked(name, "reducescatter", op, 0, priority)[0]
    scales = _scales(checked, prescale_factor, postscale_factor)
    return _submit_output(array, checked, "reducescatter", op, priority, **scales)


def reducescatter(
    array: Any,
    op: str = "sum",
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    timeout: float | None = None,
    process_set: Any = None,
) -> Any:
    """Returns this rank's part of the reduction of every rank's array (see reducescatter_async)."""
    handle = reducescatter_async(array, op, name, priority, prescale_factor, postscale_factor, process_set)
    return handle.wait(timeout)


def alltoall_async(
    array: Any,
    splits: Sequence[int] | None = None,
    name: str | None = None,
    priority: int = 0,
    process_set: Any = None,
) -> OutputHandle:
    """Starts an alltoall: rows splits[r] of the array go to rank r (equal parts without splits);
    wait() returns (output, received_splits). With process_set, r is a position in the set."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return alltoall_async(array, splits, name, priority)
    checked = _submission._checked(name, "alltoall", "sum", 0, priority)[0]
    array, rows, _ = _rows_and_shape(array, checked)
    size = _process_sets.size()
    try:
        if splits is None:
            if rows % size:
                raise ValueError(
                    f"alltoall of '{checked}': {rows} rows do not split equally over {size} ranks; pass splits="
                )
            counts = [rows // size] * size
        else:
            counts = [_submission._integer(split, f"splits of '{checked}'", "row counts") for split in splits]
            if any(count < 0 for count in counts):
                raise ValueError(f"alltoall of '{checked}': splits {counts} must not be negative")
    except (TypeError, ValueError) as error:
        _submission._refuse(checked, error)
        raise
    return _submit_output(array, checked, "alltoall", "sum", priority, splits=counts)


def alltoall(
    array: Any,
    splits: Sequence[int] | None = None,
    name: str | None = None,
    priority: int = 0,
    timeout: float | None = None,
    process_set: Any = None,
) -> tuple[Any, list[int]]:
    """Returns (output, received_splits): the rows every rank sent here, in rank order."""
    result: tuple[Any, list[int]] = alltoall_async(array, splits, name, priority, process_set).wait(timeout)
    return result


def barrier(name: str | None = None, timeout: float | None = None, process_set: Any = None) -> None:
    """Returns once every rank (of process_set) has called barrier(); it goes through the agreement."""
    if process_set is not None:
        with _process_sets.scope(process_set):
            return barrier(name, timeout)
    name = _process_sets.qualified(name or f"barrier.unnamed.{_process_sets.next_unnamed(_barriers)}")
    core_handle = _core.enqueue(
        name, 0, 0, "uint8", "sum", "barrier", 0, 0, wake_core=True, process_set=_process_sets.current()
    )
    _api.Handle(core_handle, None, None).wait(timeout)


def join(timeout: float | None = None) -> int:
    """Marks this rank out of data (Horovod's join) and returns the last rank to join, once every rank has.

    Until then this rank takes part in the other ranks' allreduces with zeros (op="average" still
    divides by every rank) and barriers; as in Horovod, allgather, broadcast, reducescatter and
    alltoall fail on every rank that asked for them while a rank has joined. The same holds for the
    collectives of every process set this rank is a member of. Of ranks joining in the same agreement
    round, the highest counts as last. Afterwards every rank may go on (a new epoch).
    """
    if _api._state.pending is not None:
        _api._start_pending(False)  # a joined rank contributes from host memory
    core_handle = _core.join()
    _api.Handle(core_handle, None, None).wait(timeout)
    return int(_core.last_joined_rank())


def grouped_allreduce_async(
    arrays: Sequence[Any],
    name: str | None = None,
    priority: int = 0,
    op: str = "sum",
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> GroupHandle:
    """Starts in-place allreduces of several arrays that every rank (of process_set) agrees on and
    launches together (one fused launch when they fit the fusion size). Every rank passes the same
    number of arrays: another length on one rank fails every rank's call at once, naming the lengths."""
    from commsched import buffers

    if process_set is not None:
        with _process_sets.scope(process_set):
            return grouped_allreduce_async(arrays, name, priority, op, prescale_factor, postscale_factor)

    base, _, priority = _submission._checked(name, "grouped_allreduce", op, 0, priority)
    names = [f"{base}.{index}" for index in range(len(arrays))]
    scales = _scales(base, prescale_factor, postscale_factor)
    members, views = [], []
    for member_name, array in zip(names, arrays):
        try:
            view = buffers.view(array, member_name)
            if _api._state.settings is not None:
                _submission._check_memory(view, member_name, _api._state.device_memory)
        except (TypeError, ValueError) as error:
            for other in names:
                _submission._refuse(other, error)
            raise
        views.append(view)
        members.append(
            (
                member_name,
                view.address,
                view.count,
                view.dtype,
                view.owner,
                view.on_gpu,
                -1 if view.device is None else view.device,
                view.stream,
            )
        )
    core_handles = _core.enqueue_group(
        members, _submission._op_name(op), priority, **scales, process_set=_process_sets.current()
    )
    return GroupHandle([_api.Handle(h, a, v) for h, a, v in zip(core_handles, arrays, views)])


def grouped_allreduce(
    arrays: Sequence[Any],
    name: str | None = None,
    priority: int = 0,
    op: str = "sum",
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    timeout: float | None = None,
    process_set: Any = None,
) -> list[Any]:
    """Allreduces several arrays in place, together; returns them."""
    handle = grouped_allreduce_async(
        arrays, name, priority, op, prescale_factor, postscale_factor, process_set
    )
    return handle.wait(timeout)


def local_size() -> int:
    """The number of ranks on this host (found once, at init())."""
    if not _api._state.initialized_here():
        _api.size()  # raises the not-initialised error
    return _api._state.local_size


def cross_size() -> int:
    """The number of hosts (ranks of the same local rank across hosts), as Horovod counts them."""
    local = local_size()
    return max(1, _api.size() // local)


def cross_rank() -> int:
    """This host's index among the hosts."""
    return _api.rank() // local_size()


def mpi_built() -> bool:
    """True when commsched was built with its MPI transport."""
    return importlib.util.find_spec("commsched._mpi") is not None


def gloo_built() -> bool:
    """True when the Gloo transport can run here (PyTorch with its Gloo backend)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> bool:
    """True when commsched's NCCL transport is built (NCCL itself loads when chosen)."""
    return importlib.util.find_spec("commsched._nccl") is not None


def mpi_enabled() -> bool:
    """True from init() on the MPI transport to this rank's own shutdown()."""
    # Not is_initialized(): that turns false when a peer shuts down first, and as in Horovod the
    # answer must not change under a rank still finishing its own work.
    return _api._state.started_on("mpi")
