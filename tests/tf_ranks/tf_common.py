"""Models, data and single-process references shared by the TensorFlow plug-in rank scripts.

The reference is one process trained on the whole global batch with the plain optimizer
or tape: averaging per-rank gradients of equal shards must reproduce it exactly (up to
float rounding).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, VOCAB, PER_RANK, STEPS = 6, 3, 12, 4, 5
TOLERANCE = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-10}


def dense_model(dtype: str = "float32") -> keras.Model:
    """An MLP whose layers are declared in forward order (a Sequential)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,), dtype=dtype),
            keras.layers.Dense(16, activation="tanh", dtype=dtype),
            keras.layers.Dense(CLASSES, dtype=dtype),
        ]
    )


class EmbeddingNet(keras.Model):
    """Declared head first, used embedding first, so declared order is not forward order."""

    def __init__(self, dtype: str) -> None:
        super().__init__(dtype=dtype)
        self.head = keras.layers.Dense(CLASSES, dtype=dtype)
        self.embed = keras.layers.Embedding(VOCAB, 8, dtype=dtype)
        self.hidden = keras.layers.Dense(8, activation="tanh", dtype=dtype)

    def call(self, tokens: tf.Tensor) -> tf.Tensor:
        pooled = tf.reduce_mean(self.embed(tokens), axis=1)
        return self.head(self.hidden(pooled))


def embedding_model(dtype: str) -> keras.Model:
    """The embedding model, built, with seeded weights."""
    keras.utils.set_random_seed(0)
    model = EmbeddingNet(dtype)
    model(np.zeros((1, 3), np.int32))
    return model


def dense_data(size: int) -> tuple[np.ndarray, np.ndarray]:
    """STEPS global batches of size*PER_RANK samples, laid out batch after batch."""
    rng = np.random.RandomState(1)
    x = rng.randn(STEPS * size * PER_RANK, FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, STEPS * size * PER_RANK).astype(np.int32)
    return x, y


def token_data(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences (only part of the vocabulary per batch, so gradients are sparse)."""
    rng = np.random.RandomState(2)
    x = rng.randint(0, VOCAB // 2, (STEPS * size * PER_RANK, 3)).astype(np.int32)
    y = rng.randint(0, CLASSES, STEPS * size * PER_RANK).astype(np.int32)
    return x, y


def shard(array: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This rank's PER_RANK samples of every global batch, in batch order."""
    batches = array.reshape(STEPS, size * PER_RANK, *array.shape[1:])
    return batches[:, rank * PER_RANK : (rank + 1) * PER_RANK].reshape(STEPS * PER_RANK, *array.shape[1:])


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean cross-entropy; float16 logits are promoted so the loss itself does not overflow."""
    if logits.dtype == tf.float16:
        logits = tf.cast(logits, tf.float32)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def train_loop(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    x: np.ndarray,
    y: np.ndarray,
    batch: int,
    wrap: Callable[[tf.GradientTape], Any] = lambda tape: tape,
) -> None:
    """A custom tf.function loop over consecutive batches; `wrap` may distribute the tape."""

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        tape = wrap(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for start in range(0, len(x), batch):
        step(x[start : start + batch], y[start : start + batch])


def max_difference(a: keras.Model, b: keras.Model) -> float:
    """Largest absolute difference between the two models' weights."""
    pairs = zip(a.get_weights(), b.get_weights())
    return max(float(np.max(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)))) for p, q in pairs)


class Checks:
    """Runs labelled checks on one rank, printing "PASS <label>" or "FAIL <label> ..." and counting failures."""

    def __init__(self) -> None:
        self.failures = 0

    def __call__(self, label: str, test: Callable[[], None]) -> None:
        """Runs one check; a failure is reported and counted, and the next check still runs."""
        import traceback

        try:
            test()
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the run goes on
            self.failures += 1
            print(f"FAIL {label}: {error!r}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"PASS {label}", flush=True)
