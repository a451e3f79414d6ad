"""A gradient that the scheduler still reduces in place, guarded against early reads.

While a gradient is on the wire, ``param.grad`` is an ``InFlightGrad`` aliasing the same
memory. Reading its shape or dtype is free; anything that reads or writes its values
first calls the owner's ``settle`` (barrier mode: wait for every reduction; overlap mode:
raise, because the update is applied per parameter and the values are not final).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

# Tensor methods and properties that never look at the values, so they need no settling.
_METADATA = frozenset(
    {
        "size",
        "dim",
        "numel",
        "stride",
        "is_contiguous",
        "element_size",
        "is_floating_point",
        "is_complex",
        "__len__",
        "__hash__",
        "requires_grad_",
        "detach_",
        "get_device",
    }
)
# Properties that hand out the values themselves (a write through .data would bypass the guard).
_VALUE_PROPERTIES = frozenset({"data", "real", "imag", "T", "mT", "H", "mH"})


def _needs_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        descriptor = getattr(func, "__self__", None)
        return getattr(descriptor, "__name__", "") in _VALUE_PROPERTIES
    return name not in _METADATA


def _guards_in(value: Any) -> Iterator[InFlightGrad]:
    if isinstance(value, InFlightGrad):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _guards_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _guards_in(item)


class InFlightGrad(torch.Tensor):
    """``param.grad`` while its reduction is in flight; touching the values settles it first."""

    _cs_settle: Callable[[InFlightGrad], None]
    _cs_label: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _needs_values(func):
            for guard in list(_guards_in((args, kwargs))):
                settle = getattr(guard, "_cs_settle", None)
                if settle is not None:
                    settle(guard)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def guard(grad: torch.Tensor, label: str, settle: Callable[[InFlightGrad], None]) -> InFlightGrad:
    """Wraps `grad` (sharing its memory) so that touching its values calls `settle` first."""
    wrapped = grad.as_subclass(InFlightGrad)
    wrapped._cs_settle = settle
    wrapped._cs_label = label
    return wrapped


def release(wrapped: torch.Tensor) -> None:
    """Disarms a guard, so stale references held by user code act as plain tensors."""
    if isinstance(wrapped, InFlightGrad):
        wrapped._cs_settle = None  # type: ignore[assignment]
