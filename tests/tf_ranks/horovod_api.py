"""Rank script: `import commsched.tensorflow.keras as hvd` run as a Horovod Keras script would use it.

Collectives on TF tensors against numpy references built from every rank's inputs, the
optimizer and tape with Horovod's arguments against one process on the whole batch, and the
callbacks (metric averaging, learning-rate warmup and schedule) against their formulas.
Prints "PASS <check>" or "FAIL <check> ..." per check.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

import commsched.tensorflow.keras as hvd
import keras
import numpy as np
import tensorflow as tf
import tf_common as common

failures = 0


def check(label: str, test: Callable[[], None]) -> None:
    """Runs one check; prints PASS or FAIL with the reason."""
    global failures
    try:
        test()
    except Exception as error:  # noqa: BLE001 - every failure is reported, then the run goes on
        failures += 1
        print(f"FAIL {label}: {error!r}\n{traceback.format_exc()}", flush=True)
    else:
        print(f"PASS {label}", flush=True)


def values(rank: int, salt: int, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    """Small exact values of `rank` for one check."""
    rng = np.random.default_rng([salt, rank])
    return rng.integers(-3, 4, shape).astype(dtype)


def equal(got: Any, want: np.ndarray, tolerance: float = 0.0) -> None:
    got = np.asarray(got.numpy() if hasattr(got, "numpy") else got, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert np.allclose(got, want.astype(np.float64), rtol=tolerance, atol=tolerance), f"{got} != {want}"


def expect(error: type[BaseException], call: Callable[[], Any]) -> None:
    try:
        call()
    except error:
        return
    raise AssertionError(f"no {error.__name__} raised")


class Record(keras.callbacks.Callback):
    """Keeps the learning rate of every batch and a copy of every epoch's logs."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[tuple[int, int, float]] = []
        self.logs: list[dict[str, float]] = []
        self.epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.rates.append((self.epoch, batch, float(np.asarray(self.model.optimizer.learning_rate))))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.logs.append({k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0})


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = common.dense_data(size)
    mine_x, mine_y = common.shard(x, rank, size), common.shard(y, rank, size)

    def collectives() -> None:
        inputs = [values(r, 1, (3, 2)) for r in range(size)]
        total = np.sum(inputs, axis=0)
        equal(hvd.allreduce(tf.constant(inputs[rank]), op=hvd.Sum), total)
        equal(hvd.allreduce(tf.constant(inputs[rank])), total / size, 1e-6)
        in_graph = tf.function(lambda t: hvd.allreduce(t, name="graph", op=hvd.Sum, prescale_factor=2.0))
        equal(in_graph(tf.constant(inputs[rank])), 2 * total)
        equal(hvd.allreduce(tf.constant(inputs[rank]), op=hvd.Sum, compression=hvd.Compression.fp16), total)
        ints = [values(r, 2, (4,), "int32") for r in range(size)]
        equal(hvd.allreduce(tf.constant(ints[rank])), np.floor(np.sum(ints, 0) / size))  # floor, as Horovod
        for op, reference in [(hvd.Min, np.min), (hvd.Max, np.max), (hvd.Product, np.prod)]:
            equal(hvd.allreduce(tf.constant(ints[rank]), op=op), reference(ints, axis=0))
        flags = [values(r, 3, (5,)) > 0 for r in range(size)]
        equal(hvd.allreduce(tf.constant(flags[rank]), op=hvd.Max), np.any(flags, 0))
        weights = [values(r, 6, (3, 2)) for r in range(size)]
        variable = tf.Variable(inputs[rank])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allreduce(variable, name="differentiated") * weights[rank])
        equal(tape.gradient(loss, variable), np.mean(weights, axis=0), 1e-6)  # that of the sum of every loss
        grouped = hvd.grouped_allreduce(
            [tf.constant(inputs[rank]), tf.constant(ints[rank] * 1.0)], op=hvd.Sum
        )
        equal(grouped[0], total)
        equal(grouped[1], np.sum(ints, 0))

    def eager_collectives() -> None:
        uneven = [values(r, 4, (r + 1, 2)) for r in range(size)]
        equal(hvd.allgather(tf.constant(uneven[rank])), np.concatenate(uneven))
        halves = hvd.allgather(tf.cast(tf.constant(uneven[rank]), tf.bfloat16))
        assert halves.dtype == tf.bfloat16
        equal(halves, np.concatenate(uneven))
        rows = 2 * size
        inputs = [values(r, 5, (rows, 3)) for r in range(size)]
        part = hvd.reducescatter(tf.constant(inputs[rank]), op=hvd.Sum)
        equal(part, np.sum(inputs, 0)[2 * rank : 2 * rank + 2])
        sent = tf.constant([[rank, d] for d in range(size) for _ in range(d + 1)], tf.int64)
        output, received = hvd.alltoall(sent, splits=[d + 1 for d in range(size)])
        equal(output, np.array([[s, rank] for s in range(size) for _ in range(rank + 1)]))
        equal(received, np.full(size, rank + 1))
        assert hvd.allgather_object(rank) == list(range(size))
        assert hvd.broadcast_object({"from": rank}, root_rank=size - 1) == {"from": size - 1}
        variable = tf.Variable([float(rank)] * 3)
        hvd.broadcast_(variable, root_rank=size - 1)
        equal(variable, np.full(3, size - 1.0))
        hvd.barrier()
        equal(tf.function(lambda t: hvd.allgather(t))(tf.ones(2)), np.ones(2 * size))
        equal(hvd.allreduce(tf.ones(3) * (rank + 1), op=hvd.Adasum), np.full(3, (size + 1) / 2))
        expect(NotImplementedError, lambda: hvd.broadcast_global_variables(0))

    def fit(optimizer: keras.optimizers.Optimizer, callbacks: list[Any], epochs: int = 1) -> keras.Model:
        model = common.dense_model()
        model.compile(optimizer=optimizer, loss=common.loss_fn)
        model.fit(
            mine_x,
            mine_y,
            batch_size=common.PER_RANK,
            shuffle=False,
            epochs=epochs,
            verbose=0,
            callbacks=callbacks,
        )
        return model

    def reference(optimizer: keras.optimizers.Optimizer, scale: float = 1.0) -> keras.Model:
        model = common.dense_model()
        model.compile(optimizer=optimizer, loss=lambda t, p: common.loss_fn(t, p) * scale)
        model.fit(x, y, batch_size=size * common.PER_RANK, shuffle=False, epochs=1, verbose=0)
        return model

    def sgd(lr: float = 0.1, **extra: Any) -> keras.optimizers.Optimizer:
        return keras.optimizers.SGD(lr, momentum=0.9, **extra)

    def optimizer_arguments() -> None:
        broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        model = fit(hvd.DistributedOptimizer(sgd(), gradient_predivide_factor=2.0), [broadcast])
        assert common.max_difference(model, reference(sgd())) < 1e-5, "predivide"
        model = fit(hvd.DistributedOptimizer(sgd(), compression=hvd.Compression.fp16), [])
        assert common.max_difference(model, reference(sgd())) < 2e-3, "fp16 compression"
        model = fit(hvd.DistributedOptimizer(sgd(), op=hvd.Sum, num_groups=2), [])
        assert common.max_difference(model, reference(sgd(), scale=size)) < 1e-5, "op=Sum"
        # Two passes per step: Horovod sums them, which with momentum SGD is the averaged step at twice the rate.
        model = fit(hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2), [])
        want = reference(sgd(0.2, gradient_accumulation_steps=2))
        assert common.max_difference(model, want) < 1e-5, "backward_passes_per_step"
        expect(ValueError, lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Sum, gradient_predivide_factor=2.0))
        expect(
            ValueError, lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Adasum, gradient_predivide_factor=2.0)
        )

    def tape_arguments() -> None:
        for arguments, scale in [({"gradient_predivide_factor": 4.0}, 1.0), ({"op": hvd.Sum}, float(size))]:
            model, optimizer = common.dense_model(), sgd()
            common.train_loop(
                model,
                optimizer,
                mine_x,
                mine_y,
                common.PER_RANK,
                wrap=lambda tape, a=arguments: hvd.DistributedGradientTape(tape, **a),
            )
            assert common.max_difference(model, reference(sgd(), scale=scale)) < 1e-5, arguments

    def adasum_gradients() -> None:
        # op=hvd.Adasum reduces each gradient with Adasum: checked against every rank's own gradients.
        from commsched import adasum

        x = tf.constant(np.asarray(mine_x[:4], np.float64))
        weights = tf.Variable(tf.ones((x.shape[1], 2), tf.float64) * 0.1)

        def gradient(wrap: Any) -> np.ndarray:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(x, weights) ** 2)
            return wrap(tape).gradient(loss, [weights])[0].numpy()

        mine = gradient(lambda tape: tape)
        every = hvd.allgather_object(mine)
        want = adasum.combine([g.reshape(-1) for g in every]).reshape(mine.shape)
        got = gradient(lambda tape: hvd.DistributedGradientTape(tape, op=hvd.Adasum))
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), (got, want)
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum)
        before = weights.numpy()
        optimizer.apply([tf.constant(mine)], [weights])
        assert np.allclose(weights.numpy(), before - want, rtol=1e-12, atol=1e-12)

    def metric_average() -> None:
        before, after = Record(), Record()
        fit(hvd.DistributedOptimizer(sgd()), [before, hvd.callbacks.MetricAverageCallback(), after], epochs=2)
        for epoch in range(2):
            local = hvd.allgather_object(before.logs[epoch]["loss"])
            assert abs(after.logs[epoch]["loss"] - float(np.mean(local))) < 1e-6, (local, after.logs[epoch])

    def learning_rate_callbacks() -> None:
        record = Record()
        initial = 0.1 * size
        warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial, warmup_epochs=2, verbose=0)
        fit(hvd.DistributedOptimizer(keras.optimizers.SGD(initial)), [warmup, record], epochs=3)
        steps = common.STEPS
        for epoch, batch, rate in record.rates:
            progress = min(epoch + (batch + 1) / steps, 2.0)
            want = initial / size * (progress * (size - 1) / 2 + 1)
            assert abs(rate - want) < 1e-6, (epoch, batch, rate, want)
        record = Record()
        schedule = hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=0.4, multiplier=lambda e: 0.5**e, start_epoch=1
        )
        fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.4)), [schedule, record], epochs=3)
        for epoch, _, rate in record.rates:
            assert abs(rate - 0.4 * 0.5**epoch) < 1e-7, (epoch, rate)

    for label, test in [
        ("collectives", collectives),
        ("eager-collectives", eager_collectives),
        ("optimizer-arguments", optimizer_arguments),
        ("tape-arguments", tape_arguments),
        ("adasum-gradients", adasum_gradients),
        ("metric-average", metric_average),
        ("learning-rate-callbacks", learning_rate_callbacks),
    ]:
        check(label, test)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
