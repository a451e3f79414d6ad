"""A verified checkpoint version against the model and optimizer it is about to be loaded into.

Run before anything is restored, so a refused version leaves model and optimizer as they were. A
version of another model or another optimizer setup is refused (ValueError naming the difference):
the user gave the wrong directory. One whose optimizer hyper-parameters or sharded layout cannot be
those of this setup, although its checksum verified, is damaged (DamagedVersion): load() skips it
with a warning and tries the version before, as it does for a damaged shard.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from commsched.torch import checkpoint_format as fmt
from commsched.torch import checkpoint_shards as sharded
from commsched.torch.checkpoint_read import Contents

import torch


def check_version(model: torch.nn.Module, optimizer: Any, inner: Any, contents: Contents, path: Path) -> None:
    """Raises ValueError for another model or optimizer setup, DamagedVersion for a version that cannot be right."""
    check_same_model(model, contents.model, path)
    params, groups = _plain_groups(optimizer, inner)
    _check_same_setup(inner, groups, contents, path)
    for g, (group, saved) in enumerate(zip(groups, contents.param_groups)):
        for key in sorted(set(group) & set(saved) - {"params"}):
            if not _compatible(_kind(group[key]), _kind(saved[key])):
                raise fmt.DamagedVersion(
                    f"its optimizer param_groups[{g}][{key!r}] is {saved[key]!r}, which cannot stand for "
                    f"this optimizer's {group[key]!r}"
                )
    for g, saved in enumerate(contents.param_groups):
        _check_values(inner, params, g, saved)
    if contents.sharded is not None:
        for bucket in contents.sharded["buckets"]:
            for member in bucket["members"]:
                index, shape = member["index"], member["shape"]
                if index >= len(params) or list(params[index].shape) != shape:
                    here = list(params[index].shape) if index < len(params) else "no such parameter"
                    raise fmt.DamagedVersion(
                        f"its sharded layout gives parameter {index} the shape {shape}; the model's is {here}"
                    )


def check_same_model(model: torch.nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Raises naming the first difference if `saved` is not a state of `model`'s parameters and buffers."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    differs = ""
    if missing or unexpected:
        differs = (f"{missing[0]!r} is missing there" if missing else "") + (
            f"{'; ' if missing else ''}it has {unexpected[0]!r}, which the model has not"
            if unexpected
            else ""
        )
    else:
        for key, value in own.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(saved[key].shape):
                differs = f"{key!r} is {list(saved[key].shape)} there, {list(value.shape)} here"
                break
    if differs:
        raise ValueError(
            f"checkpoint {path} was saved from another model ({differs}); load it into the model it was "
            "saved from, or give this model a directory of its own"
        )


def _plain_groups(optimizer: Any, inner: Any) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters in the order a plain state_dict numbers them, and the param groups."""
    if sharded.is_sharded(optimizer):
        return optimizer.plain_parameters(), optimizer.plain_groups()
    groups = inner.param_groups
    return [p for group in groups for p in group["params"]], groups


def _check_same_setup(inner: Any, groups: list[dict[str, Any]], contents: Contents, path: Path) -> None:
    """Raises ValueError if the version's optimizer class or parameter groups differ from this one's."""
    here = type(inner).__name__
    differs = ""
    if contents.optimizer_class is not None and contents.optimizer_class != here:
        differs = f"the optimizer is {contents.optimizer_class} there, {here} here"
    else:
        sizes = [len(group["params"]) for group in groups]
        saved = [len(group.get("params", ())) for group in contents.param_groups]
        if sizes != saved:
            differs = f"parameter groups of {saved} parameters there, of {sizes} here"
    if differs:
        raise ValueError(
            f"checkpoint {path} was saved from another optimizer setup ({differs}); build the optimizer "
            "as it was when the checkpoint was saved, or give this job a directory of its own"
        )


def _check_values(inner: Any, params: list[torch.Tensor], g: int, saved: dict[str, Any]) -> None:
    """Raises DamagedVersion if torch's own optimizer class refuses the saved hyper-parameters (a beta
    of 1, a negative learning rate) as its constructor would, where its step would fail or diverge."""
    kind = type(inner)
    if not kind.__module__.startswith("torch.optim.") or not params:
        return  # another optimizer's constructor may do more than check its arguments
    try:
        accepted = inspect.signature(kind).parameters
    except (TypeError, ValueError):
        return
    values = {k: v for k, v in saved.items() if k in accepted and k != "params"}
    # Like the first parameter, so device-bound flags (fused, capturable) are judged as its step would.
    first = params[0]
    dtype = first.dtype if first.is_floating_point() or first.is_complex() else torch.float32
    probe = torch.zeros(1, dtype=dtype, device=first.device, requires_grad=True)
    try:
        kind([probe], **values)
    except (ValueError, TypeError, RuntimeError) as error:
        raise fmt.DamagedVersion(
            f"{kind.__name__} refuses its optimizer param_groups[{g}] ({error})"
        ) from None


def _kind(value: Any) -> Any:
    """What a hyper-parameter is, as far as an optimizer's step cares: a number, a flag, a text..."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, tuple):  # Adam's betas: the step unpacks them
        return ("tuple", *map(_kind, value))
    return type(value).__name__


def _compatible(here: Any, saved: Any) -> bool:
    """True when a saved hyper-parameter can take the place of this optimizer's: the same kind, or a
    flag or choice left unset (None) on one side (foreach, fused, LBFGS's line_search_fn)."""
    return here == saved or ("none" in (here, saved) and {here, saved} <= {"none", "bool", "str"})
