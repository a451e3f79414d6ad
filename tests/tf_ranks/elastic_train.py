"""An elastic TensorFlow training rank for tests/test_tf_elastic.py, run under `commsched-run --min-np`.

A Keras linear model whose gradient does not depend on its weights (the loss is the sum of the
outputs), integer data the same on every rank, averaged gradients and SGD with a learning rate of
1/8: the final weights are exactly -lr times the sum of every step's gradient, so a step lost or
applied twice across the failure shows. The state commits every second step; the rank launched as
ELASTIC_KILL SIGKILLs itself after applying step ELASTIC_KILL_STEP, so the survivors have applied
an uncommitted step when they notice the loss and must roll it back. With ELASTIC_AWAIT_STOP=1
the survivors wait for their core to stop before the next step, so the loss shows at the start
of optimizer.apply() rather than inside a collective. Results go to ELASTIC_OUT.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json
import signal
import time
from pathlib import Path

import commsched.tensorflow.keras as hvd
import keras
import numpy as np
import tensorflow as tf

import commsched

STEPS, FEATURES, ROWS, COMMIT_EVERY = 8, 3, 4, 2
OUT = Path(os.environ["ELASTIC_OUT"])
LAUNCH_ID = int(os.environ.get("COMMSCHED_ELASTIC_ID", os.environ.get("RANK", "0")))
KILL_ID = int(os.environ.get("ELASTIC_KILL", "-1"))
KILL_STEP = int(os.environ.get("ELASTIC_KILL_STEP", "-1"))
AWAIT_STOP = os.environ.get("ELASTIC_AWAIT_STOP") == "1"


def await_stop(seconds: float = 30.0) -> None:
    """Waits until this rank's core stopped on the lost rank (or `seconds` passed)."""
    deadline = time.monotonic() + seconds
    while commsched.is_initialized() and time.monotonic() < deadline:
        time.sleep(0.05)


def data(step: int) -> np.ndarray:
    """Step `step`'s batch: small integers, the same on every rank."""
    return np.random.default_rng(step).integers(-3, 4, (ROWS, FEATURES)).astype(np.float32)


def main() -> None:
    hvd.init()
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(np.zeros((FEATURES, 1), np.float32))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.125))
    state = hvd.elastic.KerasState(model, optimizer, batch=0, applied=[])

    def on_reset() -> None:
        # Written once, by the first re-formed rank 0: what every survivor rolled back to.
        if hvd.rank() == 0 and not (OUT / "restored.json").exists():
            (OUT / "restored.json").write_text(json.dumps({"batch": state.batch, "size": hvd.size()}))

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        for step in range(state.batch, STEPS):
            if AWAIT_STOP and step == KILL_STEP + 1 and hvd.size() > 1:
                await_stop()
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(data(step)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            state.applied.append(step)
            if LAUNCH_ID == KILL_ID and step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            state.batch = step + 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    if hvd.rank() == 0:
        result = {
            "size": hvd.size(),
            "batch": state.batch,
            "applied": state.applied,
            "kernel": model.layers[0].kernel.numpy().ravel().tolist(),
        }
        (OUT / "final.json").write_text(json.dumps(result))
    hvd.shutdown()


if __name__ == "__main__":
    main()
