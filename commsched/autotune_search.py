"""Rank 0's side of the auto-tuner: the optuna study, the trial history and the final ranking."""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from commsched.autotune_seed import FIELDS, Space

if TYPE_CHECKING:
    from commsched.autotune import Options

log = logging.getLogger("commsched.autotune")


def settings_key(settings: dict[str, Any]) -> tuple[Any, ...]:
    """A hashable form of a full setting."""
    return tuple(settings[name] for name in FIELDS)


class Search:
    """Rank 0's side: the optuna study, the trial history and the choice at the end."""

    def __init__(self, space: Space, options: Options, predictor: Callable[[dict[str, Any]], float] | None):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self.space = space
        self.options = options
        self.predictor = predictor
        self.study = optuna.create_study(direction="minimize", sampler=self._sampler(0))
        self.history: list[tuple[dict[str, Any], list[float]]] = []  # per-iteration times
        self._open: Any = None

    def _sampler(self, startup: int) -> Any:
        optuna = self._optuna
        if self.options.sampler == "gp":
            try:
                import scipy  # noqa: F401  (GPSampler needs scipy and torch)
                import torch  # noqa: F401

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return optuna.samplers.GPSampler(
                        seed=self.options.seed, n_startup_trials=startup, deterministic_objective=False
                    )
            except ImportError:
                log.info("scipy or torch missing: the search uses optuna's TPE sampler")
        return optuna.samplers.TPESampler(
            seed=self.options.seed,
            n_startup_trials=startup,
            multivariate=True,
            warn_independent_sampling=False,
        )

    def distributions(self) -> dict[str, Any]:
        """Optuna distributions of the free settings."""
        dists: dict[str, Any] = {}
        for name in self.space.free():
            if name == "policy":
                dists[name] = self._optuna.distributions.CategoricalDistribution(list(self.space.policies))
            else:
                low, high = self.space.bounds[name]
                dists[name] = self._optuna.distributions.IntDistribution(low, high)
        return dists

    def start(self, measured: list[tuple[dict[str, Any], float]], seeds: list[dict[str, Any]]) -> int:
        """Adds already measured settings, queues the seeds (returns how many), and lets the model
        take over after them."""
        dists = self.distributions()
        for settings, samples in measured:
            value = math.log(statistics.median(samples))
            if settings["policy"] not in self.space.policies:
                continue
            self.study.add_trial(
                self._optuna.trial.create_trial(
                    params=self.space.to_params(settings), distributions=dists, value=value
                )
            )
        queued = set()
        for settings in seeds:
            params = self.space.to_params(settings)
            if tuple(sorted(params.items())) not in queued:
                queued.add(tuple(sorted(params.items())))
                self.study.enqueue_trial(params, skip_if_exists=True)
        # Random start-up trials would waste the budget: the seeds are the start-up.
        self.study.sampler = self._sampler(len(measured) + len(queued))
        return len(queued)

    def ask(self) -> dict[str, Any]:
        """The next setting to try."""
        self._open = self.study.ask(self.distributions())
        return self.space.from_params(self._open.params)

    def tell(self, settings: dict[str, Any], samples: list[float]) -> None:
        """Scores the open trial (if any) by its median and records the measurement."""
        if self._open is not None:
            # In logs, one setting 4x too slow does not flatten the model around the good ones.
            self.study.tell(self._open, math.log(statistics.median(samples)))
            self._open = None
        self.record(settings, samples)

    def record(self, settings: dict[str, Any], samples: list[float]) -> None:
        """Keeps a measurement for the final choice."""
        self.history.append((dict(settings), list(samples)))

    def exhausted(self) -> bool:
        """True once every setting the space holds has been measured: more trials only repeat them."""
        tried = {
            settings_key(self.space.from_params(self.space.to_params(s)))
            for s, _ in self.history
            if s["policy"] in self.space.policies
        }
        return len(tried) >= self.space.size()

    def ranked(self) -> list[tuple[float, dict[str, Any]]]:
        """Median of every iteration measured per distinct setting, best first; pooling the repeats
        makes one trial slowed by a neighbour's burst count for less."""
        by_key: dict[tuple[Any, ...], list[float]] = {}
        for settings, samples in self.history:
            by_key.setdefault(settings_key(settings), []).extend(samples)
        ranked = [(statistics.median(values), dict(zip(FIELDS, key))) for key, values in by_key.items()]
        return sorted(ranked, key=lambda item: item[0])
