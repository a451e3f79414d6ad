"""Gradient reduction for one optimizer: hand each gradient over when ready, settle it later.

Every rank must submit the same names, so an iteration is *closed* deterministically (by
step() or synchronize()): trainable parameters that got no gradient on this rank are
submitted as zeros, and a small "used" count per parameter is summed across ranks, so a
parameter that no rank used keeps its gradient untouched (DDP's find_unused_parameters).

The first iteration sends each gradient as a collective of its own; it also measures the
order the forward pass needs the parameters in. From then on gradients live in priority
buckets (see _buckets): a hook only counts the bucket's members down (in C++ where built, see
_counter), and the last member's hook submits the whole bucket, so Python runs once per bucket.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commsched.torch import _buckets, _counter, _guard, _wire

import commsched
import torch


@dataclass(eq=False)
class _Record:
    """One parameter's reduction in flight for one iteration (the per-parameter path)."""

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
    record: _Record | None = None
    # The bucket path: this slot's bucket in the current layout, its gradient's home there, and the
    # guard that stands in .grad while the bucket is in flight (same memory, made once).
    bucket: _buckets.Bucket | None = None
    view: torch.Tensor | None = None
    guard: _guard.InFlightGrad | None = None
    # The bucket carrying this slot's gradient now (maybe of an older layout; what it carries is there).
    flight: _buckets.Bucket | None = None

    def bind(
        self, bucket: _buckets.Bucket, view: torch.Tensor, settle: Callable[[Any], None] | None = None
    ) -> None:
        """Makes `view` (in `bucket`) this parameter's gradient storage from the next iteration on.

        `settle(guard)` runs when code touches the guard's values (it checks the bucket is in flight).
        """
        self.bucket = bucket
        self.view = view
        self.guard = _guard.guard(view, self.label, settle)  # type: ignore[arg-type]


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
    # Horovod's sparse_as_dense: sparse gradients travel dense. They always do here (every rank then
    # submits one shape), and come back sparse either way, as Horovod gives them back.
    sparse_as_dense: bool = False
    member: bool = True  # this rank belongs to the process set; otherwise it keeps its own gradients


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; to a real GPU through pinned memory, so the host does not wait for the stream."""
    if device.type == "cuda" and torch.cuda.is_available():
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def bucket_limit(ranks: int) -> int | None:
    """The most bytes a bucket holds (0: no limit), or None when buckets are off (COMMSCHED_BUCKET_BYTES=0)."""
    settings = commsched.config()
    given = settings.get("bucket_bytes")
    if given is not None:
        return int(given) if given > 0 else None
    partition = int(settings.get("partition_bytes") or 0)
    # One rank has no link to cut buckets for: one bucket per dtype is one launch.
    return partition if ranks > 1 and partition > 0 else 0


def _bucket_touch(reducer: Reducer) -> Callable[[_buckets.Bucket, _guard.InFlightGrad], None]:
    """What touching a bucket member's guard does: settle (see Reducer._on_touch) while the bucket flies.

    It holds the reducer weakly: a guard left in .grad must not keep a dropped optimizer alive.
    """
    owner = weakref.ref(reducer)

    def touch(bucket: _buckets.Bucket, guard: _guard.InFlightGrad) -> None:
        live = owner()
        if live is not None and bucket.out is not None:
            live._on_touch(guard)

    return touch


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
        self._passes = options.backward_passes_per_step
        self._iteration = 0
        # The current iteration's submissions are complete (until the counter sees a gradient).
        self._closed = False
        self._masks: dict[int, _Mask] = {}
        self._sent: dict[str, commsched.Handle] = {}  # the last collective under each gradient name
        # Counts each gradient's backward passes and each bucket's members down; calls _on_event.
        self._counter = _counter.make(len(slots), self._passes, self._on_event)
        self._buckets: list[_buckets.Bucket] = []
        self._layout_trainable: tuple[bool, ...] | None = None  # what the buckets were built for
        self._hooked_trainable: tuple[bool, ...] | None = None  # what the hooks were laid for
        self._layouts = 0
        # Kept as they change, so a step never scans every slot for them: the buckets in flight (in
        # the order sent), the slots with a per-parameter reduction in flight, the slots with no
        # bucket (in priority order).
        self._flying: list[_buckets.Bucket] = []
        self._recorded: dict[Slot, None] = {}
        self._unbucketed = list(self._order)
        self._touch = _bucket_touch(self)
        self.on_close: Callable[[], None] | None = None  # runs once an iteration closed
        self._hook_trainable()

    def _hook_trainable(self, trainable: tuple[bool, ...] | None = None) -> None:
        # Frozen parameters cannot carry hooks; one unfrozen later is hooked when the iteration closes.
        # A rank outside the optimizer's process set reduces nothing: it keeps its own gradients.
        if not self.options.member or (trainable is not None and trainable == self._hooked_trainable):
            return
        self._hooked_trainable = trainable
        for slot in self.slots:
            if slot.param.requires_grad and not self._counter.hooked(slot.index):
                self._counter.hook(slot.param, slot.index)

    # -- priorities -------------------------------------------------------------------------
    def set_priorities(self, order: list[torch.Tensor]) -> None:
        """Priority = position of first use in the forward pass; unreached parameters come after."""
        position = {id(p): i for i, p in enumerate(order)}
        for slot in self.slots:
            slot.priority = position.get(id(slot.param), len(order) + slot.index)
        self._order = sorted(self.slots, key=lambda s: (s.priority, s.index))
        self._unbucketed = [slot for slot in self._order if slot.bucket is None]
        self._layout_trainable = None  # the next close lays the buckets out in this order

    # -- submission -------------------------------------------------------------------------
    def _on_event(self, kind: int, index: int, bucket: int) -> None:
        """What the counter leaves to Python: an unbucketed gradient, an early one, a full bucket."""
        if kind == _counter.BUCKET_FULL:
            self._submit_bucket(self._buckets[bucket])
        elif kind == _counter.AGAIN:
            raise self._again(self.slots[index])
        else:
            self._submit(self.slots[index], used=True)

    def _again(self, slot: Slot) -> RuntimeError:
        return RuntimeError(
            f"commsched.torch: gradient of '{slot.label}' became ready again while its previous "
            f"reduction is in flight; call optimizer.step() after every "
            f"{self.options.backward_passes_per_step} backward pass(es), or set backward_passes_per_step"
        )

    def _start(self, tensor: torch.Tensor, name: str, priority: int) -> _wire.Outgoing:
        """Starts a gradient's (or bucket's) reduction: the optimizer's op, compression and scales."""
        options = self.options
        return self._send(
            tensor,
            name,
            priority,
            options.op,
            options.wire_dtype,
            prescale_factor=options.prescale,
            postscale_factor=options.postscale,
            ranks=options.ranks,
        )

    def _send(
        self, tensor: torch.Tensor, name: str, priority: int, op: str, *args: Any, **kwargs: Any
    ) -> _wire.Outgoing:
        """Starts an allreduce under `name` once its last collective is done, and remembers this one."""
        self._free_name(name)
        out = _wire.start_allreduce(tensor, name, priority, op, *args, **kwargs, **self.options.core)
        self._sent[name] = out.work
        return out

    def _free_name(self, name: str) -> None:
        """Waits for the last collective under `name` to be done, where it is only launched.

        On a GPU finish() returns once the collective is launched and the stream waits for it, so
        the last iteration's may not be seen done yet; a name is in flight once at a time.
        """
        previous = self._sent.get(name)
        if previous is not None and not previous.done():
            previous.wait(self.options.timeout)

    def _submit(self, slot: Slot, used: bool) -> None:
        if slot.record is not None:
            raise self._again(slot)
        param = slot.param
        sparse = False
        if used:
            grad = param.grad
            if isinstance(grad, _guard.InFlightGrad):
                grad = grad.as_subclass(torch.Tensor)
            elif grad is not None and grad.is_sparse:
                # Embedding(sparse=True): reduced densely (every rank submits the same shape), given back
                # sparse. The sparse .grad stays readable meanwhile.
                grad, sparse = grad.to_dense(), True
        else:
            grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        out = self._start(grad, self.options.prefix + slot.label, slot.priority)
        record = _Record(out, used, self._iteration, sparse=sparse)
        if used and not sparse:
            record.guard = _guard.guard(grad, slot.label, self._on_touch)
            param.grad = record.guard
        slot.record = record
        self._recorded[slot] = None

    def _submit_bucket(self, bucket: _buckets.Bucket, used: list[bool] | None = None) -> None:
        """Sends a bucket: gradients that live elsewhere (after zero_grad(set_to_none)) are copied in first.

        `used`: whether each member had a gradient this iteration (default: what the counter saw).
        """
        if used is None:
            used = self._counter.take_used(bucket.indices)
        self._counter.set_flying(bucket.indices, True)
        params = bucket.params
        grads = [param.grad for param in params]
        if all(used) and all(type(grad) is torch.Tensor and not grad.is_sparse for grad in grads):
            # What every step after zero_grad() brings: each member's dense gradient (copied in; a
            # member's own view copies onto itself, which is no copy), then its guard in .grad.
            torch._foreach_copy_(bucket.views, grads)
            for param, guard in zip(params, bucket.guards):
                param.grad = guard
            sparse = bucket.dense
        else:
            sparse = _buckets.gather(bucket, used, grads)
        for slot in bucket.slots:
            slot.flight = bucket
        bucket.flight_used = used
        bucket.flight_sparse = sparse
        bucket.iteration = self._iteration
        self._flying.append(bucket)
        if self.options.overlap or not self._last_to_fly(bucket):
            bucket.out = self._start(bucket.flat, bucket.name, bucket.priority)
            return
        # Barrier mode's last bucket: step() waits for it next and runs the core's round itself.
        with commsched._caller_drives():
            bucket.out = self._start(bucket.flat, bucket.name, bucket.priority)

    def _last_to_fly(self, bucket: _buckets.Bucket) -> bool:
        """Whether every other bucket of the layout is already in flight this iteration."""
        return all(other.out is not None or other is bucket for other in self._buckets)

    def close(self) -> None:
        """Ends the iteration: zeros for trainable parameters with no gradient here, then the used counts."""
        if self._closed and not self._counter.opened():
            return
        if not self.options.member:
            self._closed = True
            return
        self.settle_previous()
        counts = [0] * len(self.slots)
        passes = self._counter.take_passes()
        for slot in self._unbucketed:
            if slot.record is None and slot.param.requires_grad:
                unhooked = not self._counter.hooked(slot.index)  # unfrozen since: its gradient is unseen
                used = (passes[slot.index] > 0 or unhooked) and slot.param.grad is not None
                self._submit(slot, used=used)
            if slot.record is not None and slot.record.used:
                counts[slot.index] = 1
        for bucket in self._buckets:
            if bucket.out is None:
                for index in bucket.indices:
                    if passes[index] > 0:  # fewer passes than backward_passes_per_step still count
                        self._counter.set_used(index)
                used = self._counter.take_used(bucket.indices)
                for index, slot_used in zip(bucket.indices, used):
                    if slot_used:
                        counts[index] = 1
                self._submit_bucket(bucket, used)
            elif bucket.iteration == self._iteration:
                for index in bucket.indices:
                    counts[index] = 1  # a bucket sent from the hooks had every member
        trainable = tuple(slot.param.requires_grad for slot in self.slots)
        self._hook_trainable(trainable)
        # The previous iteration's counts are long done by now; their name is about to be reused.
        self.finish_masks()
        name = f"{self.options.prefix}used"
        tensor = _to_device(torch.tensor(counts, dtype=torch.int32), self.options.device)
        # Nothing waits for the counts soon: the next wait (or the core's heartbeat) runs them, where
        # waking the core's thread for them took the CPU from this one (~130 us on a busy host).
        with commsched._caller_drives():
            self._masks[self._iteration] = _Mask(tensor, self._start_counts(tensor, name))
        self._iteration += 1
        self._closed = True
        self._counter.mark_closed()
        self._relayout(trainable)
        if self.on_close is not None:
            self.on_close()

    def _start_counts(self, counts: torch.Tensor, name: str) -> _wire.Outgoing:
        return self._send(counts, name, -1, "sum")

    # -- buckets ----------------------------------------------------------------------------
    def _relayout(self, trainable: tuple[bool, ...]) -> None:
        """Lays the buckets out anew when the priorities or the trainable parameters changed.

        The gradients of the iteration just closed stay in the old buckets until settled; the
        next iteration's go to the new ones. Every rank takes the same layout: priorities are the
        smallest any rank measured, so ranks whose first forward skipped a layer still agree.
        """
        if trainable == self._layout_trainable:
            return
        limit = bucket_limit(self.options.ranks or commsched.size())
        self._layout_trainable = trainable
        if limit is None:
            return
        unranked = 2**62
        local = [slot.priority if slot.param.requires_grad else unranked for slot in self.slots]
        # The size limit rides along: ranks may have fitted their partitions to the link apart.
        local.append(limit if limit > 0 else unranked)
        agreed = torch.tensor(local, dtype=torch.int64).to(self.options.device)
        name = f"{self.options.prefix}layout{self._layouts}"
        priorities = self._start_priorities(agreed, name).finish(self.options.timeout).cpu().tolist()
        limit = priorities.pop()
        limit = 0 if limit == unranked else limit
        members = [slot for slot in self.slots if priorities[slot.index] != unranked]
        members.sort(key=lambda s: (priorities[s.index], s.index))
        for slot in self.slots:
            slot.bucket = None
        plans = _buckets.plan(members, limit, priorities)
        prefix = f"{self.options.prefix}bucket{self._layouts}."
        self._layouts += 1
        self._buckets = [
            _buckets.build(chosen, f"{prefix}{k}", priorities[chosen[0].index], self._layouts, self._touch)
            for k, chosen in enumerate(plans)
        ]
        self._unbucketed = [slot for slot in self._order if slot.bucket is None]
        bucket_of = [-1] * len(self.slots)
        for k, bucket in enumerate(self._buckets):
            bucket.position = k
            for index in bucket.indices:
                bucket_of[index] = k
        self._counter.set_buckets(bucket_of, [len(bucket.slots) for bucket in self._buckets])

    def _start_priorities(self, priorities: torch.Tensor, name: str) -> _wire.Outgoing:
        return _wire.start_allreduce(priorities, name, -2, "min", **self.options.core)

    def buckets(self) -> dict[str, list[str]]:
        """Each bucket's wire name and its parameters' labels, in priority order (empty before the first)."""
        return {bucket.name: [slot.label for slot in bucket.slots] for bucket in self._buckets}

    # -- settling ---------------------------------------------------------------------------
    def _used_anywhere(self, iteration: int, slot: Slot) -> bool:
        mask = self._masks[iteration]
        if not mask.done:
            mask.out.finish(self.options.timeout)
            mask.counts = mask.counts.cpu()  # one copy, not one device read per parameter
            mask.done = True
        return bool(mask.counts[slot.index] > 0)

    def _finish(self, slot: Slot) -> tuple[torch.Tensor | None, bool]:
        """Waits for a slot's per-parameter reduction; returns (gradient to use, whether to replace .grad)."""
        record = slot.record
        assert record is not None
        reduced = record.out.finish(self.options.timeout)
        slot.record = None
        self._recorded.pop(slot, None)
        if record.guard is not None:
            _guard.release(record.guard)
        if record.sparse:
            reduced = reduced.to_sparse()
        if record.used or self._used_anywhere(record.iteration, slot):
            return reduced, True
        return None, False

    def _finish_bucket(self, bucket: _buckets.Bucket) -> None:
        """Waits for a bucket's reduction; what it carried stays for _member_result."""
        out = bucket.out
        assert out is not None
        out.finish(self.options.timeout)
        bucket.out = None  # from here its guards act as plain tensors
        self._flying.remove(bucket)
        for slot in bucket.slots:
            if slot.flight is bucket:
                slot.flight = None
        # Its members may count again; a bucket of a layout since replaced has nothing left to count.
        self._counter.set_flying(bucket.indices, False)
        if bucket.layout == self._layouts:
            self._counter.reset_bucket(bucket.position)

    def _member_result(self, bucket: _buckets.Bucket, k: int) -> tuple[torch.Tensor | None, bool]:
        """(gradient to use, whether to replace .grad) for member `k` of a bucket that just finished."""
        if not bucket.flight_used[k] and not self._used_anywhere(bucket.iteration, bucket.slots[k]):
            return None, False
        if bucket.flight_sparse[k]:
            return bucket.views[k].to_sparse(), True
        return bucket.views[k], True

    def settle(self, params: list[torch.Tensor]) -> bool:
        """Overlap mode: finishes these parameters' closed reductions and applies their updates.

        Returns whether there was any to finish.
        """
        ready: list[Slot] = []
        buckets: list[_buckets.Bucket] = []
        for param in params:
            slot = self._by_id.get(id(param))
            if slot is None:
                continue
            if slot.record is not None and slot.record.iteration < self._iteration:
                ready.append(slot)
            bucket = slot.flight
            if bucket is not None and bucket.iteration < self._iteration and bucket not in buckets:
                buckets.append(bucket)
        if ready or buckets:
            self._settle_overlap(ready, buckets)
            return True
        return False

    def idle(self) -> bool:
        """True when no reduction of a closed iteration is left to settle."""
        closed = self._iteration
        return all(b.iteration >= closed for b in self._flying) and all(
            slot.record is None or slot.record.iteration >= closed for slot in self._recorded
        )

    def _settle_overlap(self, slots: list[Slot], buckets: list[_buckets.Bucket]) -> None:
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
        for bucket in buckets:
            self._finish_bucket(bucket)
            if bucket.plain():
                for slot, param, view, guard in zip(bucket.slots, bucket.params, bucket.views, bucket.guards):
                    current = param.grad
                    param.grad = view
                    after.append((slot, view if current is guard else current))
                continue
            for k, (slot, guard) in enumerate(zip(bucket.slots, bucket.guards)):
                current = slot.param.grad
                sparse = bucket.flight_sparse[k]
                in_flight = bucket.flight_used[k] and not sparse and current is guard
                grad, replace = self._member_result(bucket, k)
                keep = grad if in_flight or (sparse and current is not None) else current
                if replace:
                    slot.param.grad = grad
                after.append((slot, keep))
        try:
            self._apply([slot for slot, _ in after])
        finally:
            for slot, keep in after:
                if slot.param.grad is not keep:
                    slot.param.grad = keep

    def _flying_buckets(self, closed_only: bool = True) -> list[_buckets.Bucket]:
        """Buckets in flight (of closed iterations only, by default), in priority order."""
        found = [b for b in self._flying if b.iteration < self._iteration or not closed_only]
        if len(found) > 1:
            found.sort(key=lambda b: (b.priority, b.indices[0]))
        return found

    def settle_previous(self) -> None:
        """Finishes every reduction of already closed iterations (their updates too, in overlap mode)."""
        pending = []
        if self._recorded:
            pending = [
                s for s in self._order if s.record is not None and s.record.iteration < self._iteration
            ]
        buckets = self._flying_buckets()
        if self.options.overlap:
            if pending or buckets:
                self._settle_overlap(pending, buckets)
            return
        for slot in pending:
            grad, replace = self._finish(slot)
            if replace:
                slot.param.grad = grad
        for bucket in buckets:
            self._finish_bucket(bucket)
            if bucket.plain():
                for param, view in zip(bucket.params, bucket.views):
                    param.grad = view
                continue
            for k, slot in enumerate(bucket.slots):
                grad, replace = self._member_result(bucket, k)
                if replace:
                    slot.param.grad = grad
        # Counts are waited for only where a gradient was missing here (_used_anywhere): when every
        # parameter had one, step() does not wait for the counts' round trip.

    def finish_masks(self) -> None:
        """Waits for the used counts of every closed iteration."""
        for mask in self._masks.values():
            if not mask.done:
                mask.out.finish(self.options.timeout)
        self._masks.clear()

    def synchronize(self, counts_too: bool = True) -> None:
        """Closes the iteration if still open and finishes every reduction (and the used counts)."""
        with commsched._caller_drives():  # what close() submits is waited for right below
            self.close()
        self.settle_previous()
        if counts_too:
            self.finish_masks()

    def pending(self) -> bool:
        """True while any gradient reduction is in flight (used counts excepted: nothing reads them)."""
        return bool(self._flying or self._recorded)

    def pending_params(self) -> list[torch.Tensor]:
        """Parameters whose reduction (and, in overlap mode, update) of a closed iteration is pending."""
        closed = self._iteration
        found = []
        for slot in self.slots:
            if (slot.record is not None and slot.record.iteration < closed) or (
                slot.flight is not None and slot.flight.iteration < closed
            ):
                found.append(slot.param)
        return found

    def _on_touch(self, guard: _guard.InFlightGrad) -> None:
        if self.options.overlap:
            raise self._overlap_error(guard._cs_label)
        self.synchronize()

    def zero_grad_in_flight(self, set_to_none: bool) -> None:
        """Overlap mode: detaches in-flight gradients from .grad, so zeroing never writes into them."""
        for slot in list(self._recorded):
            record = slot.record
            if record is not None and record.guard is not None and slot.param.grad is record.guard:
                grad = record.out.target
                slot.param.grad = None if set_to_none else torch.zeros_like(grad)
        for bucket in self._flying_buckets(closed_only=False):
            for param, guard in zip(bucket.params, bucket.guards):
                if param.grad is guard:
                    param.grad = None if set_to_none else torch.zeros_like(param)

    def drain(self) -> None:
        """Waits for every reduction and used count in flight without applying them (a restore is about
        to overwrite what they would give, and the next iteration would reuse their names)."""
        for bucket in list(self._flying):
            if bucket.out is not None:
                bucket.out.finish(self.options.timeout)
        for slot in list(self._recorded):
            if slot.record is not None:
                slot.record.out.finish(self.options.timeout)
        self.finish_masks()

    def remove(self) -> None:
        """Detaches the gradient hooks."""
        self._counter.unhook_all()
