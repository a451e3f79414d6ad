"""DistributedOptimizer(op=hvd.Adasum): Horovod's Adasum delta optimizer.

Each rank steps the wrapped optimizer on its own gradients; the change each step made to a
parameter (its delta) is then combined over the ranks with Adasum, and every rank sets the
parameter to its value before the step plus the combined delta. Adasum combines orthogonal
deltas by adding them and parallel ones by averaging, so the ranks' steps add up where they
agree on nothing and average where they agree, as in Horovod's `_DistributedAdasumOptimizer`.
The wrapped optimizer's state (momentum, Adam's moments) stays each rank's own, as there.

The deltas travel as one Adasum allreduce per parameter (commsched.adasum: an allgather each),
so this suits the CPU transports and the modest models Adasum is used with; as Horovod's, it
needs a power-of-two number of ranks and the global process set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from commsched.torch import _optimizer_args as _args
from commsched.torch import _wire
from commsched.torch import collectives as _ops
from commsched.torch.compression import Compression, compressor
from commsched.torch.optimizer import DistributedOptimizer

import commsched
import torch
from commsched import _horovod, adasum


class AdasumOptimizer(DistributedOptimizer):
    """DistributedOptimizer(optimizer, op=hvd.Adasum): local steps, parameter deltas combined with Adasum."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Any = Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = _horovod.Adasum,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = _horovod.global_process_set,
        *,
        model: torch.nn.Module | None = None,
        overlap_forward: bool = False,
        process_group: Any = None,
        shard: bool | None = None,
    ) -> None:
        """Horovod's arguments; gradients accumulate over backward passes until step(), as with any optimizer."""
        refused = {
            "overlap_forward=True": overlap_forward,
            "shard=True": bool(shard),
            "a process set other than the global one": not _horovod.is_global(process_set),
            "gradient_predivide_factor": gradient_predivide_factor != 1.0,
        }
        for what, given in refused.items():
            if given:
                raise NotImplementedError(
                    f"DistributedOptimizer(op=hvd.Adasum) does not take {what} (as Horovod's Adasum optimizer); "
                    "leave it out, or use op=hvd.Average"
                )
        self._named = _args.check_wrap(
            optimizer, backward_passes_per_step, False, model, named_parameters, num_groups, groups
        )
        self._inner, self._model, self._overlap = optimizer, model, False
        self._compressor = compressor(compression)
        labelled = self._labelled_parameters()
        _wire.ensure_initialized(process_group, "cpu")
        adasum.check_ranks(commsched.size())
        self._names = {id(param): name for name, param in labelled}
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = {}
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = {}

    def __repr__(self) -> str:
        return f"DistributedOptimizer(Adasum, {self._inner!r})"

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self._inner.param_groups for p in group["params"]]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Steps on this rank's gradients, then moves every parameter by the Adasum of the ranks' deltas."""
        params = self._params()
        before = [p.detach().clone() for p in params]
        step = self._inner.step if closure is None else lambda: self._inner.step(closure)
        result = self._updating(params, step)
        pending = []
        for param, start in zip(params, before):
            if param.dtype not in (torch.float16, torch.float32, torch.float64):
                raise TypeError(
                    f"DistributedOptimizer(op=hvd.Adasum) updates float16/32/64 parameters, not "
                    f"{self._names.get(id(param), 'a parameter')} of {param.dtype}"
                )
            delta, context = self._compressor.compress(param.detach() - start)
            name = f"adasum.delta.{self._names.get(id(param), len(pending))}"
            pending.append(
                (param, start, context, _ops.allreduce_async_(delta, name=name, op=_horovod.Adasum))
            )
        with torch.no_grad():
            for param, start, context, handle in pending:
                combined = self._compressor.decompress(_ops.synchronize(handle), context)
                param.copy_(start + combined.to(param.dtype))
        commsched.autotune_step()
        return result

    def synchronize(self) -> None:
        """Nothing to wait for: the deltas are combined inside step()."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the wrapped optimizer's gradients."""
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict (each rank's own, as in Horovod)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads into the wrapped optimizer."""
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group to the wrapped optimizer; its parameters take part from the next step on."""
        self._inner.add_param_group(param_group)
        self._names = {id(param): name for name, param in self._labelled_parameters()}

    def pending_updates(self) -> list[torch.Tensor]:
        """None: every update is applied inside step()."""
        return []

    def apply_pending_updates(self) -> None:
        """Nothing to apply: every update is applied inside step()."""
