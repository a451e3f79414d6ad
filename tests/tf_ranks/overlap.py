"""In tf.function, the first gradient's reduction is on the wire before the backward pass ends.

Run as `mpiexec -n 2 python -m mpi4py overlap.py TIMELINE_DIR`. Trains a deep MLP whose
early layers are expensive, first with DistributedGradientTape in a tf.function loop,
then with Keras fit() and DistributedOptimizer, and reads the commsched timelines (wall
clock, so ranks on one host compare): per step, the backward pass ends when the last
rank's last gradient reaches the core (the latest "negotiate" begin); the first
gradient's reduction starts when the last rank puts it "on the wire". Ranks meet at a
barrier before each step so that one rank's head start does not count as overlap.
Prints `PASS <config>` when that start comes over 10 ms before that end in at least three of
the eight measured steps (gradients reduced only after the whole backward pass measure 0-5 ms;
on a loaded host TensorFlow's executor sometimes issues the first reduction late, so not every
step shows the overlap the scheduler allows).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import commsched.tensorflow as cst
import keras
import numpy as np
import tensorflow as tf
import tf_common as common

import commsched

BATCH, WIDTH, DEPTH, STEPS = 256, 1024, 5, 9
MARGIN_US = 10_000
MIN_OVERLAPPED_STEPS = 3


def model() -> keras.Model:
    """Wide early layers (slow to differentiate) and a small head (its gradient comes first)."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((WIDTH,))]
    layers += [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def steps(path: Path, prefix: str) -> list[tuple[float, float]]:
    """Per step: (first gradient's wire start, last gradient's submission), in microseconds."""
    events = json.loads(path.read_text())
    submitted: dict[int, tuple[str, float]] = {}
    wire: dict[int, float] = {}
    for event in events:
        if event.get("ph") != "b" or not str(event.get("args", {}).get("tensor", "")).startswith(prefix):
            continue
        if event["name"] == "negotiate":
            submitted[event["id"]] = (event["args"]["tensor"], float(event["ts"]))
        elif event["name"] == "on the wire":
            wire[event["id"]] = min(wire.get(event["id"], float("inf")), float(event["ts"]))
    by_tensor: dict[str, list[int]] = defaultdict(list)
    for trace_id, (tensor, ts) in sorted(submitted.items(), key=lambda item: item[1][1]):
        by_tensor[tensor].append(trace_id)
    count = min(len(ids) for ids in by_tensor.values())
    result = []
    for step in range(count):
        ids = [ids[step] for ids in by_tensor.values()]
        first = min(ids, key=lambda i: submitted[i][1])
        result.append((wire[first], max(submitted[i][1] for i in ids)))
    return result


def everyone(measured: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per step, the latest first-reduction start and the latest backward end over all ranks."""
    from mpi4py import MPI  # commsched is shut down by now, so its thread no longer uses MPI

    tables = MPI.COMM_WORLD.allgather(np.asarray(measured))
    return [(float(start), float(end)) for start, end in np.max(tables, axis=0)]


def barrier(step: int) -> None:
    """All ranks start a step together (a commsched allreduce doubles as the barrier)."""
    commsched.allreduce(np.zeros(1), name=f"barrier.{step}")


class Barrier(keras.callbacks.Callback):
    """The barrier before each fit() batch."""

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        """Waits for every rank."""
        barrier(batch)


def report(label: str, rank: int, measured: list[tuple[float, float]]) -> None:
    """PASS when, in enough steps after the first (tracing), the first reduction began well before backward ended."""
    later = measured[1:]
    early = [last - start for start, last in later]
    # A margin: ops submitted one after another once backward is over still lead by a few ms.
    overlapped = sum(1 for lead in early if lead > MARGIN_US)
    verdict = "PASS" if overlapped >= MIN_OVERLAPPED_STEPS else "FAIL"
    leads = ", ".join(f"{lead / 1000:.1f}" for lead in early)
    print(
        f"{verdict} {label} rank={rank} overlapped {overlapped}/{len(later)} steps; "
        f"first reduction began this many ms before backward ended: {leads}",
        flush=True,
    )


def main() -> None:
    """Trains both ways with a timeline in the folder named first on the command line."""
    run(Path(sys.argv[1]))


def run(directory: Path, prefix: str = "") -> None:
    """Trains both ways with a timeline in `directory`, then checks this rank's trace; each verdict's
    label starts with `prefix`."""
    # Inline payloads would take the small gradients off the wire, and this reads wire events.
    commsched.init(timeline=str(directory / "trace.{rank}.json"), inline_bytes=0)
    rank = commsched.rank()
    rng = np.random.RandomState(rank)
    x = rng.randn(STEPS * BATCH, WIDTH).astype(np.float32)
    y = rng.randint(0, 10, STEPS * BATCH).astype(np.int32)

    net = model()
    optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = common.loss_fn(yb, net(xb))
        grads = cst.DistributedGradientTape(tape).gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables))

    for index, start in enumerate(range(0, len(x), BATCH)):
        barrier(index)
        step(x[start : start + BATCH], y[start : start + BATCH])

    net = model()
    net.compile(optimizer=cst.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=common.loss_fn)
    net.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0, callbacks=[Barrier()])
    commsched.shutdown()  # flushes the timeline

    trace = directory / f"trace.{rank}.json"
    measured = {
        "tape": steps(trace, "DistributedGradientTape."),
        "fit": steps(trace, "DistributedOptimizer."),
    }
    for label, values in measured.items():
        report(prefix + label, rank, everyone(values))


if __name__ == "__main__":
    main()
