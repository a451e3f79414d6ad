"""Horovod's asynchronous collectives on torch tensors, each one scheduled by the commsched core.

    handle = hvd.allreduce_async(tensor, name="loss", op=hvd.Sum)
    ...
    reduced = hvd.synchronize(handle)          # hvd.poll(handle) says whether it is done

Names: Horovod prefixes a collective's name with its kind ("allreduce.loss"), and numbers
unnamed ones in call order ("allreduce.noname.3"), which then must match across ranks.
Tensors that are not contiguous, or whose bytes must move to the transport's device, travel
as a copy that is written back; the inputs of the out-of-place forms are never modified.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from commsched.torch import _wire

import torch
from commsched import HorovodInternalError, _horovod  # noqa: F401  (Horovod's mpi_ops has it too)
from commsched._horovod import global_process_set

_basics = _horovod  # Horovod's mpi_ops holds its basics under this name (tests read it)

_unnamed = itertools.count()


class Handle:
    """A collective in flight; synchronize(handle) returns its result, poll(handle) says if it is done."""

    def __init__(self, done: Callable[[], bool], finish: Callable[[], Any]) -> None:
        self._done = done
        self._finish = finish
        self._finished = False
        self._waited = False  # wait() was called, even one that raised: its name is free again
        self._result: Any = None

    def done(self) -> bool:
        """True once the collective finished (or failed)."""
        return self._finished or bool(self._done())

    def wait(self) -> Any:
        """Waits and returns the result (the same object on every later call)."""
        if not self._finished:
            try:
                self._result = self._finish()
            finally:
                self._waited = True
            self._finished = True
        return self._result


# Named collectives not synchronized yet: name -> (handle, when it was submitted). The core refuses
# a name only while its collective is in flight, and on a fast link that can end before the caller's
# next line submits the name again; in Horovod a background cycle lies between the two, so that
# resubmission fails. A name therefore stays taken until synchronize(), or, for a handle that is
# never synchronized, until its collective is done and HOLD_S have passed since it was submitted.
_named_in_flight: dict[str, tuple[Handle, float]] = {}
HOLD_S = 1.0


def _free_name(core_name: str, named: bool) -> str:
    """`core_name`, after checking that no collective of this name is still in flight."""
    if not named:
        return core_name
    now = time.monotonic()
    for held_name, (held, since) in list(_named_in_flight.items()):
        if held._waited or (now - since > HOLD_S and held.done()):
            del _named_in_flight[held_name]
    if core_name in _named_in_flight:
        raise ValueError(
            f"tensor name '{core_name}' is already in flight (its handle was not synchronized); "
            "synchronize it before submitting the name again, or give this one another name"
        )
    return core_name


def _remember(core_name: str, named: bool, handle: Handle) -> Handle:
    if named:
        _named_in_flight[core_name] = (handle, time.monotonic())
    return handle


def synchronize(handle: Handle) -> Any:
    """Waits for an asynchronous collective and returns its result."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() takes a handle from a commsched.torch *_async call, not {handle!r}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when synchronize(handle) would return without waiting."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() takes a handle from a commsched.torch *_async call, not {handle!r}")
    return handle.done()


def op_name(kind: str, name: str | None) -> str:
    """The core's name for a collective: Horovod's "<kind>.<name>", or "<kind>.noname.<n>" in call order."""
    if name is None:
        return f"{kind}.noname.{next(_unnamed)}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string or None, not {name!r}")
    return f"{kind}.{name}"


def _started(tensor: torch.Tensor) -> torch.device:
    """Starts commsched if the script did not (on the tensor's GPU for a CUDA tensor); the wire's device."""
    _wire.ensure_initialized(None, _wire.cuda_device_name([tensor]))
    return _wire.wire_device([tensor])


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{what} takes a dense tensor; send a sparse one's indices and values (allgather)")
    return tensor


# -- allreduce -----------------------------------------------------------------------------------
def integer_average(
    op: str, dtype: torch.dtype, postscale_factor: float, process_set: Any
) -> tuple[str, float]:
    """Horovod's integer average: a sum scaled by postscale/size, each value truncated toward zero.

    Horovod averages by folding 1/size into the postscale factor, and a scaled integer is cast back
    (rounded toward zero), so -75 averaged over 2 ranks is -37 there, not the floor -38.
    """
    integral = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return _horovod.integer_average(op, integral, postscale_factor, process_set)


def _allreduce_into(
    target: torch.Tensor,
    name: str | None,
    op: str,
    prescale_factor: float,
    postscale_factor: float,
    process_set: Any,
    source: torch.Tensor,
) -> Handle:
    device = _started(source)  # the caller's tensor says where it lives (a copy may not)
    if op == _horovod.Adasum:
        from commsched import adasum

        return Handle(
            *adasum.start_torch(
                target, source, op_name("allreduce", name), prescale_factor, postscale_factor, process_set
            )
        )
    op, postscale_factor = integer_average(op, target.dtype, postscale_factor, process_set)
    core_name = _free_name(op_name("allreduce", name), name is not None)
    out = _wire.start_allreduce(
        target,
        core_name,
        0,
        op,
        device=device,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        ranks=_horovod.set_size(process_set),
        **_horovod.core_arguments(process_set),
    )
    return _remember(core_name, name is not None, Handle(out.work.done, out.finish))


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Starts averaging (or op-reducing) `tensor` over all ranks into a new tensor; the input stays as is."""
    op = _horovod.resolve_op(op, average, adasum=True)
    output = _check_tensor(tensor, "allreduce_async").detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_into(output, name, op, prescale_factor, postscale_factor, process_set, tensor)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Starts averaging (or op-reducing) `tensor` over all ranks in place."""
    op = _horovod.resolve_op(op, average, adasum=True)
    target = _check_tensor(tensor, "allreduce_async_").detach()
    return _allreduce_into(target, name, op, prescale_factor, postscale_factor, process_set, tensor)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Averages (or op-reduces) `tensor` over all ranks in place and returns it."""
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    synchronize(handle)
    return tensor


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Starts reducing several tensors into new ones, admitted together on every rank."""
    outputs = [_check_tensor(t, "grouped_allreduce_async").detach().clone() for t in tensors]
    return grouped_allreduce_async_(
        outputs, average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Starts reducing several tensors in place, admitted together on every rank (one launch when they fit)."""
    op = _horovod.resolve_op(op, average)
    targets = [_check_tensor(t, "grouped_allreduce_async_").detach() for t in tensors]
    if not targets:
        return Handle(lambda: True, list)
    device = _started(targets[0])
    wires = [t.to(device).contiguous() for t in targets]
    for wire in wires:
        if wire.dtype not in _wire._CORE_DTYPES:
            raise TypeError(f"grouped_allreduce cannot send {wire.dtype} tensors")
    if all(not w.dtype.is_floating_point and w.dtype != torch.bool for w in wires):
        op, postscale_factor = integer_average(op, wires[0].dtype, postscale_factor, process_set)
    group = _horovod._core("grouped_allreduce_async")(
        wires,
        name=op_name("grouped_allreduce", name),
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        **_horovod.core_arguments(process_set),
    )

    def finish() -> list[torch.Tensor]:
        group.wait()
        for target, wire in zip(targets, wires):
            if wire is not target:
                target.copy_(wire)
        return list(tensors)

    return Handle(group.done, finish)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """Reduces several tensors in place, together, and returns them."""
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return synchronize(handle)  # type: ignore[no-any-return]


# -- broadcast -----------------------------------------------------------------------------------
def _broadcast_into(
    target: torch.Tensor, root_rank: int, name: str | None, process_set: Any, source: torch.Tensor
) -> Handle:
    device = _started(source)
    core_name = _free_name(op_name("broadcast", name), name is not None)
    out = _wire.start_broadcast(target, core_name, root_rank, device, **_horovod.core_arguments(process_set))
    return _remember(core_name, name is not None, Handle(out.work.done, out.finish))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Starts copying root_rank's `tensor` into a new tensor on every rank; the input stays as is."""
    output = _check_tensor(tensor, "broadcast_async").detach().clone(memory_format=torch.contiguous_format)
    return _broadcast_into(output, root_rank, name, process_set, tensor)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Starts overwriting `tensor` with root_rank's values, in place."""
    target = _check_tensor(tensor, "broadcast_async_").detach()
    return _broadcast_into(target, root_rank, name, process_set, tensor)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Overwrites `tensor` with root_rank's values and returns it."""
    synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return tensor


# -- collectives with a new output ---------------------------------------------------------------
def _output_wire(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor as the core takes it for a collective with an output: contiguous, on the wire's device
    (a CUDA tensor stays on its GPU under NCCL; the result then comes back there too)."""
    device = _started(tensor)
    if tensor.dtype not in _wire._CORE_DTYPES:
        raise TypeError(f"{what} cannot send {tensor.dtype} tensors")
    return tensor.detach().to(device).contiguous()


def _like(result: Any, tensor: torch.Tensor) -> torch.Tensor:
    """A core result as a torch tensor of `tensor`'s dtype."""
    out = result if isinstance(result, torch.Tensor) else torch.as_tensor(result)
    return (
        out.view(tensor.dtype)
        if out.dtype != tensor.dtype and out.element_size() == tensor.element_size()
        else out
    )


class Gathered:
    """Result of an allgather: the tensor, and the rows each rank gave (for gradients)."""

    def __init__(self, tensor: torch.Tensor, rows: list[int]) -> None:
        self.tensor = tensor
        self.rows = rows


def allgather_rows(tensor: torch.Tensor, name: str | None, process_set: Any) -> Handle:
    """Starts an allgather whose result is a Gathered (tensor and rows per rank)."""
    return _allgather_named(_check_tensor(tensor, "allgather"), op_name("allgather", name), process_set)


def _allgather_named(tensor: torch.Tensor, core_name: str, process_set: Any) -> Handle:
    wire = _output_wire(tensor, "allgather")
    shape = tensor.shape
    if wire.dim() == 0:
        wire = wire.reshape(1)
    work = _horovod._core("allgather_async")(wire, name=core_name, **_horovod.core_arguments(process_set))

    def finish() -> Gathered:
        gathered = _like(work.wait(), tensor)
        if len(shape) == 0:
            gathered = gathered.reshape(-1)
        return Gathered(gathered, list(work.layout_rows()))

    return Handle(work.done, finish)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Starts concatenating every rank's `tensor` on the first dimension (which may differ between ranks)."""
    inner = allgather_rows(tensor, name, process_set)
    return Handle(inner.done, lambda: inner.wait().tensor)


def reducescatter_parts(
    tensor: torch.Tensor,
    name: str | None,
    op: str,
    process_set: Any,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    core_name: str | None = None,
) -> Any:
    """Starts a reducescatter on the core; the core's handle (wait() returns this rank's part)."""
    wire = _output_wire(_check_tensor(tensor, "reducescatter"), "reducescatter")
    if wire.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension to cut")
    return _horovod._core("reducescatter_async")(
        wire,
        op=op,
        name=core_name or op_name("reducescatter", name),
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        **_horovod.core_arguments(process_set),
    )


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = _horovod.Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Starts reducing every rank's `tensor` and cutting the result on the first dimension: rank r gets part r.

    The first (rows % size) ranks get one row more, as in Horovod.
    """
    op = _checked_reducescatter_op(op)
    work = reducescatter_parts(tensor, name, op, process_set, prescale_factor, postscale_factor)
    return Handle(work.done, lambda: _like(work.wait(), tensor))


def _group_names(kind: str, name: str | None, count: int) -> list[str]:
    """One core name per member of a group: "<kind>.<name>.<i>", unnamed groups numbered once per call."""
    base = op_name(kind, name)
    return [f"{base}.{i}" for i in range(count)]


def _grouped(handles: list[Handle]) -> Handle:
    """One handle over several: done when all are, its result the list of theirs."""
    return Handle(lambda: all(h.done() for h in handles), lambda: [h.wait() for h in handles])


def grouped_allgather_rows(tensors: Sequence[torch.Tensor], name: str | None, process_set: Any) -> Handle:
    """Starts an allgather of each tensor; synchronize() returns a Gathered per tensor."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    names = _group_names("grouped_allgather", name, len(tensors))
    # Every member is checked before any starts, so a bad one leaves nothing half-launched.
    checked = [_check_tensor(t, "grouped_allgather") for t in tensors]
    return _grouped([_allgather_named(t, n, process_set) for t, n in zip(checked, names)])


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Starts allgather_async on each tensor, as one group; synchronize() returns the list of results."""
    inner = grouped_allgather_rows(tensors, name, process_set)
    return Handle(inner.done, lambda: [g.tensor for g in inner.wait()])


def _checked_reducescatter_op(op: Any) -> str:
    op = _horovod.resolve_op(op)
    if op not in (_horovod.Average, _horovod.Sum):
        raise ValueError(f"reducescatter takes op=hvd.Average or hvd.Sum, not {op!r}")
    return op


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = _horovod.Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Starts reducescatter_async on each tensor, as one group; synchronize() returns the list of parts."""
    op = _checked_reducescatter_op(op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_reducescatter needs at least one tensor")
    for tensor in tensors:
        if _check_tensor(tensor, "grouped_reducescatter").dim() == 0:
            raise ValueError("grouped_reducescatter needs tensors with at least one dimension to cut")
    names = _group_names("grouped_reducescatter", name, len(tensors))
    handles = []
    for tensor, core_name in zip(tensors, names):
        work = reducescatter_parts(
            tensor, None, op, process_set, prescale_factor, postscale_factor, core_name=core_name
        )
        handles.append(Handle(work.done, lambda work=work, tensor=tensor: _like(work.wait(), tensor)))
    return _grouped(handles)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: Any = global_process_set
) -> Callable[[], torch.Tensor]:
    """Starts reducing a sparse tensor as Horovod does (allgather of indices and values); call the result.

    The returned function waits and gives the sparse sum (or average) of every rank's tensor,
    uncoalesced: entries of the same index from several ranks stay separate, as in Horovod.
    """
    op = _checked_reducescatter_op(op)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(
            "sparse_allreduce_async takes a sparse COO tensor; use allreduce_async for a dense one"
        )
    size = _horovod.set_size(process_set)
    # Allgather concatenates rows, so the indices travel transposed (one row per entry).
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices", process_set)
    values = allgather_async(tensor._values(), f"{name}.values", process_set)

    def result() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == _horovod.Average:
            gathered_values = gathered_values / size
        # The ranks' indices were valid where they came from; checking them again costs a pass per call
        # (and, left implicit, torch warns on every call).
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1), gathered_values, tensor.size(), check_invariants=False
        )

    return result


class SplitsTypeError(TypeError, ValueError):
    """Alltoall splits of the wrong type: a TypeError, and the ValueError Horovod raises for them."""


def _split_counts(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.dim() != 1:
            raise SplitsTypeError(
                f"alltoall splits must be a 1-d integer tensor or a list of ints, not {splits!r}"
            )
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


def alltoall_parts(tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Handle:
    """Starts an alltoall; synchronize() returns (output, received splits as an int32 tensor)."""
    wire = _output_wire(_check_tensor(tensor, "alltoall"), "alltoall")
    if wire.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension to split")
    work = _horovod._core("alltoall_async")(
        wire,
        splits=_split_counts(splits),
        name=op_name("alltoall", name),
        **_horovod.core_arguments(process_set),
    )

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        output, received = work.wait()
        return _like(output, tensor), torch.tensor(list(received), dtype=torch.int32)

    return Handle(work.done, finish)


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Starts sending rows splits[r] of `tensor` to rank r (equal parts without splits); see alltoall()."""
    return alltoall_parts(tensor, splits, name, process_set)


# -- synchronisation -----------------------------------------------------------------------------
def barrier(process_set: Any = global_process_set) -> None:
    """Returns once every rank (of the set) has called barrier()."""
    _wire.ensure_initialized()
    _horovod._core("barrier")(**_horovod.core_arguments(process_set))


def join(device: int = -1) -> int:
    """Marks this rank done with its data; returns, once every rank joined, the rank that joined last.

    Until then this rank takes part in the other ranks' allreduces with zeros, as in Horovod.
    """
    _wire.ensure_initialized()
    return int(_horovod._core("join")())


def _object_name(obj: Any, name: str | None) -> str:
    """Horovod's default name for an object collective: the object's type name.

    Not a call-order number: a rank that joined skipped the others' unnamed collectives, so its
    count would differ and the names would never meet.
    """
    return type(obj).__name__ if name is None else name


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Returns root_rank's (picklable) object on every rank."""
    _wire.ensure_initialized()
    return _horovod._core("broadcast_object")(
        obj, root_rank, name=op_name("broadcast_object", name), **_horovod.core_arguments(process_set)
    )


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Returns the list of every rank's (picklable) object, in rank order."""
    _wire.ensure_initialized()
    return list(
        _horovod._core("allgather_object")(
            obj,
            name=op_name("allgather_object", _object_name(obj, name)),
            **_horovod.core_arguments(process_set),
        )
    )
