"""Forward-pass bookkeeping: the order parameters are first used, and per-module waits.

The next forward needs the first layer's parameters first, so a parameter's priority is
the position where the first forward pass reached it (module forward pre-hooks), measured
rather than taken from declaration order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def _inert(*args: Any) -> None:
    return None


def _make_inert() -> Callable[..., None]:
    return _inert


class _Hook:
    """A module hook that copies of the module (deepcopy, pickle) carry as a no-op.

    A bound method would drag the whole optimizer into ``copy.deepcopy(model)`` (an EMA copy,
    say) and fail on the scheduler's handles; the copy is not ours to schedule anyway.
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __call__(self, *args: Any) -> Any:
        return self._function(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _make_inert, ()


class _EagerHook(_Hook):
    """A _Hook that torch.compile runs eagerly, outside the compiled graph.

    The per-module waits of overlap mode finish reductions and run the optimizer: host work that
    Dynamo would otherwise try to trace, probing the in-flight gradients it finds (their guard
    takes any such probe for a read of values still being reduced). A graph break per module with
    parameters is the price, in overlap mode only.
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__(function)
        compiler = getattr(torch, "compiler", None)
        disable = getattr(compiler, "disable", None)
        self._eager = disable(function) if disable is not None else function
        self._compiling = getattr(compiler, "is_compiling", None) or _never

    def __call__(self, *args: Any) -> Any:
        # Dynamo traces this call with is_compiling() true and meets the disabled function: a graph
        # break. Eager calls skip the disabled wrapper, whose eval-frame switch cost ~3 us per module.
        if self._compiling():
            return self._eager(*args)
        return self._function(*args)


def _never() -> bool:
    return False


class ForwardOrder:
    """Records, during the model's next forward pass, the order in which parameters are reached."""

    def __init__(self, model: torch.nn.Module, on_recorded: Callable[[list[torch.Tensor]], None]) -> None:
        self._seen: list[torch.Tensor] = []
        self._ids: set[int] = set()
        self._on_recorded: Callable[[list[torch.Tensor]], None] | None = on_recorded
        # Eager under torch.compile: recording mutates the optimizer's state, which Dynamo refuses to
        # trace on some releases (torch 2.11: "setattr on a user-defined object"). The breaks cost
        # the first compiled forward only: the hooks are gone after it.
        hooks = [m.register_forward_pre_hook(_EagerHook(self._reach)) for m in model.modules()]
        self._handles: list[Any] = [*hooks, model.register_forward_hook(_EagerHook(self._finish))]

    def _reach(self, module: torch.nn.Module, args: Any) -> None:
        if self._on_recorded is None:
            return
        for param in module.parameters(recurse=False):
            if id(param) not in self._ids:
                self._ids.add(id(param))
                self._seen.append(param)

    def _finish(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # Code compiled while the hooks were attached may call them once more after remove().
        on_recorded, self._on_recorded = self._on_recorded, None
        self.remove()
        if on_recorded is not None:
            on_recorded(self._seen)

    def remove(self) -> None:
        """Detaches the recording hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _dynamo_ran() -> bool:
    """True once torch.compile traced a frame in this process."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and bool(utils.counters["frames"].get("total"))


class ModuleWaits:
    """Before each module runs, settles the pending updates of that module's own parameters.

    Parameters that no module reached in the recorded forward pass (used functionally by
    another module, or owned by a module that did not run) are settled before the root runs,
    which is safe for any use at the price of some overlap.

    A module hook costs ~3.5 us per call even when it has nothing to do (torch leaves its fast
    path for modules with hooks), so once nothing of a closed iteration is pending (`idle()`) the
    modules' hooks rest, taken out of their modules, until arm() puts them back when the next
    iteration closes. Under torch.compile they never rest: Dynamo does not guard on module hooks, so
    code traced while they rest would go on without them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: set[int],
        settle: Callable[[list[torch.Tensor]], bool | None],
        idle: Callable[[], bool] | None = None,
    ) -> None:
        self._settle = settle
        self._idle = idle
        self._root = model
        self._reached: set[int] = set()
        self._all = [p for m in model.modules() for p in m.parameters(recurse=False) if id(p) in params]
        self._handles: list[Any] = []
        # (the module's pre-hook dict, the hook's key there, the hook) of every module but the root.
        self._resting_hooks: list[tuple[Any, int, _EagerHook]] = []
        self._resting = False
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in params]
            if module is model:
                self._handles.append(
                    module.register_forward_pre_hook(_EagerHook(self._before_root), prepend=True)
                )
            elif own:
                hook = _EagerHook(self._before(own))
                handle = module.register_forward_pre_hook(hook, prepend=True)
                self._handles.append(handle)
                self._resting_hooks.append((module._forward_pre_hooks, handle.id, hook))
        self._extra: list[torch.Tensor] = []

    def _before(self, own: list[torch.Tensor]) -> Callable[[torch.nn.Module, Any], None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self._settle(own):
                self._rest_if_idle()

        return hook

    def _before_root(self, module: torch.nn.Module, args: Any) -> None:
        own = list(module.parameters(recurse=False))
        unreached = [p for p in self._all if id(p) not in self._reached]
        if self._settle(own + unreached + self._extra):
            self._rest_if_idle()

    def _rest_if_idle(self) -> None:
        """Takes the modules' hooks out while nothing is left to settle (see the class docstring)."""
        if self._idle is None or self._resting or not self._handles or not self._idle() or _dynamo_ran():
            return
        for hooks, key, _ in self._resting_hooks:
            hooks.pop(key, None)
        self._resting = True

    def arm(self) -> None:
        """Puts resting hooks back, first in their modules (as registered): something is pending again."""
        if not self._resting:
            return
        self._resting = False
        for hooks, key, hook in self._resting_hooks:
            hooks[key] = hook
            hooks.move_to_end(key, last=False)

    def set_reached(self, reached: list[torch.Tensor], extra: list[torch.Tensor]) -> None:
        """Marks the parameters whose module ran in the recorded pass; `extra` are settled at the root."""
        self._reached = {id(p) for p in reached}
        self._extra = list(extra)

    def remove(self) -> None:
        """Detaches the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._resting_hooks.clear()  # arm() must not put them back
