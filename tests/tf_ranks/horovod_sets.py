"""Rank script: commsched.tensorflow on process sets {0} and {1..} as Horovod's tests use them.

Eager collectives on a set run as the custom ops, so they have Horovod's gradients; size_op and
process_set_included_op answer per set; a non-member is refused with InvalidArgumentError and an
unregistered set with ValueError; grouped allgather/reducescatter; an integer average rounds
toward zero (Horovod's); a TF1 optimizer is wrapped as Horovod's legacy one; Partial* keep local
layers' gradients; broadcast_variables gives a session an op in graph mode. Prints "PASS <check>" or "FAIL <check> ..." per check.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import commsched.tensorflow as hvd
import numpy as np
import tensorflow as tf

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


def main() -> int:
    """Runs the checks on this rank; the exit status counts the failures."""
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, 2))
    hvd.init(process_sets=[first, rest])
    rank, size = hvd.rank(), hvd.size()
    assert size == 2, "run on 2 ranks"
    mine, other = (first, rest) if rank == 0 else (rest, first)

    def info_ops() -> None:
        assert int(hvd.size_op(process_set_id=mine.process_set_id)) == mine.size() == 1
        assert int(hvd.size_op()) == size
        assert int(hvd.process_set_included_op(process_set_id=mine.process_set_id)) == 1
        assert int(hvd.process_set_included_op(process_set_id=other.process_set_id)) == 0
        try:
            hvd.size_op(process_set_id=99)
        except ValueError as error:
            assert "99" in str(error), error
        else:
            raise AssertionError("size_op accepted an unknown process set id")

    def eager_gradients_on_a_set() -> None:
        x = tf.Variable(tf.fill([3, 2], float(rank + 1)))
        with tf.GradientTape(persistent=True) as tape:
            gathered = hvd.allgather(x, process_set=mine)
            summed = hvd.allreduce(x, op=hvd.Sum, process_set=mine)
            sent = hvd.broadcast(x, root_rank=rank, process_set=mine)
        np.testing.assert_allclose(gathered.numpy(), x.numpy())
        np.testing.assert_allclose(
            tape.gradient(gathered, x, tf.fill([3, 2], 5.0)).numpy(), np.full((3, 2), 5.0)
        )
        np.testing.assert_allclose(tape.gradient(summed, x).numpy(), np.ones((3, 2)))
        np.testing.assert_allclose(tape.gradient(sent, x).numpy(), np.ones((3, 2)))
        halves = hvd.allgather(tf.constant([1, 2], tf.uint16), process_set=mine)
        assert halves.dtype == tf.uint16 and halves.numpy().tolist() == [1, 2]

    def refusals() -> None:
        try:
            hvd.allreduce(tf.ones(2), process_set=other)
        except tf.errors.InvalidArgumentError as error:
            assert "is not a member" in error.message, error.message
        else:
            raise AssertionError("a non-member ran an allreduce on the set")
        fake = hvd.ProcessSet([0])
        fake.process_set_id = 10
        try:
            hvd.allreduce(tf.ones(2), process_set=fake)
        except ValueError as error:
            assert "not registered" in str(error), error
        else:
            raise AssertionError("an unregistered set was accepted")

    def grouped() -> None:
        rows = [tf.constant(np.arange(4.0) + rank), tf.constant(np.full((2, 3), float(rank)))]
        gathered = hvd.grouped_allgather(rows)
        np.testing.assert_allclose(
            gathered[0].numpy(), np.concatenate([np.arange(4.0) + r for r in range(size)])
        )
        assert gathered[1].shape == (2 * size, 3)
        parts = hvd.grouped_reducescatter(rows, op=hvd.Sum)
        total = sum(np.arange(4.0) + r for r in range(size))
        np.testing.assert_allclose(parts[0].numpy(), total[2 * rank : 2 * rank + 2])
        np.testing.assert_allclose(parts[1].numpy(), np.full((1, 3), sum(range(size))))

    def integer_average() -> None:
        # -38 and -37 sum to -75: Horovod's average is -37 (toward zero), the floor would be -38.
        value = tf.constant([-38 + rank, 7 + rank, -1], tf.int32)
        expected = [-37, 7, -1]
        assert hvd.allreduce(value, op=hvd.Average).numpy().tolist() == expected
        grouped = hvd.grouped_allreduce([value, tf.cast(value, tf.int64)], op=hvd.Average)
        assert [g.numpy().tolist() for g in grouped] == [expected, expected]
        part = hvd.reducescatter(tf.reshape(tf.tile(value, [2]), [2, 3]), op=hvd.Average)
        assert part.numpy().tolist() == [expected]
        floats = hvd.allreduce(tf.cast(value, tf.float32), op=hvd.Average).numpy().tolist()
        assert floats == [-37.5, 7.5, -1.0], floats

    def legacy_optimizer() -> None:
        # A TF1 optimizer in a graph: the shared gradient is averaged, a local one only scaled by 1/size.
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            shared, local = tf.Variable([0.0]), tf.Variable([0.0])
            loss = tf.reduce_sum(shared * float(rank + 1) + local * float(rank + 1))
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
            opt.register_local_var(local)
            update = opt.apply_gradients(opt.compute_gradients(loss, [shared, local]))
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(update)
            assert session.run(shared).tolist() == [-1.5], session.run(shared)
            assert session.run(local).tolist() == [-(rank + 1) / size], session.run(local)

    def partial_distributed() -> None:
        # Dense(1) layers without bias on input 1: each kernel's gradient is the loss weight rank + 1.
        import keras

        shared, local = keras.layers.Dense(1, use_bias=False), keras.layers.Dense(1, use_bias=False)
        ones = tf.ones([1, 1])
        shared(ones), local(ones)
        with tf.GradientTape() as plain:
            loss = float(rank + 1) * tf.reduce_sum(shared(ones) + local(ones))
        tape = hvd.PartialDistributedGradientTape(plain, local_layers=[local])
        grads = tape.gradient(loss, [shared.kernel, local.kernel])
        assert [float(g.numpy()[0][0]) for g in grads] == [1.5, (rank + 1) / size], grads
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local)
        before = [float(shared.kernel.numpy()[0][0]), float(local.kernel.numpy()[0][0])]
        opt.apply([tf.fill([1, 1], float(rank + 1))] * 2, [shared.kernel, local.kernel])
        after = [float(shared.kernel.numpy()[0][0]), float(local.kernel.numpy()[0][0])]
        steps = [b - a for b, a in zip(before, after)]
        assert np.allclose(steps, [1.5, (rank + 1) / size]), steps
        send = hvd.broadcast_object_fn(root_rank=1)
        assert send({"from": rank}) == {"from": 1}
        # BroadcastGlobalVariablesCallback leaves local_variables at each rank's own value.
        model = keras.Sequential([keras.Input((1,)), shared, local])
        callback = hvd.callbacks.BroadcastGlobalVariablesCallback(
            root_rank=1, local_variables=local.variables
        )
        own = float(local.kernel.numpy()[0][0])
        callback.set_model(model)
        callback.on_train_begin()
        assert float(local.kernel.numpy()[0][0]) == own
        assert hvd.allgather(shared.kernel.value)[0].numpy() == hvd.allgather(shared.kernel.value)[1].numpy()

    def sparse_allreduce() -> None:
        # IndexedSlices are gathered (values and indices), as Horovod's allreduce does for them.
        def slices() -> tf.IndexedSlices:
            return tf.IndexedSlices(tf.constant([[rank + 1.0]]), tf.constant([rank]), tf.constant([2, 1]))

        summed = hvd.allreduce(slices(), op=hvd.Sum)
        assert isinstance(summed, tf.IndexedSlices)
        assert summed.values.numpy().tolist() == [[1.0], [2.0]] and summed.indices.numpy().tolist() == [0, 1]
        mixed = hvd.grouped_allreduce([slices(), tf.constant([float(rank)])], op=hvd.Average)
        assert mixed[0].values.numpy().tolist() == [[0.5], [1.0]], mixed[0]
        assert mixed[1].numpy().tolist() == [0.5], mixed[1]
        for scalar_call in (
            lambda: hvd.reducescatter(tf.constant(1.0)),
            lambda: hvd.grouped_reducescatter([tf.ones([2]), tf.constant(1.0)]),
        ):
            try:
                scalar_call()
            except ValueError as error:
                assert "first dimension" in str(error), error
            else:
                raise AssertionError("a scalar was reduce-scattered")
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            variable = tf.Variable([float(rank)])
            session.run(tf.compat.v1.global_variables_initializer())
            (sent,) = hvd.broadcast_([variable], root_rank=1)
            assert session.run(sent).tolist() == [1.0] and session.run(variable).tolist() == [1.0]
        for op in (hvd.Min, hvd.Adasum):
            try:
                hvd.allreduce(slices(), op=op)
            except NotImplementedError:
                pass
            else:
                raise AssertionError(f"op {op} on IndexedSlices was accepted")

    def graph_broadcast_variables() -> None:
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            variable = tf.Variable([float(rank)])
            session.run(tf.compat.v1.global_variables_initializer())
            op = hvd.broadcast_variables([variable], root_rank=1)
            assert op is not None, "broadcast_variables returned no op in graph mode"
            session.run(op)
            assert session.run(variable).tolist() == [1.0]

    check("info-ops", info_ops)
    check("eager-gradients-on-a-set", eager_gradients_on_a_set)
    check("refusals", refusals)
    check("grouped", grouped)
    check("integer-average", integer_average)
    check("legacy-optimizer", legacy_optimizer)
    check("partial-distributed", partial_distributed)
    check("sparse-allreduce", sparse_allreduce)
    check("graph-broadcast-variables", graph_broadcast_variables)
    hvd.shutdown()
    return failures


if __name__ == "__main__":
    sys.exit(main())
