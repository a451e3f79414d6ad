"""Keras training on scikit-learn's 8x8 digits, written as for Horovod: only the import names commsched.

    mpiexec -n 2 python -m mpi4py examples/keras_mnist.py --epochs 4
    commsched-run -n 2 examples/keras_mnist.py --epochs 2

Each rank reads its own shuffle of the training set; DistributedOptimizer averages the
gradients through commsched, the callbacks broadcast rank 0's initial weights, average the
metrics over ranks and warm the learning rate up.
"""

from __future__ import annotations

import argparse

import commsched.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit("the digits data set comes with scikit-learn: pip install scikit-learn") from None

parser = argparse.ArgumentParser(description="Keras digits example")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs to train")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
parser.add_argument("--steps-per-epoch", type=int, default=24, help="steps per epoch, over all workers")
parser.add_argument("--warmup-epochs", type=int, default=2, help="epochs of learning rate warmup")


def main() -> None:
    args = parser.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    x_train, y_train = images[:1500], labels[:1500]
    x_test, y_test = images[1500:], labels[1500:]

    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train.astype(np.int64)))
    dataset = dataset.repeat().shuffle(1500, seed=hvd.rank()).batch(args.batch_size)

    model = tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(16, [3, 3], activation="relu"),
            tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Dropout(0.25),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dropout(0.5),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )

    # Horovod: adjust learning rate based on number of workers.
    scaled_lr = 0.002 * hvd.size()
    opt = tf.keras.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(),
        optimizer=opt,
        metrics=["accuracy"],
        jit_compile=False,
    )

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first warmup epochs.
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1
        ),
    ]

    # Horovod: write logs on worker 0.
    verbose = 2 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of workers.
    model.fit(
        dataset,
        steps_per_epoch=args.steps_per_epoch // hvd.size(),
        callbacks=callbacks,
        epochs=args.epochs,
        verbose=verbose,
    )

    # Horovod: average the test metrics over workers, each evaluating its half of the test set.
    shard = slice(hvd.rank(), None, hvd.size())
    score = hvd.allreduce(model.evaluate(x_test[shard], y_test[shard], verbose=0), name="score")
    if verbose:
        print("Test loss:", float(score[0]))
        print("Test accuracy:", float(score[1]))


if __name__ == "__main__":
    main()
