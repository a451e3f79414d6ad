"""What the auto-tuner knows before its first trial: the search space and the simulator's seeds.

The tuner records the tensors one training iteration submits (size, priority, when) and
measures the link with two probe allreduces. From that it builds the simulator's view of
the model, predicts every setting on a grid with the real scheduler on a virtual clock
(`commsched._core.simulate`), and starts the Bayesian search from the best predictions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SIZE_FIELDS = ("partition_bytes", "credit_bytes", "fusion_bytes")
FIELDS = ("policy", *SIZE_FIELDS)
POLICIES = ("priority", "fifo")
# Searched as log2 of the byte count; upper ends shrink to the model (see Space.for_model).
DEFAULT_BOUNDS = {"partition_bytes": (15, 26), "credit_bytes": (16, 28), "fusion_bytes": (10, 26)}

SimLayer = tuple[str, float, float, list[int]]


@dataclass(frozen=True)
class Submission:
    """One tensor submitted in the recorded iteration."""

    name: str
    nbytes: int
    priority: int
    t: float  # seconds since the iteration began


@dataclass(frozen=True)
class Link:
    """The network as the probes measured it, in the simulator's terms."""

    ranks: int
    bandwidth_bytes_per_s: float
    latency_s: float
    cycle_time_s: float


def _ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(max(1, n))))


@dataclass
class Space:
    """Where the search runs: log2 bounds per size, the policies, and the user's fixed values."""

    fixed: dict[str, Any]
    bounds: dict[str, tuple[int, int]] = field(default_factory=lambda: dict(DEFAULT_BOUNDS))
    policies: tuple[str, ...] = POLICIES

    @classmethod
    def for_model(cls, fixed: dict[str, Any], largest_bytes: int, total_bytes: int) -> Space:
        """Bounds cut to the model: partitions past the largest tensor, or credit and fusion past
        one iteration's bytes, all behave the same, so trials there would be wasted."""
        bounds = dict(DEFAULT_BOUNDS)
        if total_bytes > 0:
            caps = {
                "partition_bytes": _ceil_log2(largest_bytes),
                "credit_bytes": _ceil_log2(total_bytes),
                "fusion_bytes": _ceil_log2(total_bytes),
            }
            for name, cap in caps.items():
                low, high = bounds[name]
                bounds[name] = (low, max(low + 1, min(high, cap)))
        return cls(fixed=dict(fixed), bounds=bounds)

    def free(self) -> list[str]:
        """The settings the search may change."""
        return [name for name in FIELDS if name not in self.fixed]

    def size(self) -> int:
        """How many distinct settings the search can propose."""
        count = 1
        for name in self.free():
            if name == "policy":
                count *= len(self.policies)
            else:
                low, high = self.bounds[name]
                count *= high - low + 1
        return count

    def to_params(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Optuna parameters of a full setting: log2 of each free size, clamped to the bounds."""
        params: dict[str, Any] = {}
        for name in self.free():
            if name == "policy":
                params["policy"] = settings["policy"]
                continue
            low, high = self.bounds[name]
            value = int(settings[name])
            # 0 turns partitioning off, which is what the upper bound does for this model.
            exponent = high if value == 0 and name == "partition_bytes" else round(math.log2(max(1, value)))
            params[name] = min(high, max(low, exponent))
        return params

    def from_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The full setting of optuna parameters, with the fixed values filled in."""
        settings = dict(self.fixed)
        for name in self.free():
            settings[name] = params[name] if name == "policy" else 1 << int(params[name])
        return settings

    def grid(self, step: int = 1) -> list[dict[str, Any]]:
        """Every setting on the grid; for fifo only fusion matters (it neither cuts nor gates)."""
        axes: dict[str, list[Any]] = {}
        for name in FIELDS:
            if name in self.fixed:
                axes[name] = [self.fixed[name]]
            elif name == "policy":
                axes[name] = list(self.policies)
            else:
                low, high = self.bounds[name]
                exponents = list(range(low, high + 1, step))
                if exponents[-1] != high:
                    exponents.append(high)
                axes[name] = [1 << e for e in exponents]
        settings = []
        for policy in axes["policy"]:
            partitions = axes["partition_bytes"] if policy == "priority" else axes["partition_bytes"][-1:]
            credits = axes["credit_bytes"] if policy == "priority" else axes["credit_bytes"][-1:]
            for partition in partitions:
                for credit in credits:
                    for fusion in axes["fusion_bytes"]:
                        settings.append(
                            {
                                "policy": policy,
                                "partition_bytes": partition,
                                "credit_bytes": credit,
                                "fusion_bytes": fusion,
                            }
                        )
        return settings


def sim_layers(submissions: Sequence[Submission], group_gap_s: float = 1e-4) -> list[SimLayer]:
    """The simulator's layers (forward order) from one iteration's submissions.

    Gradients submitted back to back form one layer; the gap before a layer is its backward
    compute. Forward compute is not seen, so it follows the FLOP convention (forward = half of
    backward) and is spread like the backward; the time to the first gradient pins the total.
    """
    if not submissions:
        return []
    ordered = sorted(submissions, key=lambda s: s.t)
    groups: list[list[Submission]] = []
    for sub in ordered:
        if groups and sub.t - groups[-1][-1].t < group_gap_s:
            groups[-1].append(sub)
        else:
            groups.append([sub])
    gaps = [groups[0][0].t] + [g[0].t - prev[0].t for prev, g in itertools.pairwise(groups)]
    span = sum(gaps[1:])
    # First gradient at T1 = forward + last layer's backward, with forward = (span + that backward) / 2.
    first = max(0.0, min(gaps[0], (2 * gaps[0] - span) / 3))
    backward = [first, *gaps[1:]]
    total_backward = sum(backward)
    forward_total = max(0.0, gaps[0] - first)
    layers: list[SimLayer] = []
    for index, (group, back) in enumerate(zip(groups, backward)):
        share = back / total_backward if total_backward > 0 else 1 / len(groups)
        name = group[0].name if len(group) == 1 else f"{group[0].name}+{len(group) - 1}"
        layers.append((name or f"layer{index}", forward_total * share, back, [s.nbytes for s in group]))
    # Submissions run last layer first, so forward order is the reverse unless priorities say otherwise.
    layers.reverse()
    priorities = [min(s.priority for s in group) for group in reversed(groups)]
    if len(set(priorities)) == len(priorities):
        layers = [layer for _, layer in sorted(zip(priorities, layers), key=lambda pair: pair[0])]
    return layers


def predict(layers: list[SimLayer], link: Link, mode: str, settings: dict[str, Any]) -> float:
    """Simulated steady-state iteration time of one setting."""
    from commsched._core import simulate

    result = simulate(
        layers,
        link.ranks,
        link.bandwidth_bytes_per_s,
        link.latency_s,
        settings["policy"],
        int(settings["partition_bytes"]),
        int(settings["credit_bytes"]),
        int(settings["fusion_bytes"]),
        mode,
        link.cycle_time_s,
        -1.0,
        4,
        2,
        "fifo",
    )
    return float(result["iteration_s"])


def _distance(space: Space, a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far apart two settings are in partition and credit, in grid steps (policy counts as far).
    Fusion is left out: the simulator often rates many fusion sizes alike, and seeds that differ
    only there would probe one region several times."""
    if a["policy"] != b["policy"]:
        return math.inf
    pa, pb = space.to_params(a), space.to_params(b)
    return max((abs(pa[n] - pb[n]) for n in SIZE_FIELDS[:2] if n in pa), default=0)


def rank_grid(
    layers: list[SimLayer], link: Link, mode: str, space: Space
) -> list[tuple[float, dict[str, Any]]]:
    """Predictions over a coarse grid (factor 4), then every neighbour of the best few; best first."""
    seen: dict[tuple[Any, ...], float] = {}

    def run(settings: dict[str, Any]) -> None:
        key = tuple(settings[n] for n in FIELDS)
        if key not in seen:
            seen[key] = predict(layers, link, mode, settings)

    for settings in space.grid(step=2):
        run(settings)
    for _, key in sorted((t, k) for k, t in seen.items())[:4]:
        center = dict(zip(FIELDS, key))
        params = space.to_params(center)
        for name in SIZE_FIELDS:
            if name not in params or (center["policy"] == "fifo" and name != "fusion_bytes"):
                continue
            low, high = space.bounds[name]
            for delta in (-1, 1):
                if low <= params[name] + delta <= high:
                    run(space.from_params(dict(params, **{name: params[name] + delta})))
    # Ties go to the setting nearest the defaults' middle of the grid: fewer surprises.
    ranked = sorted(seen.items(), key=lambda item: (round(item[1], 9), _tie_break(item[0])))
    return [(t, dict(zip(FIELDS, key))) for key, t in ranked]


def _tie_break(key: tuple[Any, ...]) -> tuple[Any, ...]:
    policy, partition, credit, fusion = key
    return (policy != "priority", -int(partition), -int(credit), -int(fusion))


def pick_seeds(
    ranked: list[tuple[float, dict[str, Any]]], space: Space, count: int, within: float = 0.15
) -> list[tuple[float, dict[str, Any]]]:
    """The best prediction, then the next ones at least two grid steps away (the simulator is an
    approximation, so distinct good regions are worth one trial each), within `within` of the best."""
    if not ranked:
        return []
    best = ranked[0][0]
    seeds = [ranked[0]]
    for predicted, settings in ranked[1:]:
        if len(seeds) >= count or predicted > best * (1 + within):
            break
        if all(_distance(space, settings, chosen) >= 2 for _, chosen in seeds):
            seeds.append((predicted, settings))
    return seeds
