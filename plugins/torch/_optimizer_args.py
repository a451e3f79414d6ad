"""DistributedOptimizer's Horovod arguments, checked and turned into how gradients are reduced."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from commsched.torch.compression import wire_dtype

import torch
from commsched import _horovod


@dataclass
class Reduction:
    """How each gradient is reduced: the op on the wire, its scale factors and where it goes."""

    op: str
    wire_dtype: torch.dtype | None
    prescale: float = 1.0
    postscale: float = 1.0
    ranks: int | None = None  # ranks that average (the process set's size), once commsched runs
    core: dict[str, Any] = field(default_factory=dict)  # process_set for commsched
    predivide: float = 1.0
    process_set: Any = None

    def settle(self) -> Reduction:
        """Fills what needs commsched running: the number of ranks, and the postscale of a predivided average."""
        self.ranks = _horovod.set_size(self.process_set)
        if self.predivide != 1.0:
            # Divide by the factor before the sum and by size/factor after it: an average in two steps.
            self.postscale = self.predivide / self.ranks
        return self


def reduction(op: Any, compression: Any, gradient_predivide_factor: Any, process_set: Any) -> Reduction:
    """Checks op, compression, gradient_predivide_factor and process_set (Horovod's rules)."""
    op = _horovod.resolve_op(op)
    if op not in (_horovod.Average, _horovod.Sum):
        raise ValueError(f"DistributedOptimizer takes op=hvd.Average or op=hvd.Sum, not {op!r}")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)):
        raise TypeError(f"gradient_predivide_factor must be a number, not {gradient_predivide_factor!r}")
    if not 0 < gradient_predivide_factor < math.inf:  # NaN fails too: it would become a NaN prescale factor
        raise ValueError(
            f"gradient_predivide_factor must be a finite number above 0, not {gradient_predivide_factor}"
        )
    result = Reduction(op, wire_dtype(compression), process_set=process_set)
    result.core = _horovod.core_arguments(process_set)
    if gradient_predivide_factor != 1.0:
        if op != _horovod.Average:
            raise ValueError(
                "gradient_predivide_factor is supported only with op=hvd.Average (as in Horovod)"
            )
        result.op = _horovod.Sum
        result.prescale = 1.0 / gradient_predivide_factor
        result.predivide = float(gradient_predivide_factor)
    return result


def named(named_parameters: Any) -> list[tuple[str, torch.Tensor]] | None:
    """named_parameters as a list of (name, parameter), refusing other shapes and repeated names."""
    if named_parameters is None:
        return None
    pairs = list(named_parameters)
    seen: set[str] = set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(
                "named_parameters should be a sequence of (name, parameter) pairs, usually model.named_parameters()"
            )
        if pair[0] in seen:
            raise ValueError(
                f"parameter name '{pair[0]}' appears twice in named_parameters; names must be unique"
            )
        seen.add(pair[0])
    return pairs


def check_all_named(pairs: list[tuple[str, torch.Tensor]] | None, optimizer: torch.optim.Optimizer) -> None:
    """Refuses named_parameters that leave some of the optimizer's parameters unnamed (as Horovod does)."""
    if pairs is None:
        return
    known = {id(p) for _, p in pairs}
    missing = [
        f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in known
    ]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"named_parameters was given, but {len(missing)} of the optimizer's parameters are not in it: {shown}; "
            "pass model.named_parameters() of the model that owns every parameter the optimizer updates"
        )


def check_groups(num_groups: Any, groups: Any, optimizer: torch.optim.Optimizer) -> None:
    """Checks Horovod's num_groups / groups (grouping is the core's fusion here, so they are hints)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an integer >= 0, not {num_groups!r}")
    if groups is None:
        return
    if num_groups:
        raise ValueError("pass either num_groups or groups, not both")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be an integer >= 0 or a list of parameter lists, not {groups}")
        return
    if not isinstance(groups, Iterable):
        raise TypeError(f"groups must be an integer or a list of lists of parameters, not {groups!r}")
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for group in groups:
        for param in group:
            if not isinstance(param, torch.Tensor) or id(param) not in owned:
                raise ValueError("groups must hold only parameters of the wrapped optimizer")


def check_wrap(
    optimizer: Any,
    backward_passes_per_step: Any,
    overlap_forward: bool,
    model: torch.nn.Module | None,
    named_parameters: Any,
    num_groups: Any,
    groups: Any,
) -> list[tuple[str, torch.Tensor]] | None:
    """The checks DistributedOptimizer makes in both forms (sharded or not); returns the named parameters."""
    from commsched.torch.optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("the optimizer is already a commsched DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be an integer >= 1, not {backward_passes_per_step!r}"
        )
    if overlap_forward and model is None:
        raise ValueError("overlap_forward=True needs model= (the next forward waits module by module)")
    pairs = named(named_parameters)
    check_all_named(pairs, optimizer)
    check_groups(num_groups, groups, optimizer)
    return pairs
