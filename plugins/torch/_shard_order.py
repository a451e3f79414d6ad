"""The forward order shard=True lays its buckets out by, counting parameters used by another module.

ForwardOrder reaches a parameter when its own module starts. Some parameters are used by another
module instead: MultiheadAttention passes its out_proj's weight and bias to a functional call, so
out_proj never runs. Left unreached, such a parameter was sent last and settled before the root
module: with overlap_forward the whole next forward waited at its start for the last bucket's
all-gather, behind every other one (about 80 ms of a 300 ms transformer iteration on the rig).

FirstUse records, during the same forward, the module that was running when an op first took such
a parameter, and puts the parameter in the order there. ShardWaits then settles it in that module's
pre-forward hook, where the recorded forward first needed it, instead of at the root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from commsched.torch._order import ForwardOrder, ModuleWaits, _EagerHook, _Hook

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class _Watch(TorchFunctionMode):
    """Calls `seen(tensor)` for each tensor argument of every op while the recording forward runs."""

    def __init__(self, on_tensor: Callable[[Any], None]) -> None:
        super().__init__()
        self._on_tensor = on_tensor

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._on_tensor(leaf)
        return func(*args, **kwargs)


class FirstUse(ForwardOrder):
    """A ForwardOrder that also places parameters used outside their own module where an op first took them.

    After the recorded forward, `users` maps each such parameter (by id) to the module that was
    running then (the innermost one whose forward had started and not ended).
    """

    def __init__(self, model: torch.nn.Module, on_recorded: Callable[[list[torch.Tensor]], None]) -> None:
        super().__init__(model, on_recorded)
        self._model = model
        self._params = {id(p): p for p in model.parameters()}
        self._running: list[torch.nn.Module] = []
        self._watch: _Watch | None = None
        self.users: dict[int, torch.nn.Module] = {}
        self._handles += [
            m.register_forward_hook(_Hook(self._leave), always_call=True) for m in model.modules()
        ]

    def _reach(self, module: torch.nn.Module, args: Any) -> None:
        if module is self._model and self._watch is None and not _compiling():
            self._watch = _Watch(self._first_use)
            self._watch.__enter__()
        self._running.append(module)
        super()._reach(module, args)

    def _first_use(self, tensor: Any) -> None:
        key = id(tensor)
        if key in self._params and key not in self._ids and self._running:
            self._ids.add(key)
            self._seen.append(self._params[key])
            self.users[key] = self._running[-1]

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._running:
            self._running.pop()
        if not self._running:  # the root ended, also by an exception
            self._stop()

    def _finish(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._stop()  # before the layout's own ops run
        super()._finish(module, args, output)

    def _stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.__exit__(None, None, None)

    def remove(self) -> None:
        """Detaches the recording hooks and ends the watch if a forward is still being recorded."""
        self._stop()
        super().remove()


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    return bool(check()) if check is not None else False


class ShardWaits(ModuleWaits):
    """ModuleWaits that also settles each parameter used outside its own module in the module that used it.

    `recorder` recorded the order: a FirstUse names the users; a plain ForwardOrder (elastic_shard's
    re-forming records with one) names none, so such parameters are unreached and settled before the
    root, as ModuleWaits does.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: set[int],
        settle: Callable[[list[torch.Tensor]], bool | None],
        recorder: ForwardOrder | None,
    ) -> None:
        super().__init__(model, params, settle)
        users: dict[int, torch.nn.Module] = getattr(recorder, "users", {})
        by_module: dict[int, tuple[torch.nn.Module, list[torch.Tensor]]] = {}
        for param in model.parameters():
            user = users.get(id(param))
            if user is not None and id(param) in params:
                by_module.setdefault(id(user), (user, []))[1].append(param)
        for user, used in by_module.values():
            # Runs before the module's own wait (both prepended): its own parameters first, in order.
            own = [p for p in user.parameters(recurse=False) if id(p) in params and id(p) not in users]
            hook = _EagerHook(self._before(own + used))
            self._handles.append(user.register_forward_pre_hook(hook, prepend=True))
