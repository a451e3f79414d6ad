"""Rank script: hvd.SyncBatchNormalization and the elastic states of commsched.tensorflow.

SyncBatchNormalization on batches of different sizes per rank must give each rank its rows of one
plain BatchNormalization over the concatenated batch (outputs, moving statistics, and gradients:
the inputs' per rank, gamma's and beta's summed over the ranks), eagerly and in tf.function.
TensorFlowState and KerasState must broadcast rank 0's values at sync, roll back to the last
commit at restore (the optimizer's slots too) and keep what commit() took. Prints "PASS <check>"
or "FAIL <check> ..." per check.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys

import commsched.tensorflow as hvd
import commsched.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf
from tf_common import Checks

CHANNELS = 3


def batches(size: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    """Rank r's batch has r + 2 samples: unequal batches, which a mean of the ranks' means gets wrong."""
    generator = np.random.default_rng(5)
    return [generator.normal(2.0 + r, 1.0 + r, (r + 2, *shape)).astype(np.float32) for r in range(size)]


def compare_bn(shape: tuple[int, ...], axis: int, compiled: bool) -> None:
    """One training step of SyncBatchNormalization per rank against BatchNormalization on all rows."""
    rank, size = hvd.rank(), hvd.size()
    parts = batches(size, shape)
    whole = np.concatenate(parts)
    start = sum(len(p) for p in parts[:rank])
    weights = np.random.default_rng(9).normal(size=whole.shape).astype(np.float32)

    def step(layer: keras.layers.Layer, x: np.ndarray, w: np.ndarray) -> tuple[tf.Tensor, list[tf.Tensor]]:
        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True)
            loss = tf.reduce_sum(out * w)
        return out, tape.gradient(loss, [x, layer.gamma, layer.beta])

    reference = keras.layers.BatchNormalization(axis=axis, momentum=0.5)
    synced = hvd.SyncBatchNormalization(axis=axis, momentum=0.5)
    run = tf.function(step) if compiled else step
    want, want_grads = step(reference, whole, weights)
    got, got_grads = run(synced, parts[rank], weights[start : start + len(parts[rank])])
    rows = slice(start, start + len(parts[rank]))
    np.testing.assert_allclose(got.numpy(), want.numpy()[rows], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        synced.moving_mean.numpy(), reference.moving_mean.numpy(), rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(
        synced.moving_variance.numpy(), reference.moving_variance.numpy(), rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(got_grads[0].numpy(), want_grads[0].numpy()[rows], rtol=1e-3, atol=1e-4)
    for got_param, want_param in zip(got_grads[1:], want_grads[1:]):
        summed = hvd.allreduce(got_param, op=hvd.Sum, name=f"bn-grad.{compiled}.{axis}")
        np.testing.assert_allclose(summed.numpy(), want_param.numpy(), rtol=1e-4, atol=1e-4)
    # Inference uses the moving statistics, with no collective: ranks may call it alone.
    np.testing.assert_allclose(
        synced(parts[rank], training=False).numpy(),
        reference(parts[rank], training=False).numpy(),
        rtol=1e-4,
        atol=1e-5,
    )


def sync_bn() -> None:
    compare_bn((CHANNELS,), -1, compiled=False)
    compare_bn((CHANNELS, 2, 2), 1, compiled=False)  # channels first, as Horovod's test lays it out
    compare_bn((2, CHANNELS), -1, compiled=True)
    for fused in (True, None):
        try:
            hvd.SyncBatchNormalization(fused=fused)
        except ValueError as error:
            assert "fused" in str(error), error
        else:
            raise AssertionError(f"fused={fused} was accepted")


def tensorflow_state() -> None:
    rank = hvd.rank()
    variables = [tf.Variable(np.full((2, 2), 1.0 + rank)), tf.Variable(np.full(2, 1.0 + rank))]
    state = hvd.elastic.TensorFlowState(variables, batch=20 + rank)
    state.sync()
    assert [v.numpy().tolist() for v in variables] == [[[1.0, 1.0]] * 2, [1.0, 1.0]], "not rank 0's values"
    assert state.batch == 20
    variables[0].assign(np.full((2, 2), 7.0))
    state.batch = 21
    state.restore()
    assert variables[0].numpy().tolist() == [[1.0, 1.0]] * 2 and state.batch == 20, (
        "restore did not roll back"
    )
    variables[1].assign(np.full(2, 5.0 + rank))
    state.batch = 22
    state.commit()
    variables[1].assign(np.zeros(2))
    state.restore()
    assert variables[1].numpy().tolist() == [5.0 + rank] * 2 and state.batch == 22, "commit was not kept"


def keras_state() -> None:
    rank = hvd.rank()
    keras.utils.set_random_seed(rank)  # different weights per rank until the sync
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1))
    state = hvd_keras.elastic.KerasState(model, optimizer, epoch=10 + rank)
    state.sync()
    synced = [w.copy() for w in model.get_weights()]
    everyone = hvd.allgather_object(synced)
    for theirs in everyone:
        for a, b in zip(theirs, synced):
            np.testing.assert_array_equal(a, b)
    assert state.epoch == 10

    def train_step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(np.ones((1, 2), np.float32)) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    slots = [v.numpy().copy() for v in optimizer.variables]
    train_step()
    state.epoch = 11
    state.restore()
    for a, b in zip(model.get_weights(), synced):
        np.testing.assert_array_equal(a, b)
    for variable, value in zip(optimizer.variables, slots):
        np.testing.assert_array_equal(variable.numpy(), value)  # Adam's moments and iterations too
    assert state.epoch == 10
    train_step()
    state.epoch = 12
    state.commit()
    stepped = [w.copy() for w in model.get_weights()]
    train_step()
    state.restore()
    for a, b in zip(model.get_weights(), stepped):
        np.testing.assert_array_equal(a, b)
    assert int(optimizer.iterations.numpy()) == 1 and state.epoch == 12  # the committed step


def keras_callbacks() -> None:
    """fit() with the elastic callbacks: commits every 2nd batch and at each epoch's end, state.batch
    follows the batches and is 0 after an epoch, state.epoch counts from the state's epoch."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=3)
    commits: list[tuple[int, int]] = []
    batches_seen: list[int] = []
    commit = state.commit

    def counted_commit() -> None:
        commits.append((state.epoch, state.batch))
        commit()

    state.commit = counted_commit  # type: ignore[method-assign]

    class Spy(keras.callbacks.Callback):
        def on_batch_end(self, batch: int, logs: object = None) -> None:
            batches_seen.append(state.batch)

    x, y = np.ones((6, 2), np.float32), np.zeros((6, 1), np.float32)
    callbacks = [
        hvd_keras.elastic.UpdateBatchStateCallback(state),
        hvd_keras.elastic.UpdateEpochStateCallback(state),
        hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2),
        Spy(),
    ]
    model.fit(x, y, batch_size=2, epochs=2, callbacks=callbacks, verbose=0)
    assert batches_seen == [0, 1, 2, 0, 1, 2], batches_seen
    assert state.epoch == 5 and state.batch == 0, (state.epoch, state.batch)
    # Every 2nd batch end, counted across epochs, commits; so does each epoch's end, after the
    # batch and epoch callbacks updated the state.
    assert commits == [(3, 1), (4, 0), (4, 0), (4, 2), (5, 0)], commits


def main() -> int:
    """Runs the checks on this rank; the exit status counts the failures."""
    hvd.init()
    assert hvd.size() >= 2, "run on 2 ranks or more"
    check = Checks()
    check("sync-batch-norm", sync_bn)
    check("tensorflow-state", tensorflow_state)
    check("keras-state", keras_state)
    check("keras-callbacks", keras_callbacks)
    hvd.shutdown()
    return check.failures


if __name__ == "__main__":
    sys.exit(main())
