"""The replayed training loop of `commsched-bench schedule`: compute emulated by sleeping, real
gradient buffers through the real transport, in barrier or overlap mode.

Compute is emulated by sleeping (the CPU stays free, as it would with a GPU doing the work);
the gradients are float32 buffers of the profile's sizes.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from dataclasses import dataclass
from typing import Any

_PR_SET_TIMERSLACK = 29  # from <linux/prctl.h>


@dataclass
class TimedLayer:
    """One layer as replayed: compute seconds and its parameters' (name, element count)."""

    name: str
    forward_s: float
    backward_s: float
    params: list[tuple[str, int]]


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def _tighten_timer_slack() -> None:
    """Asks Linux to wake this thread's sleeps within 1 us (the default slack is 50 us)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: sleeps keep the platform's precision


def replay(
    layers: list[TimedLayer], grads: list[Any], mode: str, iterations: int, warmup: int
) -> list[float]:
    """Runs the training loop on this rank; returns each measured period between first-layer forwards."""
    import commsched

    index_of = {}
    for layer in layers:
        for name, _ in layer.params:
            index_of[name] = len(index_of)
    handles: list[list[Any]] = [[] for _ in layers]
    starts: list[float] = []
    _tighten_timer_slack()
    # Compute ends where it was planned to, not where a sleep happened to wake up: a GPU does
    # not overshoot, and a few tens of microseconds per layer would add up over hundreds of
    # layers. Only waiting for communication moves the plan later.
    clock = time.perf_counter()
    for iteration in range(warmup + iterations + 1):
        for j, layer in enumerate(layers):
            if mode == "overlap" or j == 0:
                waited = False
                for pending in handles if mode == "barrier" else [handles[j]]:
                    for handle in pending:
                        waited = waited or not handle.done()
                        handle.wait()
                    pending.clear()
                if waited:
                    clock = max(clock, time.perf_counter())
            if j == 0:
                tuning_start = time.perf_counter()
                commsched.autotune_step()  # the iteration boundary; a no-op unless autotune is on
                clock += time.perf_counter() - tuning_start  # the tuner's own time counts
                starts.append(clock)
                if iteration == warmup + iterations:
                    break
            clock += layer.forward_s
            _sleep_until(clock)
        else:
            for j in range(len(layers) - 1, -1, -1):
                layer = layers[j]
                clock += layer.backward_s
                _sleep_until(clock)
                for name, _ in reversed(layer.params):
                    position = index_of[name]
                    handles[j].append(
                        commsched.allreduce_async(grads[position], name=name, priority=position)
                    )
    for pending in handles:
        for handle in pending:
            handle.wait()
    return [later - earlier for earlier, later in zip(starts[warmup:], starts[warmup + 1 :])]


_WARM_UP_ITERATIONS = 10


def round_share(iterations: int, rounds: int, round_index: int) -> int:
    """The measured iterations of round `round_index` when `iterations` are spread over `rounds`."""
    return iterations // rounds + (1 if round_index < iterations % rounds else 0)


def warm_up(
    layers: list[TimedLayer],
    grads: list[Any],
    bandwidth: float,
    latency: float,
    sizes: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    """An unmeasured replay before the measured ones, so no policy pays for the process's first.

    The first replay in a process ran 5-10% slower over all its iterations than the same policy
    run again (VGG-16 and ResNet-50 on MPICH shared memory): the transport's buffers and the
    gradient arrays are touched for the first time. Measured policies then start equal.
    """
    import commsched

    commsched.init(
        policy="fifo",
        transport="mpi",
        cycle_time=args.cycle_time,
        link_bandwidth=bandwidth,
        link_latency=latency,
        **sizes,
    )
    try:
        replay(layers, grads, "barrier", _WARM_UP_ITERATIONS, 0)
    finally:
        commsched.shutdown()
