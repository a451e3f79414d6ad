"""DistributedOptimizer: wraps any torch optimizer so gradients are reduced by commsched.

State (momentum, Adam moments) stays in the wrapped optimizer; this object shares its
``param_groups``, ``state`` and ``defaults``, so LR schedulers, GradScaler and
``state_dict()`` keep working and checkpoints load into a plain optimizer.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from commsched.torch import _optimizer_args as _args
from commsched.torch import _wire
from commsched.torch._order import ForwardOrder, ModuleWaits
from commsched.torch._reducer import Reducer, ReducerOptions, Slot
from commsched.torch.compression import Compression

import commsched
import torch
from commsched import _horovod
from commsched._horovod import Average, global_process_set

_instances = itertools.count()


def _overlap_error(label: str) -> RuntimeError:
    return RuntimeError(
        f"commsched.torch: the gradient of '{label}' is still being reduced and is applied per parameter "
        "(overlap_forward=True), so its values cannot be read or changed before the next forward pass. "
        "Features that need every gradient at once (global-norm clipping, GradScaler, reading .grad after "
        "backward) need barrier mode: DistributedOptimizer(..., overlap_forward=False). "
        "To zero gradients use optimizer.zero_grad(); optimizer.synchronize() finishes every update."
    )


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def step_on(
    inner: torch.optim.Optimizer, chosen: dict[int, list[torch.Tensor]], step: Callable[[], Any]
) -> Any:
    """Runs step() with `inner`'s groups narrowed to the chosen parameters (by group index), then restores them."""
    groups = inner.param_groups
    views = [(g, {**groups[g], "params": params}) for g, params in chosen.items()]
    inner.param_groups = [view for _, view in views]
    try:
        return step()
    finally:
        inner.param_groups = groups
        for g, view in views:  # keep what step() wrote into the group (none of torch's do)
            for key, value in view.items():
                if key != "params" and groups[g].get(key) is not value:
                    groups[g][key] = value


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` so each gradient is reduced by commsched as soon as backward produces it."""

    def __new__(cls, *args: Any, shard: bool | None = None, **kwargs: Any) -> DistributedOptimizer:  # noqa: PYI034
        """shard=True (or COMMSCHED_SHARD=1 when shard is not given) builds the sharded optimizer (ZeRO-2);
        op=hvd.Adasum builds Horovod's Adasum delta optimizer."""
        op = kwargs.get("op", args[4] if len(args) > 4 else None)
        if cls is DistributedOptimizer and isinstance(op, str) and op.lower() == _horovod.Adasum:
            from commsched.torch._adasum_optimizer import AdasumOptimizer

            return super().__new__(AdasumOptimizer)
        if cls is DistributedOptimizer:
            from commsched.config import shard_setting

            if shard_setting(shard):
                from commsched.torch._shard import ShardedOptimizer

                return super().__new__(ShardedOptimizer)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Any = Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = global_process_set,
        *,
        model: torch.nn.Module | None = None,
        overlap_forward: bool = False,
        process_group: Any = None,
        shard: bool | None = None,
    ) -> None:
        """Horovod's arguments; `num_groups`/`groups` are checked but grouping is the core's fusion.

        commsched's own: `model` (measures the forward order for priorities), `overlap_forward`
        (per-parameter updates overlapping the next forward), `process_group` (a torch.distributed
        group to start commsched over when it is not running), `shard` (ZeRO-2 sharding of gradients
        and optimizer state, see _shard; None: the COMMSCHED_SHARD setting).
        """
        named = _args.check_wrap(
            optimizer, backward_passes_per_step, overlap_forward, model, named_parameters, num_groups, groups
        )
        if overlap_forward and (isinstance(optimizer, torch.optim.LBFGS) or _needs_closure(optimizer)):
            raise ValueError(
                f"{type(optimizer).__name__} needs every gradient at once (its step takes a closure), so it "
                "cannot apply updates per parameter; use barrier mode: overlap_forward=False"
            )
        how = _args.reduction(op, compression, gradient_predivide_factor, process_set)
        self._inner = optimizer
        self._overlap = overlap_forward
        self._model = model
        self._named = named
        # CUDA parameters start commsched on NCCL; a mix of CPU and CUDA ones is refused here.
        labelled = self._labelled_parameters()
        if _wire.training_device(labelled) == "cuda":
            _wire.ensure_initialized(process_group, _wire.cuda_device_name(p for _, p in labelled))
        else:
            _wire.ensure_initialized(process_group, "cpu")
        how.settle()
        self._options = ReducerOptions(
            prefix=f"torch.opt{next(_instances)}.",
            op=how.op,
            backward_passes_per_step=backward_passes_per_step,
            wire_dtype=how.wire_dtype,
            overlap=overlap_forward,
            prescale=how.prescale,
            postscale=how.postscale,
            ranks=how.ranks,
            core=how.core,
            sparse_as_dense=sparse_as_dense,
            member=_horovod.is_global(process_set) or commsched.rank() in _horovod.ranks_of(process_set),
        )
        self._synchronized = False  # synchronize() ran since the last step()
        self._skip_synchronize = False
        # What torch.optim.Optimizer.__init__ would set; the hooks run around this wrapper's step().
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._patch_step_function()
        self._forward_order: list[torch.Tensor] | None = None
        self._reducer = self._build_reducer()
        self._recorder = ForwardOrder(model, self._on_forward_order) if model is not None else None
        self._waits: ModuleWaits | None = None
        if overlap_forward and model is not None:
            self._waits = self._module_waits(model)
            self._waits.set_reached([], self._unowned())

    # -- shared state of the wrapped optimizer ---------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the same list)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state (the same dict)."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def __repr__(self) -> str:
        mode = "overlap_forward" if self._overlap else "barrier"
        return f"DistributedOptimizer({mode}, {self._inner!r})"

    # -- setup -------------------------------------------------------------------------------
    def _labels(self) -> dict[int, str]:
        pairs: list[tuple[str, torch.Tensor]] = []
        if self._named is not None:
            pairs = self._named
        elif self._model is not None:
            pairs = list(self._model.named_parameters())
        labels: dict[int, str] = {}
        for name, param in pairs:
            if name in labels.values():
                raise ValueError(f"parameter name '{name}' appears twice in named_parameters")
            labels[id(param)] = name
        return labels

    def _labelled_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(wire label, parameter) for every parameter of the wrapped optimizer, in group order."""
        labels = self._labels()
        labelled: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for g, group in enumerate(self._inner.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) in seen:
                    raise ValueError("a parameter appears in two parameter groups")
                seen.add(id(param))
                labelled.append((labels.get(id(param), f"param.{g}.{i}"), param))
        return labelled

    def _build_reducer(self) -> Reducer:
        labelled = self._labelled_parameters()
        device = _wire.training_device(labelled)
        if labelled:
            _wire.check_transport(device, labelled[0][0])
        self._options.device = labelled[0][1].device if device == "cuda" else torch.device("cpu")
        slots: list[Slot] = []
        group_of = {id(p): g for g, group in enumerate(self._inner.param_groups) for p in group["params"]}
        for label, param in labelled:
            slots.append(Slot(param, label, len(slots), group_of[id(param)], len(slots)))
        reducer = Reducer(slots, self._options, self._apply, _overlap_error)
        if self._forward_order is not None:
            reducer.set_priorities(self._forward_order)
        return reducer

    def _module_waits(self, model: torch.nn.Module) -> ModuleWaits:
        """Overlap mode's per-module waits on this reducer; their hooks rest while nothing is pending."""
        reducer = self._reducer
        waits = ModuleWaits(model, {id(s.param) for s in reducer.slots}, reducer.settle, reducer.idle)
        reducer.on_close = waits.arm
        return waits

    def _unowned(self) -> list[torch.Tensor]:
        owned = {id(p) for p in self._model.parameters()} if self._model is not None else set()
        return [s.param for s in self._reducer.slots if id(s.param) not in owned]

    def _on_forward_order(self, order: list[torch.Tensor]) -> None:
        self._forward_order = order
        self._reducer.set_priorities(order)
        if self._waits is not None:
            self._waits.set_reached(order, self._unowned())

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each parameter's wire name, as Horovod's DistributedOptimizer keeps them (the same on every rank)."""
        return {slot.param: slot.label for slot in self._reducer.slots}

    def buckets(self) -> list[list[str]]:
        """The parameters of each gradient bucket, by name, in the order they are sent (empty in the first step)."""
        return list(self._reducer.buckets().values())

    def priorities(self) -> dict[str, int]:
        """Each parameter's priority (smaller is sent sooner), by name."""
        return {s.label: s.priority for s in self._reducer.slots}

    # -- the per-parameter update of overlap mode --------------------------------------------
    def _apply(self, slots: list[Slot]) -> None:
        """Runs the wrapped optimizer's step on a view of its groups holding only these parameters."""
        chosen: dict[int, list[torch.Tensor]] = {}
        for slot in slots:
            chosen.setdefault(slot.group, []).append(slot.param)
        params = [slot.param for slot in slots]
        step_on(self._inner, chosen, lambda: self._updating(params, self._inner.step))

    # -- the optimizer API -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Waits for every outstanding reduction (and, in overlap mode, update) of this iteration.

        To change gradients before the update (clipping), call it, change them, then step inside
        ``with optimizer.skip_synchronize():``.
        """
        self._reducer.synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block step() applies the gradients as they are, after an explicit synchronize()."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Barrier mode: waits for all gradients, then steps. Overlap mode: closes the iteration."""
        if not self._options.member:  # outside the process set: a plain optimizer on its own gradients
            step = self._inner.step if closure is None else lambda: self._inner.step(closure)
            return self._updating([p for g in self._inner.param_groups for p in g["params"]], step)
        if self._overlap:
            if closure is not None:
                raise ValueError("step(closure) needs every gradient at once; use overlap_forward=False")
            self._reducer.close()
            self._synchronized = False
            commsched.autotune_step()  # an iteration boundary for COMMSCHED_AUTOTUNE; else a no-op
            return None
        if self._synchronized and not self._skip_synchronize:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(); the gradients are already reduced and step() applies them as they "
                "are, but put step() inside `with optimizer.skip_synchronize():` to say so (Horovod reduces "
                "them again here)",
                UserWarning,
                stacklevel=2,
            )
        self._synchronized = False
        self._reducer.synchronize(counts_too=False)
        step = self._inner.step if closure is None else lambda: self._inner.step(closure)
        result = self._updating([p for g in self._inner.param_groups for p in g["params"]], step)
        commsched.autotune_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes gradients; never writes into a gradient that is still being reduced."""
        if self._overlap:
            self._reducer.zero_grad_in_flight(set_to_none)
        elif self._reducer.pending():
            self._reducer.synchronize()
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict, after finishing updates of already closed iterations."""
        self._reducer.settle_previous()
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads into the wrapped optimizer (a plain optimizer's state_dict fits too)."""
        self._reducer.settle_previous()
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group to the wrapped optimizer; its parameters are reduced from the next backward on."""
        if not hasattr(self, "_reducer"):  # called before __init__ finished
            raise RuntimeError("DistributedOptimizer is not set up yet")
        self._reducer.synchronize()
        self._inner.add_param_group(param_group)
        self._replace_reducer()

    def _replace_reducer(self) -> None:
        """A fresh reducer (new parameters, or a new generation's core after an elastic restore), and
        overlap mode's module waits on it: waits left on the old one would never apply an update."""
        self._reducer.remove()
        self._reducer = self._build_reducer()
        if self._waits is not None:
            self._waits.remove()
            assert self._model is not None
            self._waits = self._module_waits(self._model)
            self._waits.set_reached(self._forward_order or [], self._unowned())

    # -- per-parameter update hooks (state capture, e.g. commsched.torch.Checkpointer) -------
    def register_param_update_pre_hook(self, hook: Callable[[Any, list[torch.Tensor]], None]) -> Any:
        """Calls hook(optimizer, params) right before the wrapped optimizer updates `params`.

        Barrier mode: once per step() with every parameter. Overlap mode: per parameter group of
        the next forward's pre-hooks, so a hook sees each parameter just before its own update.
        shard=True: once per bucket, with its parameters, as step() updates it.
        """
        from torch.utils.hooks import RemovableHandle

        hooks = self.__dict__.setdefault("_param_update_hooks", (OrderedDict(), OrderedDict()))
        handle = RemovableHandle(hooks[0])
        hooks[0][handle.id] = hook
        return handle

    def register_param_update_post_hook(self, hook: Callable[[Any, list[torch.Tensor]], None]) -> Any:
        """Calls hook(optimizer, params) right after the wrapped optimizer updated `params`."""
        from torch.utils.hooks import RemovableHandle

        hooks = self.__dict__.setdefault("_param_update_hooks", (OrderedDict(), OrderedDict()))
        handle = RemovableHandle(hooks[1])
        hooks[1][handle.id] = hook
        return handle

    def pending_updates(self) -> list[torch.Tensor]:
        """Overlap mode: parameters whose update from an already closed iteration is not applied yet."""
        return self._reducer.pending_params()

    def apply_pending_updates(self) -> None:
        """Overlap mode: applies now the updates of closed iterations that wait for the next forward."""
        self._reducer.settle_previous()

    def _updating(self, params: list[torch.Tensor], update: Callable[[], Any]) -> Any:
        """Runs update() between the parameter update hooks (none registered: just update())."""
        hooks = self.__dict__.get("_param_update_hooks")
        if not hooks or not (hooks[0] or hooks[1]):
            return update()
        for hook in list(hooks[0].values()):
            hook(self, params)
        result = update()
        for hook in list(hooks[1].values()):
            hook(self, params)
        return result

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead")
