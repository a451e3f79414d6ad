"""Counts gradients as autograd accumulates them and says when a bucket is full.

The counter runs in C++ (commsched._torch_hooks: a post hook on each parameter's AccumulateGrad
node, as DDP's Reducer has, no Python and no GIL per gradient) where that extension was built for
the torch in use, else as Python post-accumulate-grad hooks with the same behaviour. Either calls
`on_event(kind, slot, bucket)` only when Python has work: a gradient with no bucket (UNBUCKETED),
one ready again while its last reduction is in flight (AGAIN), a bucket's last member (BUCKET_FULL).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from commsched import torch_release

UNBUCKETED, AGAIN, BUCKET_FULL = 0, 1, 2

EventHandler = Callable[[int, int, int], None]


class PythonGradCounter:
    """The counter as Python hooks: what GradCounter does in C++, for a torch it was not built for."""

    def __init__(self, slots: int, passes_per_step: int, on_event: EventHandler) -> None:
        if passes_per_step < 1:
            raise ValueError("passes_per_step must be at least 1")
        self._passes_per_step = passes_per_step
        self._on_event = on_event
        self._lock = threading.Lock()  # backward on several devices runs hooks on several threads
        self._opened = False
        self._passes = [0] * slots
        self._used = [False] * slots
        self._flying = [False] * slots
        self._bucket_of = [-1] * slots
        self._members: list[int] = []
        self._waiting: list[int] = []
        self._hooks: dict[int, Any] = {}

    def hook(self, param: torch.Tensor, slot: int) -> None:
        """Counts `slot` each time autograd has accumulated `param`'s gradient."""
        if slot not in self._hooks:
            self._hooks[slot] = param.register_post_accumulate_grad_hook(lambda _: self._on_grad(slot))

    def unhook(self, slot: int) -> None:
        """Stops counting `slot`."""
        handle = self._hooks.pop(slot, None)
        if handle is not None:
            handle.remove()

    def unhook_all(self) -> None:
        """Stops counting every slot."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def hooked(self, slot: int) -> bool:
        """True while `slot` is counted."""
        return slot in self._hooks

    def set_buckets(self, bucket_of: list[int], members: list[int]) -> None:
        """A new layout: each slot's bucket (-1: none) and each bucket's member count."""
        if len(bucket_of) != len(self._bucket_of):
            raise ValueError("one bucket per slot, -1 for none")
        if any(b < -1 or b >= len(members) for b in bucket_of):
            raise ValueError("bucket index out of range")
        with self._lock:
            self._bucket_of = list(bucket_of)
            self._members = list(members)
            self._waiting = list(members)

    def reset_bucket(self, bucket: int) -> None:
        """Readies a bucket for the next iteration's gradients."""
        with self._lock:
            self._waiting[bucket] = self._members[bucket]

    def take_passes(self) -> list[int]:
        """Each slot's backward passes since the last call, which zeroes them."""
        with self._lock:
            taken, self._passes = self._passes, [0] * len(self._passes)
        return taken

    def take_used(self, slots: list[int]) -> list[bool]:
        """Whether each of `slots` reported its gradient (or was marked used), clearing the marks."""
        with self._lock:
            taken = [self._used[s] for s in slots]
            for s in slots:
                self._used[s] = False
        return taken

    def set_used(self, slot: int) -> None:
        """Marks `slot` as having a gradient this iteration."""
        self._used[slot] = True

    def set_flying(self, slots: list[int], flying: bool) -> None:
        """Marks slots whose gradient is on the wire: a gradient ready again meanwhile is an error."""
        for s in slots:
            self._flying[s] = flying

    def opened(self) -> bool:
        """True once a gradient arrived since the last mark_closed()."""
        return self._opened

    def mark_closed(self) -> None:
        """Starts waiting for the next iteration's first gradient."""
        self._opened = False

    def _on_grad(self, slot: int) -> None:
        event = None
        with self._lock:
            self._opened = True
            self._passes[slot] += 1
            passes = self._passes[slot]
            if passes < self._passes_per_step:
                return
            bucket = self._bucket_of[slot]
            if bucket < 0:
                event = UNBUCKETED
            elif self._flying[slot]:
                event = AGAIN
            elif passes == self._passes_per_step:  # later passes accumulate into the same, unsent bucket
                self._used[slot] = True
                self._waiting[bucket] -= 1
                if self._waiting[bucket] == 0:
                    event = BUCKET_FULL
        if event is not None:
            self._on_event(event, slot, bucket)


def native() -> Any:
    """commsched._torch_hooks when it was built for the torch imported here, else None."""
    try:
        from commsched import _torch_hooks
    except ImportError:
        return None
    if not torch_release.fits(_torch_hooks.built_for_torch, torch.__version__):
        return None  # torch's C++ classes change between releases
    return _torch_hooks


def make(slots: int, passes_per_step: int, on_event: Callable[[int, int, int], None]) -> Any:
    """The C++ counter where available (PythonGradCounter otherwise), calling the bound method
    `on_event` only while its object lives: the counter's hooks must not keep a dropped optimizer alive."""
    method = weakref.WeakMethod(on_event)  # type: ignore[arg-type]

    def forward(kind: int, slot: int, bucket: int) -> None:
        handler = method()
        if handler is not None:
            handler(kind, slot, bucket)

    hooks = native()
    if hooks is None:
        return PythonGradCounter(slots, passes_per_step, forward)
    return hooks.GradCounter(slots, passes_per_step, forward)


def is_native() -> bool:
    """True when gradients are counted in C++."""
    return native() is not None
