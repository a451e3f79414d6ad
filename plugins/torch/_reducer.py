"""Gradient reduction for one optimizer: hand each gradient over when ready, settle it later.

Every rank must submit the same names, so an iteration is *closed* deterministically (by
step() or synchronize()): trainable parameters that got no gradient on this rank are
submitted as zeros, and a small "used" count per parameter is summed across ranks, so a
parameter that no rank used keeps its gradient untouched (DDP's find_unused_parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commsched.torch import _guard, _wire

import torch


@dataclass(eq=False)
class _Record:
    """One parameter's reduction in flight for one iteration."""

    out: _wire.Outgoing
    used: bool  # this rank produced a gradient; otherwise `out.target` is a zeros scratch
    iteration: int
    guard: torch.Tensor | None = None
    sparse: bool = False  # the gradient was sparse: `out.target` is its dense copy


@dataclass(eq=False)
class Slot:
    """A parameter the optimizer owns, with its wire name and priority."""

    param: torch.Tensor
    label: str
    index: int
    group: int
    priority: int
    passes: int = 0
    record: _Record | None = None


@dataclass(eq=False)
class _Mask:
    counts: torch.Tensor
    out: _wire.Outgoing
    done: bool = False


@dataclass
class ReducerOptions:
    """How gradients are reduced."""

    prefix: str
    op: str = "average"
    backward_passes_per_step: int = 1
    wire_dtype: torch.dtype | None = None
    overlap: bool = False
    # Where the used counts travel: the parameters' device (a GPU under NCCL, else the CPU).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: float | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    ranks: int | None = None  # ranks that average (a process set's size); None: all
    core: dict[str, Any] = field(default_factory=dict)  # further arguments for commsched (process_set)
    sparse_as_dense: bool = False  # sparse gradients come back dense (else sparse again)


class Reducer:
    """Submits gradients from post-accumulate-grad hooks and settles them in barrier or overlap mode."""

    def __init__(
        self,
        slots: list[Slot],
        options: ReducerOptions,
        apply: Callable[[list[Slot]], None],
        overlap_error: Callable[[str], Exception],
    ) -> None:
        self.slots = slots
        self.options = options
        self._apply = apply  # overlap mode: runs the optimizer on these slots' parameters
        self._overlap_error = overlap_error
        self._by_id = {id(s.param): s for s in slots}
        self._order = sorted(slots, key=lambda s: (s.priority, s.index))
        self._iteration = 0
        self._closed = False  # the current iteration's submissions are complete
        self._masks: dict[int, _Mask] = {}
        self._hooks: dict[int, Any] = {}
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        # Frozen parameters cannot carry hooks; one unfrozen later is hooked when the iteration closes.
        for slot in self.slots:
            if slot.param.requires_grad and slot.index not in self._hooks:
                self._hooks[slot.index] = slot.param.register_post_accumulate_grad_hook(self._on_grad)

    # -- priorities -------------------------------------------------------------------------
    def set_priorities(self, order: list[torch.Tensor]) -> None:
        """Priority = position of first use in the forward pass; unreached parameters come after."""
        position = {id(p): i for i, p in enumerate(order)}
        for slot in self.slots:
            slot.priority = position.get(id(slot.param), len(order) + slot.index)
        self._order = sorted(self.slots, key=lambda s: (s.priority, s.index))

    # -- submission -------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        slot = self._by_id[id(param)]
        self._closed = False
        slot.passes += 1
        if slot.passes >= self.options.backward_passes_per_step:
            self._submit(slot, used=True)

    def _submit(self, slot: Slot, used: bool) -> None:
        if slot.record is not None:
            raise RuntimeError(
                f"commsched.torch: gradient of '{slot.label}' became ready again while its previous "
                f"reduction is in flight; call optimizer.step() after every "
                f"{self.options.backward_passes_per_step} backward pass(es), or set backward_passes_per_step"
            )
        param = slot.param
        sparse = False
        if used:
            grad = param.grad
            if isinstance(grad, _guard.InFlightGrad):
                grad = grad.as_subclass(torch.Tensor)
            elif grad is not None and grad.is_sparse:
                # Embedding(sparse=True): reduced densely (every rank submits the same shape), given back
                # sparse unless sparse_as_dense. The sparse .grad stays readable meanwhile.
                grad, sparse = grad.to_dense(), True
        else:
            grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        options = self.options
        out = _wire.start_allreduce(
            grad,
            options.prefix + slot.label,
            slot.priority,
            options.op,
            options.wire_dtype,
            prescale_factor=options.prescale,
            postscale_factor=options.postscale,
            ranks=options.ranks,
            **options.core,
        )
        record = _Record(out, used, self._iteration, sparse=sparse)
        if used and not sparse:
            record.guard = _guard.guard(grad, slot.label, self._on_touch)
            param.grad = record.guard
        slot.record = record

    def close(self) -> None:
        """Ends the iteration: zeros for trainable parameters with no gradient here, then the used counts."""
        if self._closed:
            return
        self.settle_previous()
        counts = torch.zeros(len(self.slots), dtype=torch.int32)
        for slot in self._order:
            if slot.record is None and slot.param.requires_grad:
                unhooked = slot.index not in self._hooks  # unfrozen since: its gradient is unseen
                used = (slot.passes > 0 or unhooked) and slot.param.grad is not None
                self._submit(slot, used=used)
            if slot.record is not None and slot.record.used:
                counts[slot.index] = 1
            slot.passes = 0
        self._hook_trainable()
        # The previous iteration's counts are long done by now; their name is about to be reused.
        self.finish_masks()
        name = f"{self.options.prefix}used"
        counts = counts.to(self.options.device)
        self._masks[self._iteration] = _Mask(
            counts, _wire.start_allreduce(counts, name, -1, "sum", **self.options.core)
        )
        self._iteration += 1
        self._closed = True

    # -- settling ---------------------------------------------------------------------------
    def _used_anywhere(self, record: _Record, slot: Slot) -> bool:
        if record.used:
            return True
        mask = self._masks[record.iteration]
        if not mask.done:
            mask.out.finish(self.options.timeout)
            mask.counts = mask.counts.cpu()  # one copy, not one device read per parameter
            mask.done = True
        return bool(mask.counts[slot.index] > 0)

    def _finish(self, slot: Slot) -> tuple[torch.Tensor | None, bool]:
        """Waits for a slot's reduction; returns (gradient to use, whether to replace .grad)."""
        record = slot.record
        assert record is not None
        reduced = record.out.finish(self.options.timeout)
        slot.record = None
        if record.guard is not None:
            _guard.release(record.guard)
        if record.sparse and not self.options.sparse_as_dense:
            reduced = reduced.to_sparse()
        if self._used_anywhere(record, slot):
            return reduced, True
        return None, False

    def settle(self, params: list[torch.Tensor]) -> None:
        """Overlap mode: finishes these parameters' closed reductions and applies their updates."""
        ready = []
        for param in params:
            slot = self._by_id.get(id(param))
            if slot is not None and slot.record is not None and slot.record.iteration < self._iteration:
                ready.append(slot)
        if ready:
            self._settle_overlap(ready)

    def _settle_overlap(self, slots: list[Slot]) -> None:
        after: list[tuple[Slot, Any]] = []
        for slot in slots:
            record = slot.record
            assert record is not None
            current = slot.param.grad
            grad, replace = self._finish(slot)
            # The user may have zeroed .grad (optimizer.zero_grad) while it was in flight: keep that.
            in_flight = record.guard is not None and current is record.guard
            keep = grad if in_flight or (record.sparse and current is not None) else current
            if replace:
                slot.param.grad = grad
            after.append((slot, keep))
        try:
            self._apply([slot for slot, _ in after])
        finally:
            for slot, keep in after:
                slot.param.grad = keep

    def settle_previous(self) -> None:
        """Finishes every reduction of already closed iterations (their updates too, in overlap mode)."""
        pending = [s for s in self._order if s.record is not None and s.record.iteration < self._iteration]
        if self.options.overlap:
            if pending:
                self._settle_overlap(pending)
        else:
            for slot in pending:
                self._settle_barrier(slot)
        # Counts are waited for only where a gradient was missing here (_used_anywhere): when every
        # parameter had one, step() does not wait for the counts' round trip.

    def finish_masks(self) -> None:
        """Waits for the used counts of every closed iteration."""
        for mask in self._masks.values():
            if not mask.done:
                mask.out.finish(self.options.timeout)
        self._masks.clear()

    def _settle_barrier(self, slot: Slot) -> None:
        grad, replace = self._finish(slot)
        if replace:
            slot.param.grad = grad

    def synchronize(self, counts_too: bool = True) -> None:
        """Closes the iteration if still open and finishes every reduction (and the used counts)."""
        self.close()
        self.settle_previous()
        if counts_too:
            self.finish_masks()

    def pending(self) -> bool:
        """True while any gradient reduction is in flight (used counts excepted: nothing reads them)."""
        return any(s.record is not None for s in self.slots)

    def _on_touch(self, guard: _guard.InFlightGrad) -> None:
        if self.options.overlap:
            raise self._overlap_error(guard._cs_label)
        self.synchronize()

    def zero_grad_in_flight(self, set_to_none: bool) -> None:
        """Overlap mode: detaches in-flight gradients from .grad, so zeroing never writes into them."""
        for slot in self.slots:
            record = slot.record
            if record is not None and record.guard is not None and slot.param.grad is record.guard:
                grad = record.out.target
                slot.param.grad = None if set_to_none else torch.zeros_like(grad)

    def remove(self) -> None:
        """Detaches the gradient hooks."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
