"""The replayed training loop of `commsched-bench schedule`: compute emulated by sleeping, real
gradient buffers through the real transport, in barrier or overlap mode, allreduced or split into
reduce-scatter and all-gather (ZeRO-2).

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


def _wait_all(pendings: list[list[Any]]) -> bool:
    """Waits for every handle in `pendings` and empties them; True when one was not done yet."""
    waited = False
    for pending in pendings:
        for handle in pending:
            waited = waited or not handle.done()
            handle.wait()
        pending.clear()
    return waited


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
                waited = _wait_all(handles if mode == "barrier" else [handles[j]])
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
    _wait_all(handles)
    return [later - earlier for earlier, later in zip(starts[warmup:], starts[warmup + 1 :])]


def replay_shard(
    layers: list[TimedLayer], grads: list[Any], mode: str, iterations: int, warmup: int
) -> list[float]:
    """The training loop of ZeRO-2's split on this rank; returns each measured period.

    Backward reduce-scatters each gradient with its forward position as priority. overlap: after
    the backward, each parameter is stepped and its shard all-gathered once its own reduce-scatter
    is done (checked at every layer boundary), and each layer's forward waits for its own gathers
    only; barrier: the step waits for every reduce-scatter, then the gathers go in forward order and
    the first layer waits for all of them (ZeRO and Megatron without overlap).
    """
    import commsched

    index_of = {}
    for layer in layers:
        for name, _ in layer.params:
            index_of[name] = len(index_of)
    layer_of = [j for j, layer in enumerate(layers) for _ in layer.params]
    names = [name for layer in layers for name, _ in layer.params]
    gathers: list[list[Any]] = [[] for _ in layers]
    scatters: dict[int, Any] = {}

    def step(position: int) -> None:
        shard = scatters.pop(position).wait()
        gathers[layer_of[position]].append(
            commsched.allgather_async(shard, name=f"{names[position]}.param", priority=position)
        )

    def step_done() -> None:
        for position in sorted(p for p, handle in scatters.items() if handle.done()):
            step(position)

    starts: list[float] = []
    _tighten_timer_slack()
    clock = time.perf_counter()  # compute keeps its plan; only waits for communication move it
    for iteration in range(warmup + iterations + 1):
        for j, layer in enumerate(layers):
            if mode == "overlap" or j == 0:
                step_done()
                # This layer's parameters not yet stepped wait for their reduce-scatter now.
                own = [p for p in sorted(scatters) if layer_of[p] == j] if mode == "overlap" else []
                waited = any(not scatters[p].done() for p in own)
                for position in own:
                    step(position)
                waited = _wait_all(gathers if mode == "barrier" else [gathers[j]]) or waited
                if waited:
                    clock = max(clock, time.perf_counter())
            if j == 0:
                starts.append(clock)
                if iteration == warmup + iterations:
                    break
            clock += layer.forward_s
            _sleep_until(clock)
        else:
            for back in reversed(layers):
                clock += back.backward_s
                _sleep_until(clock)
                for name, _ in reversed(back.params):
                    position = index_of[name]
                    scatters[position] = commsched.reducescatter_async(
                        grads[position], name=f"{name}.grad", priority=position
                    )
            if mode == "barrier":
                waited = not all(handle.done() for handle in scatters.values())
                for position in sorted(scatters):
                    step(position)
                if waited:
                    clock = max(clock, time.perf_counter())
    for position in sorted(scatters):  # the last iteration ends at its first layer: finish its step
        step(position)
    _wait_all(gathers)
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
