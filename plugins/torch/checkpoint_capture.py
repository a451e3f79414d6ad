"""Lazy capture of one version: each parameter's bytes are copied before its next update.

A *unit* is what must be copied together before one parameter is updated again: this
rank's pieces of the parameter and of its optimizer state. Units become *ready* once the
update that still belongs to the version is applied (overlap mode: the one the next forward
applies), are copied by the background thread while training goes on, and whatever the
background has not reached when the next update comes is copied right there, on the
training thread, before the update. Copies go into one reused host buffer per rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commsched.torch import _counter
from commsched.torch.checkpoint_format import Piece

import torch
from commsched import _core

# commsched._torch_hooks, built for this torch (None: the Python tests and addresses below).
_NATIVE = _counter.native()

WAITING, READY, COPYING, DONE = range(4)


@dataclass(eq=False)
class Copy:
    """One piece: where its bytes come from (looked up when copied, under torch.no_grad(): a source
    needs no detach()) and where they go (shaped as the piece)."""

    piece: Piece
    source: Callable[[], torch.Tensor]
    destination: torch.Tensor
    # (start, count): the piece is these elements of the source's flattened contents, which the copy
    # takes without building a view (a cut over ranks: a reshape and a slice cost microseconds each).
    flat: tuple[int, int] | None = None
    whole: bool = field(init=False)  # the piece is the whole tensor (or its flat range)

    def __post_init__(self) -> None:
        self.whole = self.piece.whole
        if self.flat is not None and not (self.whole and self.flat[1] == self.destination.numel()):
            raise ValueError(
                f"checkpoint: '{self.piece.name}': a flat range of {self.flat[1]} elements goes into a whole "
                f"piece of as many, not into {self.destination.numel()} elements (whole piece: {self.whole})"
            )


@dataclass(eq=False)
class Unit:
    """Copies that must happen before `param`'s next update (param None: copied at save())."""

    param: torch.Tensor | None
    copies: list[Copy] = field(default_factory=list)
    waits: int = 0  # updates still to be applied that belong to the version
    state: int = READY
    on_copied: Callable[[], None] | None = None  # e.g. rank 0 keeps the non-tensor optimizer state
    ready_event: Any = None  # CUDA: the point on the compute stream the copy must follow
    copied_event: Any = None  # CUDA: the point after an inline copy, waited for before writing


def _taken(copy: Copy, tensor: torch.Tensor) -> torch.Tensor:
    """The part of the source `tensor` that `copy` takes, checked against its piece."""
    if copy.flat is not None:
        start, count = copy.flat
        tensor = tensor.reshape(-1)[start : start + count]
    return _check(copy, tensor)


def _check(copy: Copy, tensor: torch.Tensor) -> torch.Tensor:
    entry = copy.piece.entry
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise RuntimeError(
            f"checkpoint: '{entry.key}' changed from {entry.dtype} {list(entry.shape)} to {tensor.dtype} "
            f"{list(tensor.shape)} between save() and its capture; change the model or optimizer only "
            "after wait()"
        )
    return tensor if copy.piece.whole else tensor[copy.piece.start : copy.piece.stop]


class Capture:
    """The units of one save() and their progress, shared by the training and background threads."""

    def __init__(self, units: list[Unit]) -> None:
        self._cond = threading.Condition()
        self._units = units
        self._by_param = {id(u.param): u for u in units if u.param is not None}
        self._left = sum(1 for u in units if u.state != DONE)
        self.inline_copies = 0  # units the training thread had to copy itself (diagnostics)
        self.error: BaseException | None = None
        # Called once by whichever thread copies the last unit, before it goes on (e.g. to the update),
        # or by when_done() itself when nothing is left to copy.
        self._on_done: Callable[[], None] | None = None
        self._streams: dict[torch.device, Any] = {}
        for unit in units:
            if unit.state == READY:
                _mark_ready(unit)

    # -- training thread ---------------------------------------------------------------------
    def when_done(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once every unit is copied: now, if none is left (a rank whose part of every
        tensor is empty has nothing to copy, and no copy would ever call it)."""
        with self._cond:
            if self._left or self.error is not None:
                self._on_done = callback
                return
        callback()

    def copy_now(self, unit: Unit) -> None:
        """Copies a unit on the calling thread (save() uses it for buffers and extras)."""
        with self._cond:
            if unit.state == DONE:
                return
            unit.state = COPYING
        self._copy(unit, background=False)

    def before_update(self, params: list[torch.Tensor]) -> None:
        """Copies (or waits for the copy of) every listed parameter that is about to leave the version."""
        for param in params:
            unit = self._by_param.get(id(param))
            if unit is None:
                continue
            with self._cond:
                if unit.state == DONE or unit.waits > 0:
                    continue  # done, or this update still belongs to the version
                while unit.state == COPYING:
                    self._cond.wait()
                if unit.state == DONE:
                    continue
                unit.state = COPYING
                self.inline_copies += 1
            self._copy(unit, background=False)

    def after_update(self, params: list[torch.Tensor]) -> None:
        """Marks parameters whose last update belonging to the version is now applied."""
        with self._cond:
            for param in params:
                unit = self._by_param.get(id(param))
                if unit is not None and unit.waits > 0:
                    unit.waits -= 1
                    if unit.waits == 0:
                        unit.state = READY
                        _mark_ready(unit)
                        self._cond.notify_all()

    def waiting(self) -> bool:
        """True while some unit waits for an update that belongs to the version."""
        with self._cond:
            return any(u.state == WAITING for u in self._units)

    # -- background thread -------------------------------------------------------------------
    def run(self) -> None:
        """Copies ready units until every unit is done (returns early if a copy failed)."""
        while True:
            with self._cond:
                while True:
                    ready = [u for u in self._units if u.state == READY]
                    if ready or self.error is not None or not self._left:
                        break
                    self._cond.wait()
                if self.error is not None or not self._left:
                    break
                for unit in ready:
                    unit.state = COPYING
            on_host = [u for u in ready if u.ready_event is None]
            if on_host:
                self._copy_together(on_host)
            for unit in ready:
                if unit.ready_event is not None:
                    self._copy(unit, background=True)
        if self.error is not None:
            raise self.error
        for unit in self._units:  # inline CUDA copies were queued on the compute stream
            if unit.copied_event is not None:
                unit.copied_event.synchronize()

    def _copy(self, unit: Unit, background: bool) -> None:
        try:
            if background and unit.ready_event is not None:
                self._copy_on_side_stream(unit)
            else:
                self._copy_here(unit)
            if unit.on_copied is not None:
                unit.on_copied()
        except BaseException as error:
            with self._cond:
                self.error = error
                unit.state = DONE
                self._left -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            unit.state = DONE
            self._copied(1)

    def _copy_together(self, units: list[Unit]) -> None:
        """Copies host units together: one lock and wake-up per batch, not per unit."""
        try:
            copies: list[Copy] = []
            sources: list[torch.Tensor] = []
            starts: list[int] = []
            destinations: list[torch.Tensor] = []
            with torch.no_grad():
                for unit in units:
                    for copy in unit.copies:
                        # A whole piece's source goes as it is: _copy_plain compares its dtype and
                        # shape (or range) with the destination's and leaves a mismatch in `rest`,
                        # where _taken raises naming it.
                        source = copy.source()
                        if copy.whole:
                            sources.append(source)
                            starts.append(-1 if copy.flat is None else copy.flat[0])
                        else:
                            sources.append(_check(copy, source))
                            starts.append(-1)
                        destinations.append(copy.destination)
                        copies.append(copy)
                rest = _copy_plain(destinations, sources, starts)
                taken = [_taken(copies[i], sources[i]) if copies[i].whole else sources[i] for i in rest]
                if any(source.is_cuda for source in taken):  # device sources are ordered per unit
                    for unit in units:
                        self._copy_here(unit)
                elif rest:
                    torch._foreach_copy_([destinations[i] for i in rest], taken)
            for unit in units:
                if unit.on_copied is not None:
                    unit.on_copied()
        except BaseException as error:
            with self._cond:
                self.error = error
                self._finish(units)
            raise
        with self._cond:
            self._finish(units)

    def _finish(self, units: list[Unit]) -> None:
        """Marks copied units done (the condition's lock held)."""
        for unit in units:
            unit.state = DONE
        self._copied(len(units))

    def _copied(self, count: int) -> None:
        """Counts units copied (the condition's lock held); the last one calls on_done."""
        self._left -= count
        if not self._left and self.error is None and self._on_done is not None:
            self._on_done()
        self._cond.notify_all()

    def _copy_here(self, unit: Unit) -> None:
        cuda = False
        with torch.no_grad():
            sources = [_taken(copy, copy.source().detach()) for copy in unit.copies]
            cuda = any(source.is_cuda for source in sources)
            if cuda:
                for copy, source in zip(unit.copies, sources, strict=True):
                    copy.destination.copy_(source, non_blocking=source.is_cuda)
            else:
                _copy_on_host([copy.destination for copy in unit.copies], sources)
        if cuda:  # ordered before the update on the same stream; the writer waits for it
            unit.copied_event = torch.cuda.Event()
            unit.copied_event.record()

    def _copy_on_side_stream(self, unit: Unit) -> None:
        assert unit.param is not None
        device = unit.param.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        with torch.no_grad(), torch.cuda.stream(stream):
            stream.wait_event(unit.ready_event)
            for copy in unit.copies:
                copy.destination.copy_(_taken(copy, copy.source().detach()), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # DONE is set only after this, so the next update never needs to wait on the GPU for it.
        done.synchronize()


def _copy_on_host(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Host copies of checked sources: plain pairs in one call with the GIL released, torch for the rest."""
    rest = _copy_plain(destinations, sources)
    if rest:
        torch._foreach_copy_([destinations[i] for i in rest], [sources[i] for i in rest])


def _copy_plain(
    destinations: list[torch.Tensor], sources: list[torch.Tensor], starts: list[int] | None = None
) -> list[int]:
    """Copies every pair that is dense host memory of one dtype and shape, with stores that bypass the
    cache (nothing reads a capture until a restore: 10 MiB into shared memory took 0.8 ms of CPU time
    against 1.25 with memmove and 1.5 with torch); returns the indices of the other pairs. A start of 0
    or more copies the destination's count of the source's elements from there instead (any shape)."""
    starts = starts or [-1] * len(sources)
    if _NATIVE is not None:  # the tests in C++: at 1,600 tensors they cost more in Python than the copies
        return _NATIVE.copy_tensors_bypassing_cache(destinations, sources, starts)
    plain: list[tuple[int, int, int]] = []
    rest: list[int] = []
    # The cheapest tests first.
    for i, (destination, source, start) in enumerate(zip(destinations, sources, starts, strict=True)):
        if (
            source.is_cpu
            and destination.is_cpu
            and destination.dtype == source.dtype
            and destination.layout == source.layout == torch.strided
            and source.is_contiguous()
            and destination.is_contiguous()
            and not (source.is_conj() or source.is_neg())
            and (
                destination.shape == source.shape
                if start < 0
                else start + destination.numel() <= source.numel()
            )
        ):
            offset = max(start, 0) * source.element_size()
            plain.append((destination.data_ptr(), source.data_ptr() + offset, destination.nbytes))
        else:
            rest.append(i)
    if plain:
        _core.copy_bypassing_cache(plain)
    return rest


def _mark_ready(unit: Unit) -> None:
    """CUDA: remembers where the compute stream is, so a side-stream copy follows the last update."""
    if unit.param is not None and unit.param.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(unit.param.device))
        unit.ready_event = event
