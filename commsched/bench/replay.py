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


def shard_buckets(layers: list[TimedLayer], limit: int) -> list[list[int]]:
    """Parameter positions cut into buckets as `shard=True` cuts them (plugins/torch/_shard_layout.plan).

    Consecutive parameters in forward order, at most `limit` float32 bytes each; a parameter bigger
    than `limit` gets a bucket of its own; `limit` 0 means one bucket, below 0 one per parameter.
    """
    counts = [count for layer in layers for _, count in layer.params]
    buckets: list[list[int]] = []
    held = 0
    for position, count in enumerate(counts):
        nbytes = 4 * count
        if not buckets or limit < 0 or (limit > 0 and held + nbytes > limit):
            buckets.append([])
            held = 0
        buckets[-1].append(position)
        held += nbytes
    return buckets


def cut_params(layers: list[TimedLayer], limit_bytes: int, ranks: int = 1) -> list[TimedLayer]:
    """The layers with each parameter over `limit_bytes` as the pieces `shard=True` cuts it into.

    As plugins/torch/_shard_layout.pieces: float32 pieces of at most `limit_bytes`, each a multiple
    of `ranks` elements (the last one the rest); `limit_bytes` 0 or below cuts nothing.
    """
    if limit_bytes <= 0:
        return layers
    step = max(ranks, limit_bytes // 4 // ranks * ranks)
    return [
        TimedLayer(
            l.name,
            l.forward_s,
            l.backward_s,
            [
                (f"{name}.{k // step}" if 4 * count > limit_bytes else name, min(step, count - k))
                for name, count in l.params
                for k in (range(0, count, step) if 4 * count > limit_bytes else (0,))
            ],
        )
        for l in layers
    ]


def cut_grads(layers: list[TimedLayer], grads: list[Any], limit_bytes: int, ranks: int) -> list[Any]:
    """`grads` (one array per parameter of `layers`) cut as cut_params cuts the parameters: views of them."""
    if limit_bytes <= 0:
        return grads
    step = max(ranks, limit_bytes // 4 // ranks * ranks)
    counts = [count for layer in layers for _, count in layer.params]
    return [
        grad[k : k + step] if 4 * count > limit_bytes else grad
        for count, grad in zip(counts, grads)
        for k in (range(0, count, step) if 4 * count > limit_bytes else (0,))
    ]


def bucket_limit(settings: dict[str, Any], ranks: int) -> int:
    """Training's bucket limit (plugins/torch/_reducer.bucket_limit) for these settings, as shard_buckets takes it."""
    given = settings.get("bucket_bytes")
    if given is not None:
        return int(given) if given > 0 else -1  # COMMSCHED_BUCKET_BYTES=0: buckets off
    partition = int(settings.get("partition_bytes") or 0)
    return partition if ranks > 1 and partition > 0 else 0


def shard_sim_layers(
    layers: list[TimedLayer], limit: int, ranks: int, whole: bool = False
) -> list[tuple[str, float, float, list[int]]]:
    """The simulator's view of the bucketed split: each bucket's padded bytes in its first parameter's layer.

    A bucket's first parameter is the last of its gradients the backward makes and the first the
    forward uses, so that layer is where it is reduce-scattered and where the forward waits for it.
    Parameters over the limit are cut into pieces as training cuts them, unless `whole`.
    """
    layers = layers if whole else cut_params(layers, limit, ranks)
    counts = [count for layer in layers for _, count in layer.params]
    layer_of = [j for j, layer in enumerate(layers) for _ in layer.params]
    sizes: list[list[int]] = [[] for _ in layers]
    for members in shard_buckets(layers, limit):
        total = sum(counts[p] for p in members)
        sizes[layer_of[members[0]]].append(4 * (total + -total % ranks))
    return [(l.name, l.forward_s, l.backward_s, held) for l, held in zip(layers, sizes)]


def replay_shard(
    layers: list[TimedLayer], grads: list[Any], mode: str, iterations: int, warmup: int, whole: bool = False
) -> list[float]:
    """The training loop of ZeRO-2's split on this rank, bucketed as `shard=True`; returns each period.

    Gradients go in the flat buckets training lays out (forward order, at most the bucket limit, a
    parameter over it cut into pieces across buckets unless `whole`, padded to a multiple of the
    ranks); backward reduce-scatters a bucket once its last gradient is
    ready, with its first parameter's forward position as priority. overlap: after the backward,
    each bucket is stepped and its shard all-gathered once its own reduce-scatter is done (checked at
    every layer boundary), and each layer's forward waits for its own buckets' gathers only;
    barrier: the step waits for every reduce-scatter, then the gathers go in forward order and the
    first layer waits for all of them (ZeRO and Megatron without overlap).
    """
    import numpy as np

    import commsched

    ranks = commsched.size()
    limit = bucket_limit(commsched.config(), ranks)
    if not whole:
        grads = cut_grads(layers, grads, limit, ranks)
        layers = cut_params(layers, limit, ranks)
    buckets = shard_buckets(layers, limit)
    layer_of = [j for j, layer in enumerate(layers) for _ in layer.params]
    names = [name for layer in layers for name, _ in layer.params]
    bucket_of = [0] * len(layer_of)
    for b, members in enumerate(buckets):
        for position in members:
            bucket_of[position] = b
    flats = []
    for members in buckets:
        flat = np.concatenate([grads[p] for p in members])
        flats.append(np.pad(flat, (0, -len(flat) % ranks)))
    own_positions: list[list[int]] = [[] for _ in layers]
    for position, j in enumerate(layer_of):
        own_positions[j].append(position)
    needs = [sorted({bucket_of[p] for p in positions}) for positions in own_positions]
    gathers: dict[int, Any] = {}
    scatters: dict[int, Any] = {}

    def step(b: int) -> None:
        shard = scatters.pop(b).wait()
        gathers[b] = commsched.allgather_async(
            shard, name=f"{names[buckets[b][0]]}.param", priority=buckets[b][0]
        )

    def step_done() -> None:
        for b in sorted(b for b, handle in scatters.items() if handle.done()):
            step(b)

    def wait_gathers(wanted: list[int]) -> bool:
        waited = False
        for b in wanted:
            handle = gathers.pop(b, None)
            if handle is not None:
                waited = waited or not handle.done()
                handle.wait()
        return waited

    starts: list[float] = []
    _tighten_timer_slack()
    clock = time.perf_counter()  # compute keeps its plan; only waits for communication move it
    for iteration in range(warmup + iterations + 1):
        for j, layer in enumerate(layers):
            if mode == "overlap" or j == 0:
                step_done()
                # This layer's buckets not yet stepped wait for their reduce-scatter now.
                own = [b for b in needs[j] if b in scatters] if mode == "overlap" else []
                waited = any(not scatters[b].done() for b in own)
                for b in own:
                    step(b)
                waited = wait_gathers(sorted(gathers) if mode == "barrier" else needs[j]) or waited
                if waited:
                    clock = max(clock, time.perf_counter())
            if j == 0:
                starts.append(clock)
                if iteration == warmup + iterations:
                    break
            clock += layer.forward_s
            _sleep_until(clock)
        else:
            missing = [len(members) for members in buckets]
            for back, positions in zip(reversed(layers), reversed(own_positions)):
                clock += back.backward_s
                _sleep_until(clock)
                for position in reversed(positions):
                    b = bucket_of[position]
                    missing[b] -= 1
                    if missing[b] == 0:
                        scatters[b] = commsched.reducescatter_async(
                            flats[b], name=f"{names[buckets[b][0]]}.grad", priority=buckets[b][0]
                        )
            if mode == "barrier":
                waited = not all(handle.done() for handle in scatters.values())
                for b in sorted(scatters):
                    step(b)
                if waited:
                    clock = max(clock, time.perf_counter())
    for b in sorted(scatters):  # the last iteration ends at its first layer: finish its step
        step(b)
    wait_gathers(sorted(gathers))
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
