"""Record a ModelProfile from a user's own PyTorch model.

Two untimed steps (a trial of the backward hooks, a warm-up), then a few timed
steps, with hooks on every leaf module and on any module owning parameters directly:

* forward pre-hooks give the order in which modules, hence parameters, are first
  used: the priority order DESIGN.md asks for, measured rather than declared;
* forward pre-hook/hook pairs give each module's forward time, exclusive of nested
  hooked modules;
* full backward pre-hook/hook pairs give its backward time; where that cannot be
  measured (no input needs a gradient, in-place ops that full backward hooks
  reject, an output that is not differentiable) backward is taken as 2x forward.

Times are stored as measured seconds and as FLOPs = seconds * device_flops, so
replaying the profile at device_flops reproduces what was measured. torch is
imported lazily: the package imports without it.
"""

from __future__ import annotations

import itertools
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from commsched.bench.models import DEFAULT_DEVICE_FLOPS, LayerProfile, ModelProfile, save_profile

if TYPE_CHECKING:
    import torch

__all__ = ["record_profile", "save_profile"]


@dataclass
class _ModuleStats:
    """What the hooks saw of one module during the timed steps."""

    name: str
    first_call: int
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    step_forward: float = 0.0
    step_backward: float = 0.0
    backward_seen: bool = False
    # A full backward hook on a module none of whose inputs needs a gradient fires as
    # soon as its output gradient exists, before the module's own work: not a timing.
    input_grad: bool = False


class _Timer:
    """Exclusive time per module from properly nested start/stop events."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync
        self.stack: list[list[Any]] = []  # [key, start, time spent in nested modules]

    def start(self, key: Any) -> None:
        self.sync()
        self.stack.append([key, time.perf_counter(), 0.0])

    def stop(self, key: Any) -> float | None:
        """Exclusive seconds of key, or None when events were not nested as expected."""
        self.sync()
        now = time.perf_counter()
        if not self.stack or self.stack[-1][0] is not key:
            # Not nested (parallel branches interleaved in autograd): drop this sample only.
            self.stack = [e for e in self.stack if e[0] is not key]
            return None
        _, start, nested = self.stack.pop()
        elapsed = now - start
        if self.stack:
            self.stack[-1][2] += elapsed
        return max(0.0, elapsed - nested)


def _call(model: torch.nn.Module, sample_input: Any) -> Any:
    if isinstance(sample_input, dict):
        return model(**sample_input)
    if isinstance(sample_input, (tuple, list)):
        return model(*sample_input)
    return model(sample_input)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (nested) model output."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors(obj.to_tuple())


def _loss(output: Any) -> torch.Tensor | None:
    """A scalar whose backward reaches every differentiable output, or None."""
    parts = [t.float().sum() for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
    if not parts:
        return None
    return sum(parts[1:], parts[0])


def _batch_size(sample_input: Any) -> int:
    for t in _tensors(sample_input):
        if t.dim() > 0:
            return int(t.shape[0])
    return 1


def record_profile(
    model: torch.nn.Module,
    sample_input: Any,
    name: str,
    *,
    repeats: int = 3,
    device_flops: float = DEFAULT_DEVICE_FLOPS,
    batch_size: int | None = None,
    description: str = "",
    measure_backward: bool = True,
) -> ModelProfile:
    """Profile model on sample_input: parameters in first-use order and per-module times."""
    import torch

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    params = list(model.parameters())
    on_cuda = any(p.is_cuda for p in params)
    timer = _Timer(torch.cuda.synchronize if on_cuda else (lambda: None))
    bwd_timer = _Timer(timer.sync)
    hooked = [
        (n, m)
        for n, m in model.named_modules()
        if not any(True for _ in m.children()) or any(True for _ in m.parameters(recurse=False))
    ]
    names = {id(m): (n or type(m).__name__) for n, m in hooked}
    stats: dict[int, _ModuleStats] = {}
    order = itertools.count()
    timing = False

    def pre(mod: torch.nn.Module, args: Any) -> None:
        s = stats.get(id(mod))
        if s is None:
            s = stats[id(mod)] = _ModuleStats(names[id(mod)], next(order))
        s.input_grad = s.input_grad or any(t.requires_grad for t in _tensors(args))
        if timing:
            timer.start(mod)

    def post(mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        if timing:
            dt = timer.stop(mod)
            if dt is not None:
                stats[id(mod)].step_forward += dt

    def bpre(mod: torch.nn.Module, _grad_out: Any) -> None:
        if timing:
            bwd_timer.start(mod)

    def bpost(mod: torch.nn.Module, _grad_in: Any, _grad_out: Any) -> None:
        if timing:
            dt = bwd_timer.stop(mod)
            if dt is not None and id(mod) in stats:
                stats[id(mod)].step_backward += dt
                stats[id(mod)].backward_seen = True

    # Keep what a recording must not change: gradients and buffers (BN running stats).
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handles: list[Any] = []
    for _, m in hooked:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            # Expected for the first modules; input_grad already marks those as estimated.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            extra = (
                _install_backward_hooks(model, sample_input, hooked, bpre, bpost)
                if measure_backward
                else None
            )
            backward = extra is not None
            handles.extend(extra or [])
            _step(model, sample_input)  # warm-up; the first forward already fixed first-use order
            timing = True
            for _ in range(repeats):
                for s in stats.values():
                    s.step_forward = s.step_backward = 0.0
                timer.stack.clear()
                bwd_timer.stack.clear()
                _step(model, sample_input)
                for s in stats.values():
                    s.forward_s.append(s.step_forward)
                    s.backward_s.append(s.step_backward)
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, copy in saved_buffers:
                b.copy_(copy)
    return _build_profile(
        model, stats, hooked, backward, name, repeats, device_flops, batch_size, description, sample_input
    )


def _step(model: torch.nn.Module, sample_input: Any) -> None:
    """One forward and, where the output is differentiable, one backward."""
    loss = _loss(_call(model, sample_input))
    if loss is not None:
        loss.backward()
    for p in model.parameters():
        p.grad = None


def _install_backward_hooks(
    model: torch.nn.Module, sample_input: Any, hooked: list[tuple[str, Any]], bpre: Any, bpost: Any
) -> list[Any] | None:
    """Add full backward hooks if a trial step accepts them; their handles, or None."""
    extra = []
    for _, m in hooked:
        extra.append(m.register_full_backward_pre_hook(bpre))
        extra.append(m.register_full_backward_hook(bpost))
    try:
        _step(model, sample_input)
    except RuntimeError:
        # Typically an in-place op on a hooked module's output; fall back to 2x forward.
        for h in extra:
            h.remove()
        return None
    return extra


def _build_profile(
    model: torch.nn.Module,
    stats: dict[int, _ModuleStats],
    hooked: list[tuple[str, Any]],
    backward: bool,
    name: str,
    repeats: int,
    device_flops: float,
    batch_size: int | None,
    description: str,
    sample_input: Any,
) -> ModelProfile:
    """Turn hook observations into layers in first-use order, each parameter once."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    modules = {id(m): m for _, m in hooked}
    placed: set[int] = set()
    layers: list[LayerProfile] = []
    estimated_backward = 0
    for key, s in sorted(stats.items(), key=lambda kv: kv[1].first_call):
        owned = []
        for p in modules[key].parameters(recurse=False):
            # A tied parameter belongs to the layer that uses it first in forward.
            if id(p) not in placed and id(p) in canonical:
                placed.add(id(p))
                owned.append((canonical[id(p)], tuple(p.shape)))
        fwd = statistics.median(s.forward_s) if s.forward_s else 0.0
        bwd = statistics.median(s.backward_s) if s.backward_s else 0.0
        if not (backward and s.backward_seen and s.input_grad and bwd > 0.0):
            bwd = 2.0 * fwd
            estimated_backward += 1
        layers.append(LayerProfile(s.name, owned, fwd * device_flops, bwd * device_flops, fwd, bwd))
    unused = []
    for n, p in model.named_parameters():
        if id(p) in placed:
            continue
        layer = _adopting_layer(layers, n)
        if layer is None:
            unused.append((n, tuple(p.shape)))
        else:
            layer.params.append((n, tuple(p.shape)))
    if unused:
        # Never touched in forward: still gradients to send, but no position to earn.
        layers.append(LayerProfile("(unused in forward)", unused, 0.0, 0.0, 0.0, 0.0))
    text = description or (
        f"recorded from {type(model).__name__}: median of {repeats} steps, "
        f"FLOPs = measured seconds x {device_flops:g} FLOP/s"
    )
    return ModelProfile(
        name=name,
        layers=layers,
        batch_size=batch_size or _batch_size(sample_input),
        description=text,
        device_flops=device_flops,
        extra={
            "recorded": True,
            "backward_estimated_layers": estimated_backward,
            "unused_params": len(unused),
        },
    )


def _adopting_layer(layers: list[LayerProfile], param_name: str) -> LayerProfile | None:
    """The first layer inside the nearest ancestor of param_name's module that ran."""
    # The module itself never ran because an ancestor uses the parameter functionally:
    # MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward.
    parts = param_name.split(".")[:-1]
    for depth in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:depth])
        for layer in layers:
            if layer.name == prefix or layer.name.startswith(prefix + "."):
                return layer
    return None
