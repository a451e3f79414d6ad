"""Train a small CNN on scikit-learn's digits with Keras and commsched's TensorFlow plug-in.

    mpiexec -n 2 python -m mpi4py examples/tf_keras_train.py            # Keras fit()
    mpiexec -n 2 python -m mpi4py examples/tf_keras_train.py --loop     # tf.function loop, wrapped tape
    python examples/tf_keras_train.py                                   # one process works too

Each rank trains on its shard of every global batch; the averaged gradients make all
ranks take the same step, so the printed loss and accuracy match a one-process run.
The custom TensorFlow ops are compiled on first use (about 10 s) into
~/.cache/commsched/tf-ops (COMMSCHED_TF_OPS_DIR overrides it).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import commsched.tensorflow as cst
import keras
import numpy as np
import tensorflow as tf

try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit("the digits data set comes with scikit-learn: pip install scikit-learn") from None

import commsched


def build_model(seed: int) -> keras.Model:
    """Two 3x3 convolutions and two dense layers for 8x8 grey images."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits data set (ships with scikit-learn), scaled to [0, 1] and split 80/20."""
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def shard(x: np.ndarray, y: np.ndarray, batch: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's slice of every global batch, in batch order (so fit(shuffle=False) walks the batches)."""
    steps, per_rank = len(x) // batch, batch // size
    pick = np.concatenate(
        [np.arange(s * batch + rank * per_rank, s * batch + (rank + 1) * per_rank) for s in range(steps)]
    )
    return x[pick], y[pick]


def main() -> None:
    """Parses arguments, trains, and prints loss, accuracy and throughput per epoch from rank 0."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--policy", choices=["priority", "fifo"], default="priority")
    parser.add_argument("--loop", action="store_true", help="a tf.function loop with DistributedGradientTape")
    args = parser.parse_args()

    commsched.init(policy=args.policy)
    rank, size = commsched.rank(), commsched.size()
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {size} ranks")
    per_rank = args.batch_size // size
    x_train, y_train, x_test, y_test = load(seed=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = build_model(seed=rank)  # different on purpose: the broadcast makes them equal
    if rank == 0:
        mode = "tf.function loop, DistributedGradientTape" if args.loop else "fit(), DistributedOptimizer"
        print(f"{size} rank(s), {commsched.config()['transport']}, policy={args.policy}, {mode}", flush=True)

    if args.loop:
        optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
        cst.broadcast_variables(model.variables, root_rank=0)
        order = cst.forward_order(model, x_train[:1])  # measured: priorities follow first use

        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = cst.DistributedGradientTape(tape, forward_order=order)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for epoch in range(args.epochs):
            x_epoch, y_epoch = shard(*_shuffled(x_train, y_train, epoch), args.batch_size, rank, size)
            started, total, steps = time.perf_counter(), 0.0, len(x_epoch) // per_rank
            for s in range(steps):
                total += float(
                    step(
                        x_epoch[s * per_rank : (s + 1) * per_rank], y_epoch[s * per_rank : (s + 1) * per_rank]
                    )
                )
            _report(
                epoch,
                model,
                total / steps,
                x_test,
                y_test,
                steps * args.batch_size,
                time.perf_counter() - started,
            )
    else:
        model.compile(
            optimizer=cst.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9)),
            loss=loss_fn,
            jit_compile=False,  # XLA cannot compile the custom ops
        )
        for epoch in range(args.epochs):
            x_epoch, y_epoch = shard(*_shuffled(x_train, y_train, epoch), args.batch_size, rank, size)
            started = time.perf_counter()
            history = model.fit(
                x_epoch,
                y_epoch,
                batch_size=per_rank,
                shuffle=False,
                verbose=0,
                callbacks=[cst.BroadcastGlobalVariablesCallback(0)] if epoch == 0 else [],
            )
            elapsed = time.perf_counter() - started
            loss = history.history["loss"][-1]
            _report(epoch, model, loss, x_test, y_test, len(x_epoch) * size, elapsed)
    commsched.shutdown()


def _shuffled(x: np.ndarray, y: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.RandomState(epoch).permutation(len(x))
    return x[order], y[order]


def _report(
    epoch: int, model: keras.Model, loss: float, x: np.ndarray, y: np.ndarray, samples: int, elapsed: float
) -> None:
    # The mean over ranks of each rank's shard loss is the loss of the global batch.
    mean_loss = float(cst.allreduce(tf.constant([loss], tf.float64), name=f"loss.{epoch}", op="average")[0])
    accuracy = float(np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y))
    if commsched.rank() == 0:
        print(
            f"epoch {epoch + 1}: loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  "
            f"{samples / elapsed:,.0f} samples/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
