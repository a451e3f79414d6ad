"""Online auto-tuning of policy, partition, credit and fusion sizes while training runs.

Every rank calls `commsched.autotune_step()` once per training iteration (the torch
plug-in's `step()` and the replay benchmark do). The tuner then, on every rank at the same
iteration boundaries:

1. measures a few iterations under the starting settings and probes the link
   (bandwidth and latency) through commsched itself;
2. records one iteration's gradients (sizes, priorities, timing) and, on rank 0, predicts a
   grid of settings with the simulator and starts a Bayesian search (optuna) from the best
   predictions;
3. runs trials: each switches settings with `commsched.reconfigure` (every rank, same
   boundary, so no collective is left half done), lets one iteration settle, and scores the
   next ones by the iteration time agreed across ranks;
4. re-measures the best few, keeps the winner, logs every trial (CSV) and prints the
   `COMMSCHED_*` variables that reproduce it.

Settings the user gave explicitly stay fixed. Only rank 0 runs the optimiser; what it
proposes travels as a small int64 array (never pickle) and the scores as float64 arrays.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from commsched.autotune_search import Search, settings_key
from commsched.autotune_seed import (
    FIELDS,
    POLICIES,
    Link,
    Space,
    Submission,
    pick_seeds,
    predict,
    rank_grid,
    sim_layers,
)
from commsched.buffers import DTYPE_SIZES

log = logging.getLogger("commsched.autotune")
RESERVED_PREFIX = "commsched.autotune."
_URGENT = -(2**31)  # the tuner's few bytes go before any gradient
_LAST = 2**31 - 1  # the drain marker goes after every gradient
_TRIAL, _FINAL = 1, 2
_ENV = {
    "policy": "COMMSCHED_POLICY",
    "partition_bytes": "COMMSCHED_PARTITION_BYTES",
    "credit_bytes": "COMMSCHED_CREDIT_BYTES",
    "fusion_bytes": "COMMSCHED_FUSION_BYTES",
}
LOG_COLUMNS = (
    "trial",
    "phase",
    "first_iteration",
    "last_iteration",
    "policy",
    "partition_bytes",
    "credit_bytes",
    "fusion_bytes",
    "iteration_s",
    "predicted_s",
    "best_s",
)


@dataclass
class Options:
    """How the tuner spends its iterations (every rank must use the same options)."""

    budget_iterations: int = 100  # the search ends, final settings applied, by this iteration
    skip_iterations: int = 1  # first iterations carry one-off costs and are not scored
    observe_iterations: int = 3  # scored under the starting settings
    settle_iterations: int = 1  # after a switch: chunks cut under the old settings drain
    measure_iterations: int = 3  # scored per trial (median, then mean over ranks)
    seeds: int = 3  # simulator predictions tried first
    confirm: int = 3  # best settings measured once more before choosing
    sampler: str = "tpe"  # "tpe" (optuna default, ms per trial) or "gp" (Gaussian process, seconds per trial)
    seed: int = 0
    log_path: str = ""
    report: bool = True  # rank 0 prints the chosen settings

    def trial_iterations(self) -> int:
        """Iterations one trial takes."""
        return self.settle_iterations + self.measure_iterations


class Collectives(Protocol):
    """What the tuner needs from the runtime; commsched's own below, a fake one in tests."""

    rank: int
    size: int

    def gather(self, values: Sequence[float]) -> np.ndarray:
        """Every rank's values, as a (size, len(values)) array, on every rank."""
        ...

    def share(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values on every rank."""
        ...

    def drain(self) -> None:
        """Returns once every collective submitted before it has finished."""
        ...

    def probe(self, nbytes: int) -> float:
        """Seconds this rank saw one allreduce of `nbytes` take."""
        ...

    def reconfigure(self, settings: dict[str, Any]) -> None:
        """Switches the scheduling settings (every rank calls it at the same boundary)."""
        ...

    def settings(self) -> dict[str, Any]:
        """The settings in effect, with cycle_time."""
        ...


class CommschedCollectives:
    """Collectives through the running commsched core, under reserved tensor names."""

    def __init__(self) -> None:
        import commsched

        self._cs = commsched
        self.rank = commsched.rank()
        self.size = commsched.size()

    def gather(self, values: Sequence[float]) -> np.ndarray:
        """Allgather as a sum allreduce where each rank fills only its own row."""
        table = np.zeros((self.size, len(values)), np.float64)
        table[self.rank] = values
        self._cs.allreduce(table, name=RESERVED_PREFIX + "gather", priority=_URGENT)
        return table

    def share(self, values: Sequence[int]) -> list[int]:
        """Broadcast of a small int64 array from rank 0."""
        array = np.asarray(values, np.int64).copy()
        self._cs.broadcast(array, root=0, name=RESERVED_PREFIX + "share", priority=_URGENT)
        return [int(v) for v in array]

    def drain(self) -> None:
        """A marker with the lowest urgency launches after every queued chunk, and collectives
        on one communicator finish in launch order."""
        self._cs.allreduce(np.zeros(1, np.float32), name=RESERVED_PREFIX + "drain", priority=_LAST)

    def probe(self, nbytes: int) -> float:
        """Times one urgent allreduce of `nbytes` zeros."""
        buffer = np.zeros(max(1, nbytes // 4), np.float32)
        start = time.perf_counter()
        self._cs.allreduce(buffer, name=RESERVED_PREFIX + "probe", priority=_URGENT)
        return time.perf_counter() - start

    def reconfigure(self, settings: dict[str, Any]) -> None:
        """commsched.reconfigure with the four scheduling settings."""
        self._cs.reconfigure(**{name: settings[name] for name in FIELDS})

    def settings(self) -> dict[str, Any]:
        """commsched.config()."""
        return self._cs.config()


def human_size(nbytes: int) -> str:
    """A byte count in the largest binary unit that keeps it whole (1MiB, 384KiB, 1000)."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def env_line(settings: dict[str, Any]) -> str:
    """The COMMSCHED_* assignments that reproduce `settings`."""
    parts = []
    for name in FIELDS:
        value = settings[name]
        parts.append(f"{_ENV[name]}={value if name == 'policy' else human_size(int(value))}")
    return " ".join(parts)


class Tuner:
    """The per-rank state machine driven by one step() per training iteration."""

    def __init__(
        self,
        collectives: Collectives,
        fixed: dict[str, Any],
        options: Options | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.comm = collectives
        self.options = options or Options()
        self.fixed = {name: fixed[name] for name in FIELDS if name in fixed}
        self.clock = clock
        self.iteration = 0  # iterations completed (boundaries passed minus one)
        self.active = True
        self.result: dict[str, Any] | None = None
        self.recording = False
        self._last: float | None = None
        self._iteration_start = 0.0
        self._submissions: list[Submission] = []
        self._recorded: list[Submission] = []  # the last complete iteration's submissions
        self._measured: list[tuple[dict[str, Any], list[float]]] = []
        self._seeds_left = 0
        self._final_value = math.nan
        self._window_total = 0
        self._handles: list[Any] = []
        self._barrier_like = True
        self._window: list[float] = []
        self._window_left = 0
        self._window_skip = 0
        self._window_first = 0
        self._action: Callable[[], None] = self._after_observe
        self._trial = 0
        self._phase = "default"
        self._current: dict[str, Any] = {name: collectives.settings()[name] for name in FIELDS}
        self._search: Search | None = None
        self._confirm: list[dict[str, Any]] = []
        self._confirmed: list[tuple[float, dict[str, Any]]] = []
        self._predictor: Callable[[dict[str, Any]], float] | None = None
        self._log: Any = None
        self._writer: Any = None
        self.link: Link | None = None
        self.mode = "overlap"
        if self.comm.rank == 0 and self.options.log_path:
            self._log = open(self.options.log_path, "w", newline="")  # noqa: SIM115 (kept open while tuning)
            self._writer = csv.writer(self._log)
            self._writer.writerow(LOG_COLUMNS)
            self._log.flush()
        if set(self.fixed) == set(FIELDS):
            log.warning("autotune: every scheduling setting was given explicitly; nothing to tune")
            self._close()

    # -- hooks -------------------------------------------------------------------------------
    def observe(self, name: str, count: int, dtype: str, priority: int, handle: Any = None) -> None:
        """Called for every submitted tensor until the search starts."""
        if not self.recording or name.startswith(RESERVED_PREFIX):
            return
        nbytes = count * DTYPE_SIZES.get(dtype, 4)
        self._submissions.append(Submission(name, nbytes, priority, self.clock() - self._iteration_start))
        if handle is not None:
            self._handles.append(handle)

    def step(self) -> None:
        """Marks the end of one training iteration on this rank."""
        if not self.active:
            return
        now = self.clock()
        if self._last is None:
            self._last = self._iteration_start = now
            self.recording = True
            total = self.options.skip_iterations + self.options.observe_iterations
            self._open_window(total, self._after_observe, skip=self.options.skip_iterations)
            return
        self.iteration += 1
        elapsed, self._last = now - self._last, now
        if self.recording:
            # Everything this iteration submitted already done at its end: a barrier loop.
            self._barrier_like = self._barrier_like and all(h.done() for h in self._handles)
            self._handles.clear()
            self._recorded, self._submissions = self._submissions, []
        position = self._window_total - self._window_left
        if position >= self._window_skip:
            self._window.append(elapsed)
        self._window_left -= 1
        if self._window_left <= 0:
            self._action()
        self._iteration_start = self.clock()

    # -- windows and actions -----------------------------------------------------------------
    def _open_window(self, iterations: int, action: Callable[[], None], skip: int = 0) -> None:
        self._window = []
        self._window_total = self._window_left = max(1, iterations)
        self._window_skip = min(skip, self._window_total - 1)
        self._window_first = self.iteration + 1
        self._action = action

    def _agreed_samples(self) -> list[float]:
        """The window's iteration times, each averaged over ranks (windows match on every rank)."""
        table = self.comm.gather(self._window or [math.nan])
        return [float(v) for v in table.mean(axis=0)]

    def _after_observe(self) -> None:
        samples = self._agreed_samples()
        if self.comm.rank == 0:
            self._measured = [(dict(self._current), samples)]
            self._write("default", self._current, statistics.median(samples))
        self.mode = "barrier" if self._barrier_like else "overlap"
        self._probe_link()
        # The next iteration starts with nothing in flight, so its gradients show pure compute.
        self._open_window(1, self._after_profile)

    def _probe_link(self) -> None:
        """Bandwidth and latency through commsched itself: a big and a tiny allreduce, twice."""
        self.comm.drain()
        total = sum(s.nbytes for s in self._recorded)
        big = int(min(max(total, 1 << 20), 16 << 20))
        samples = []
        for _ in range(2):
            samples.append([self.comm.probe(big), self.comm.probe(4)])
        table = self.comm.gather([v for pair in samples for v in pair]).reshape(self.comm.size, 2, 2)
        # The rank that arrives last sees the collective's own time: take the smallest.
        big_s, small_s = float(table[:, :, 0].min()), float(table[:, :, 1].min())
        n = self.comm.size
        latency = small_s / (math.ceil(math.log2(max(2, n))) + 2 * (n - 1))
        transfer = max(big_s - small_s, 1e-6)
        bandwidth = 2.0 * (n - 1) / max(n, 1) * big / transfer if n > 1 else big / transfer
        cycle = float(self.comm.settings().get("cycle_time", 0.001))
        self.link = Link(max(2, n), bandwidth, latency, cycle)

    def _after_profile(self) -> None:
        self.recording = False
        kind, settings = _FINAL, dict(self._current)
        if self.comm.rank == 0:
            try:
                kind, settings = self._start_search()
            except Exception:  # the search must never take training down: keep the current settings
                log.exception("autotune: could not start the search; keeping the current settings")
                kind, settings = _FINAL, dict(self._current)
        self._apply(*self._share(kind, settings))

    def _start_search(self) -> tuple[int, dict[str, Any]]:
        subs = self._recorded
        fixed = dict(self.fixed)
        space = Space.for_model(fixed, max((s.nbytes for s in subs), default=0), sum(s.nbytes for s in subs))
        seeds: list[dict[str, Any]] = []
        layers = sim_layers(subs)
        if self.link is not None:
            log.info(
                "autotune: %d tensors, %.1f MiB, compute %.1f ms as seen, link %.3f Gbit/s, %.0f us, mode %s",
                len(subs),
                sum(s.nbytes for s in subs) / 2**20,
                sum(f + b for _, f, b, _ in layers) * 1e3,
                self.link.bandwidth_bytes_per_s * 8e-9,
                self.link.latency_s * 1e6,
                self.mode,
            )
        if layers and self.link is not None:
            link, mode = self.link, self.mode
            self._predictor = lambda settings: predict(layers, link, mode, settings)
            ranked = rank_grid(layers, link, mode, space)
            best = {p: min((t for t, s in ranked if s["policy"] == p), default=math.inf) for p in POLICIES}
            if "policy" in space.free() and best["fifo"] > best["priority"] * 1.02:
                # fifo is the corner of priority with partition and credit at their upper bounds, so
                # when the simulator rates it worse the search spends no trials on it.
                space.policies = ("priority",)
                ranked = [(t, s) for t, s in ranked if s["policy"] == "priority"]
            seeds = [settings for _, settings in pick_seeds(ranked, space, self.options.seeds)]
            log.info("autotune: simulator's best %s predicts %.1f ms", ranked[0][1], ranked[0][0] * 1e3)
        self._search = Search(space, self.options, self._predictor)
        # The measured default is placed where the space puts it (e.g. partition off = top bound).
        measured = [(space.from_params(space.to_params(s)), samples) for s, samples in self._measured]
        self._seeds_left = self._search.start(measured, seeds)
        self._search.history = [(dict(s), v) for s, v in self._measured]
        return self._next()

    def _next(self) -> tuple[int, dict[str, Any]]:
        """Rank 0: the next trial, a confirmation, or the final choice."""
        search = self._search
        assert search is not None
        per_trial = self.options.trial_iterations()
        left = self.options.budget_iterations - self.iteration
        if self._phase in ("default", "seed", "search"):
            reserve = self.options.confirm * per_trial
            if left - reserve >= per_trial and not search.exhausted():
                # Optuna hands out the queued seeds first.
                self._phase = "seed" if self._seeds_left > 0 else "search"
                self._seeds_left -= 1
                return _TRIAL, search.ask()
            self._phase = "confirm"
            self._confirm = [s for _, s in search.ranked()[: self.options.confirm]]
            if len(self._confirm) < 2:
                self._confirm = []  # one candidate: nothing to confirm against
        if self._phase == "confirm" and self._confirm and left >= per_trial:
            return _TRIAL, self._confirm.pop(0)
        # The finalists are compared within the confirmation round only: this machine's load drifts,
        # so a time measured early in the search is no fair match for one measured late.
        best_s, best = (
            min(self._confirmed, key=lambda item: item[0]) if self._confirmed else search.ranked()[0]
        )
        self._phase = "final"
        self._final_value = best_s
        return _FINAL, best

    def _after_trial(self) -> None:
        samples = self._agreed_samples()
        kind, settings = _FINAL, dict(self._current)
        if self.comm.rank == 0:
            try:
                search = self._search
                assert search is not None
                if self._phase == "confirm":
                    search.record(self._current, samples)
                    self._confirmed.append((statistics.median(samples), dict(self._current)))
                else:
                    search.tell(self._current, samples)
                self._write(self._phase, self._current, statistics.median(samples))
                kind, settings = self._next()
            except Exception:
                log.exception("autotune: the search failed; keeping the best settings measured so far")
                kind, settings = _FINAL, self._best_or_current()
        self._apply(*self._share(kind, settings))

    def _best_or_current(self) -> dict[str, Any]:
        if self._search and self._search.history:
            return self._search.ranked()[0][1]
        return dict(self._current)

    def _share(self, kind: int, settings: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Rank 0's decision on every rank: [kind, policy index, partition, credit, fusion]."""
        values = [kind, POLICIES.index(settings["policy"])] + [int(settings[n]) for n in FIELDS[1:]]
        shared = self.comm.share(values)
        return shared[0], dict(zip(FIELDS, [POLICIES[shared[1]], *shared[2:]]))

    def _apply(self, kind: int, settings: dict[str, Any]) -> None:
        if settings_key(settings) != settings_key(self._current):
            self.comm.reconfigure(settings)
            self._current = dict(settings)
        if kind == _FINAL:
            self._finish(settings)
            return
        self._trial += 1
        self._open_window(
            self.options.trial_iterations(), self._after_trial, skip=self.options.settle_iterations
        )

    def _finish(self, settings: dict[str, Any]) -> None:
        default_s = statistics.median(self._measured[0][1]) if self._measured else math.nan
        final_s = self._final_value
        self.result = {
            **settings,
            "env": env_line(settings),
            "iteration_s": final_s,
            "default_s": default_s,
            "trials": self._trial,
            "iterations": self.iteration,
        }
        if self.comm.rank == 0:
            self._write("final", settings, final_s)
            if self.options.report:
                print(
                    f"commsched autotune: chose {env_line(settings)} (iteration {final_s * 1e3:.1f} ms, "
                    f"{default_s * 1e3:.1f} ms with the starting settings; {self._trial} trials "
                    f"in {self.iteration} iterations)",
                    file=sys.stderr,
                    flush=True,
                )
        self._close()

    def close(self) -> None:
        """Stops tuning where it stands (commsched.shutdown calls it)."""
        self._close()

    def _close(self) -> None:
        self.active = False
        self.recording = False
        if self._log is not None:
            self._log.close()
            self._log = None

    def _write(self, phase: str, settings: dict[str, Any], value: float) -> None:
        if self._writer is None or self._log is None:
            return
        predicted = math.nan
        if self._predictor is not None:
            try:
                predicted = self._predictor(settings)
            except (ValueError, RuntimeError):  # a prediction is only informative
                predicted = math.nan
        best = self._search.ranked()[0][0] if self._search and self._search.history else value
        first = self._window_first
        self._writer.writerow(
            [self._trial, phase, first, self.iteration, *(settings[n] for n in FIELDS)]
            + [f"{value:.6g}", f"{predicted:.6g}", f"{min(best, value):.6g}"]
        )
        self._log.flush()


def start(options: Options | None = None, starting: Iterable[str] = ()) -> Tuner:
    """Starts tuning on this rank after init(); every rank calls it. init(autotune=True) does.

    Settings named in `starting` are tuned even where init() or COMMSCHED_* gave them: the
    given value is where the search starts, not a choice to keep.
    """
    import commsched

    starting = (starting,) if isinstance(starting, str) else tuple(starting)
    unknown = sorted(set(starting) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"autotune.start(starting=...): {unknown} are not tuned settings; use names from {FIELDS}"
        )
    state = commsched._state
    if state.settings is None:
        raise RuntimeError("commsched.autotune.start() needs commsched.init() first")
    options = options or Options()
    if not options.log_path:
        options.log_path = state.settings.autotune_log
    if state.tuner is not None:
        state.tuner.close()
    settings = commsched.config()
    kept = state.user_given - frozenset(starting)
    fixed = {name: settings[name] for name in FIELDS if name in kept}
    if commsched.rank() == 0:
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "COMMSCHED_AUTOTUNE=1 needs optuna on rank 0: pip install optuna (or commsched[autotune])"
            ) from None
    state.tuner = Tuner(CommschedCollectives(), fixed, options)
    return state.tuner


def result() -> dict[str, Any] | None:
    """The chosen settings with their COMMSCHED_* line once tuning ended; None before."""
    import commsched

    tuner = commsched._state.tuner
    return None if tuner is None else tuner.result
