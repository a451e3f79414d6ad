"""Where an unsharded commit's tensors go in a version's buffers, and when that plan still holds.

Building the copies of a commit (a destination buffer, an entry and a source per tensor) took about
30 us per parameter with Adam on the training thread, at every commit(). A Plan holds them for one
version's buffers; a Layout records the tensors it was made for, and the plan is made again only when
they changed (elastic_commit.BackgroundCommit).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commsched.torch import checkpoint_format as fmt
from commsched.torch.checkpoint_capture import Copy, Unit
from commsched.torch.elastic_version import Version

import torch


class Layout:
    """The tensors an unsharded commit's plans were made for: the ranks, the model's names and tensors,
    each parameter with its shape, dtype and device (Module.to() and `param.data = ...` change those and
    keep the parameter), and the optimizer's state by name and tensor.

    Checked at every commit, so kept cheap: lists compared whole, no key of thousands of tuples (that
    set off the garbage collector at every commit). Model tensors and parameters count by identity
    (the plans hold them, so no new tensor can take their address); state tensors, which the copies
    look up when they run, by weak reference: a state tensor replaced (load_state_dict) plans again."""

    def __init__(
        self, ranks: int, rank: int, model_state: dict[str, Any], params: list[torch.Tensor], state: Any
    ) -> None:
        self._head = (ranks, rank, list(model_state))
        self._model = _model_ids(model_state)
        self._params = _described(params)
        self._names, values = _state_items(params, state)
        self._state = [None if value is None else weakref.ref(value) for value in values]

    def holds(
        self, ranks: int, rank: int, model_state: dict[str, Any], params: list[torch.Tensor], state: Any
    ) -> bool:
        """True when the model, parameters and state are still those this layout was taken of."""
        if (ranks, rank, list(model_state)) != self._head or _model_ids(model_state) != self._model:
            return False
        if _described(params) != self._params:
            return False
        names, values = _state_items(params, state)
        return names == self._names and all(
            held is None if value is None else held is not None and held() is value
            for held, value in zip(self._state, values, strict=True)
        )


def _model_ids(model_state: dict[str, Any]) -> list[int | None]:
    return [id(value) if isinstance(value, torch.Tensor) else None for value in model_state.values()]


def _described(params: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(id(p), p.shape, p.dtype, p.device) for p in params]


def _state_items(params: list[torch.Tensor], state: Any) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Each parameter's count of state entries and their names, and the entries' tensors (None: not one)."""
    names: list[Any] = []
    values: list[torch.Tensor | None] = []
    for param in params:
        held = state.get(param)
        if not held:
            names.append(0)
            continue
        names.append(len(held))
        names.extend(held)
        values.extend(value if isinstance(value, torch.Tensor) else None for value in held.values())
    return names, values


# A model entry that is not a tensor: deep-copied from the state_dict at each commit.
FROM_STATE_DICT = object()


@dataclass(eq=False)
class Plan:
    """Where one commit's tensors go in one version's buffers, and the copies that take them there."""

    key: int = 0  # the layout of tensors it was planned for (BackgroundCommit._layouts)
    cut: dict[int, str] = field(default_factory=dict)  # parameter id -> name: each rank copies a part
    model: dict[str, Any] = field(default_factory=dict)  # name -> destination (or FROM_STATE_DICT)
    covered: dict[str, int] = field(default_factory=dict)  # name -> index: rebuilt from shards
    aliases: dict[str, str] = field(default_factory=dict)  # name -> name cut as
    by_param: dict[int, tuple[torch.Tensor, list[Copy]]] = field(default_factory=dict)
    buffer_copies: list[Copy] = field(default_factory=list)  # copied inside commit(): no hook says when
    state: dict[int, dict[str, Any]] = field(default_factory=dict)  # the optimizer's, by parameter index
    state_objects: list[tuple[int, torch.Tensor, str]] = field(default_factory=list)  # not tensors

    def fill(
        self, version: Version, model_state: dict[str, Any], units: dict[int, Unit], loose: list[Unit]
    ) -> None:
        """Points `version` at the plan's tensors and adds this commit's units of copies."""
        version.model = {
            name: copy.deepcopy(model_state[name]) if place is FROM_STATE_DICT else place
            for name, place in self.model.items()
        }
        version.covered, version.aliases = dict(self.covered), dict(self.aliases)
        for param, copies in self.by_param.values():
            unit = units.get(id(param))
            if unit is None:
                units[id(param)] = Unit(param, list(copies))
            else:
                unit.copies.extend(copies)
        loose.extend(Unit(None, [piece]) for piece in self.buffer_copies)


def plan_model(
    version: Version, model_state: dict[str, Any], sliced: dict[int, int], cut: dict[int, str]
) -> Plan:
    """Where each entry of the model's state_dict goes: a buffer of `version`, rebuilt from the shards
    (`sliced`: id -> parameter index) or joined from the ranks' parts (`cut`: id -> name)."""
    plan = Plan(cut=cut)
    for name, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            plan.model[name] = FROM_STATE_DICT
            continue
        if id(tensor) in sliced:  # its shards are in shared memory: rebuilt from them at restore()
            plan.covered[name] = sliced[id(tensor)]
            continue
        if id(tensor) in cut:  # each rank copies its part into shared memory: joined at restore()
            plan.aliases[name] = cut[id(tensor)]
            continue
        key = f"model.{name}"
        plan.model[name] = destination = version.tensor(key, tensor)
        piece = copy_into(key, lambda t=tensor: t, destination)
        if isinstance(tensor, torch.nn.Parameter):
            plan.by_param.setdefault(id(tensor), (tensor, []))[1].append(piece)
        else:  # a buffer: the next forward may change it, and no update hook says when
            plan.buffer_copies.append(piece)
    return plan


def copy_into(
    key: str,
    source: Callable[[], torch.Tensor],
    destination: torch.Tensor,
    flat: tuple[int, int] | None = None,
) -> Copy:
    """A copy of the whole tensor `source()` returns (looked up when it runs), or of the (start, count)
    `flat` range of its elements, into `destination`."""
    entry = fmt.Entry(key, destination.dtype, tuple(destination.shape))
    return Copy(fmt.Piece(entry, 0, entry.rows), source, destination, flat)
