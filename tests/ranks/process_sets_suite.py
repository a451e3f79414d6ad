"""Rank program: process sets at 3 ranks ({0,1}, {1,2}, {0,2} and the global set), every
collective checked on every member against numpy computed from what each member submits; a set's
collective completing while the rank outside it waits elsewhere; a non-member's call refused;
remove and add again; torch's DistributedOptimizer on a set when torch is installed.

Run as: mpiexec -n 3 python process_sets_suite.py --signal-dir DIR [--transport grpc]
(tests/test_process_sets.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import commsched

PAIRS = ([0, 1], [1, 2], [0, 2])


def data(rank: int, salt: int, rows: int, width: int = 3) -> np.ndarray:
    """Small exact integers per rank, so sums and averages compare exactly."""
    return np.random.default_rng([salt, rank]).integers(-4, 5, (rows, width)).astype(np.float64)


def check_collectives(process_set: commsched.ProcessSet, salt: int) -> int:
    """Every collective on `process_set` against numpy; returns the number of checks."""
    me, members = commsched.rank(), process_set.ranks or list(range(commsched.size()))
    position = members.index(me)
    assert process_set.rank() == position and process_set.size() == len(members) and process_set.included()
    checks = 0

    mine = data(me, salt, 4)
    total = sum(data(r, salt, 4) for r in members)
    np.testing.assert_array_equal(
        commsched.allreduce(mine.copy(), name="sum", process_set=process_set), total
    )
    average = commsched.allreduce_async(mine.copy(), name="avg", op="average", process_set=process_set).wait()
    np.testing.assert_allclose(average, total / len(members))
    big = np.full(300_000, float(me + 1))  # past the inline size and the partition: the wire road, in chunks
    commsched.allreduce(big, name="big", process_set=process_set)
    np.testing.assert_array_equal(big, np.full(300_000, float(sum(r + 1 for r in members))))
    checks += 3

    # Each member gives as many rows as its rank + 1: the result is in the set's rank order.
    gathered = commsched.allgather(data(me, salt, me + 1), name="gather", process_set=process_set)
    np.testing.assert_array_equal(gathered, np.concatenate([data(r, salt, r + 1) for r in members]))
    objects = commsched.allgather_object({"rank": me}, name="objects", process_set=process_set)
    assert objects == [{"rank": r} for r in members], objects
    checks += 2

    for root in members:  # the root is a global rank, as in Horovod
        array = data(me, salt + root, 2)
        commsched.broadcast(array, root=root, name=f"bcast.{root}", process_set=process_set)
        np.testing.assert_array_equal(array, data(root, salt + root, 2))
        got = commsched.broadcast_object(
            f"from {me}", root_rank=root, name=f"bobj.{root}", process_set=process_set
        )
        assert got == f"from {root}", got
        checks += 2

    rows = 2 * len(members) + 1  # uneven: the first member keeps one row more
    part = commsched.reducescatter(data(me, salt, rows), name="scatter", process_set=process_set)
    summed = sum(data(r, salt, rows) for r in members)
    start = position * (rows // len(members)) + min(position, rows % len(members))
    length = rows // len(members) + (1 if position < rows % len(members) else 0)
    np.testing.assert_array_equal(part, summed[start : start + length])
    checks += 1

    # Member at position p sends p + q + 1 rows to the member at position q.
    splits = [position + q + 1 for q in range(len(members))]
    sent = {r: data(r, salt, sum(i + q + 1 for q in range(len(members)))) for i, r in enumerate(members)}
    received, received_splits = commsched.alltoall(
        sent[me], splits=splits, name="a2a", process_set=process_set
    )
    expected = []
    for i, r in enumerate(members):
        offset = sum(i + q + 1 for q in range(position))
        expected.append(sent[r][offset : offset + i + position + 1])
    np.testing.assert_array_equal(received, np.concatenate(expected))
    assert received_splits == [i + position + 1 for i in range(len(members))], received_splits
    checks += 1

    group = [data(me, salt + k, 2) for k in range(3)]
    commsched.grouped_allreduce(group, name="group", process_set=process_set)
    for k, array in enumerate(group):
        np.testing.assert_array_equal(array, sum(data(r, salt + k, 2) for r in members))
    commsched.barrier(process_set=process_set)
    return checks + 2


def check_not_blocked(pair: commsched.ProcessSet, signal_dir: Path) -> None:
    """Rank 2 submits a global allreduce and then waits, outside the commsched API, for a file that
    ranks 0 and 1 write only after finishing collectives on {0,1}: were a set's collective to
    wait for the rank outside it, that file would never appear."""
    me = commsched.rank()
    flag = signal_dir / "pair_done"
    if me == 2:
        pending = commsched.allreduce_async(np.ones(8), name="global.while.busy")
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert time.monotonic() < deadline, "the {0,1} collectives did not complete without rank 2"
            time.sleep(0.01)
        np.testing.assert_array_equal(pending.wait(), np.full(8, 3.0))
        return
    for step in range(5):
        result = commsched.allreduce(np.full(4, float(me + step)), name=f"pair.{step}", process_set=pair)
        np.testing.assert_array_equal(result, np.full(4, float(1 + 2 * step)))
    if me == 0:
        flag.write_text("done")
    np.testing.assert_array_equal(commsched.allreduce(np.ones(8), name="global.while.busy"), np.full(8, 3.0))


def check_refusals(sets: list[commsched.ProcessSet]) -> None:
    """A non-member's call fails at once, naming the set and the rank; nothing waits for it."""
    me = commsched.rank()
    for process_set in sets:
        if process_set.included():
            continue
        assert process_set.rank() == -1
        for call, arguments in (
            (commsched.allreduce, {"array": np.ones(2), "name": "outsider"}),
            (commsched.allgather, {"array": np.ones(2)}),
            (commsched.barrier, {}),
        ):
            try:
                call(**arguments, process_set=process_set)
            except ValueError as error:
                assert f"rank {me} is not a member" in str(error) and "ProcessSet" in str(error), error
            else:
                raise AssertionError(f"rank {me} ran a collective on {process_set!r}, which it is not in")


def check_torch_optimizer(pair: commsched.ProcessSet) -> int:
    """DistributedOptimizer on {1,2}: the members' gradients are averaged over the two of them."""
    try:
        import torch
    except ImportError:
        return 0
    import commsched.torch as hvd

    me = commsched.rank()
    if not pair.included():
        return 0
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    for name, tensor in model.state_dict().items():  # Horovod's broadcast_parameters has no process_set
        hvd.broadcast_(tensor, root_rank=pair.ranks[0], name=f"init.{name}", process_set=pair)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        named_parameters=model.named_parameters(),
        process_set=pair,
    )
    inputs = {r: torch.arange(4.0) * (r + 1) for r in pair.ranks}
    optimizer.zero_grad()
    model(inputs[me]).sum().backward()
    optimizer.step()
    # The reference: each member's gradient by hand (d/dW of sum(Wx+b) is x per row, 1 for b), averaged.
    grad_weight = sum(inputs[r].expand(2, 4) for r in pair.ranks) / 2
    np.testing.assert_allclose(
        model.weight.detach().numpy(), (start["weight"] - 0.5 * grad_weight).numpy(), 1e-6
    )
    np.testing.assert_allclose(
        model.bias.detach().numpy(), (start["bias"] - 0.5 * torch.ones(2)).numpy(), 1e-6
    )
    return 2


def check_tensorflow(pair: commsched.ProcessSet) -> int:
    """commsched.tensorflow's eager collectives on {1,2}: allreduce, grouped allreduce, broadcast of a
    tensor and of variables, against numpy."""
    import commsched.tensorflow as hvd
    import tensorflow as tf

    me = commsched.rank()
    if not pair.included():
        return check_tensorflow_outside(pair)
    total = sum(data(r, 7, 2) for r in pair.ranks)
    reduced = hvd.allreduce(tf.constant(data(me, 7, 2)), op=hvd.Sum, name="tf.sum", process_set=pair)
    np.testing.assert_array_equal(reduced.numpy(), total)
    grouped = hvd.grouped_allreduce([tf.constant(data(me, 7, 2))] * 2, op=hvd.Average, process_set=pair)
    for tensor in grouped:
        np.testing.assert_allclose(tensor.numpy(), total / 2)
    root = pair.ranks[1]
    sent = hvd.broadcast(tf.constant(data(me, 8, 2)), root_rank=root, name="tf.bcast", process_set=pair)
    np.testing.assert_array_equal(sent.numpy(), data(root, 8, 2))
    variable = tf.Variable(data(me, 9, 2))
    hvd.broadcast_variables([variable], root_rank=root, process_set=pair)
    np.testing.assert_array_equal(variable.numpy(), data(root, 9, 2))
    return 4 + check_tensorflow_graph(pair)


def check_tensorflow_graph(pair: commsched.ProcessSet) -> int:
    """Inside tf.function on {1,2}: allreduce, allgather and broadcast against numpy, and a
    DistributedGradientTape's gradient against the hand-computed average over the set."""
    import commsched.tensorflow as hvd
    import tensorflow as tf

    me, root = commsched.rank(), pair.ranks[1]

    @tf.function
    def collectives(tensor: tf.Tensor, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        average = hvd.allreduce(tensor, op=hvd.Average, name="tf.fn.avg", process_set=pair)
        gathered = hvd.allgather(rows, name="tf.fn.gather", process_set=pair)
        sent = hvd.broadcast(tensor, root_rank=root, name="tf.fn.bcast", process_set=pair)
        return average, gathered, sent

    average, gathered, sent = collectives(tf.constant(data(me, 10, 2)), tf.constant(data(me, 11, me + 1)))
    np.testing.assert_allclose(average.numpy(), sum(data(r, 10, 2) for r in pair.ranks) / pair.size())
    np.testing.assert_array_equal(gathered.numpy(), np.concatenate([data(r, 11, r + 1) for r in pair.ranks]))
    np.testing.assert_array_equal(sent.numpy(), data(root, 10, 2))

    # loss = sum(x_rank * w^2): d/dw = 2 w x_rank on each rank, averaged over the set's members.
    gradient = tape_gradient(pair, data(me, 12, 1)[0])
    expected = 2 * TAPE_WEIGHTS * np.mean([data(r, 12, 1)[0] for r in pair.ranks], axis=0)
    np.testing.assert_allclose(gradient, expected)
    np.testing.assert_allclose(optimizer_step(pair, data(me, 12, 1)[0]), TAPE_WEIGHTS - expected)
    return 5


TAPE_WEIGHTS = np.array([1.0, -2.0, 0.5])


def tape_gradient(pair: commsched.ProcessSet, x: np.ndarray) -> np.ndarray:
    """The gradient of sum(x * w^2) at TAPE_WEIGHTS from a DistributedGradientTape on `pair`, in tf.function."""
    import commsched.tensorflow as hvd
    import tensorflow as tf

    weights = tf.Variable(TAPE_WEIGHTS)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.constant(x) * weights * weights)
        tape = hvd.DistributedGradientTape(tape, process_set=pair, name="tf.fn.tape")
        return tape.gradient(loss, [weights])[0]

    return step().numpy()


def optimizer_step(pair: commsched.ProcessSet, x: np.ndarray) -> np.ndarray:
    """The weights after one SGD step (learning rate 1) on sum(x * w^2) from TAPE_WEIGHTS through a
    DistributedOptimizer on `pair`, in tf.function."""
    import commsched.tensorflow as hvd
    import keras
    import tensorflow as tf

    weights = keras.Variable(TAPE_WEIGHTS)
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=1.0), process_set=pair, name="tf.fn.optimizer"
    )

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.constant(x) * weights * weights)
        optimizer.apply_gradients([(tape.gradient(loss, weights), weights)])

    step()
    return np.asarray(weights.numpy())


def check_tensorflow_outside(pair: commsched.ProcessSet) -> int:
    """On a rank outside `pair`: DistributedGradientTape and DistributedOptimizer keep the local gradient
    (as Horovod), and a collective on the set is refused (InvalidArgumentError, as Horovod) inside
    tf.function and by the op, with the Python API's message."""
    import commsched.tensorflow as hvd
    import tensorflow as tf
    from commsched.tensorflow import _ops

    x = data(commsched.rank(), 12, 1)[0]
    np.testing.assert_allclose(tape_gradient(pair, x), 2 * TAPE_WEIGHTS * x)
    np.testing.assert_allclose(optimizer_step(pair, x), TAPE_WEIGHTS - 2 * TAPE_WEIGHTS * x)
    try:
        commsched.allreduce(np.ones(2), name="tf.outside", process_set=pair)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("a rank outside the set ran its allreduce")
    assert "is not a member" in message, message

    @tf.function
    def outside() -> tf.Tensor:
        return hvd.allreduce(tf.ones(2), name="tf.fn.outside", process_set=pair)

    try:
        outside()
    except tf.errors.InvalidArgumentError as error:  # as Horovod's ops refuse a non-member
        assert message in error.message, (error.message, message)
    else:
        raise AssertionError("a rank outside the set ran its allreduce in tf.function")
    try:
        _ops.allreduce(tf.ones(2), "tf.op.outside", "sum", process_set_id=pair.process_set_id)
    except tf.errors.FailedPreconditionError as error:
        assert message in error.message, (error.message, message)
    else:
        raise AssertionError("the allreduce op ran on a set this rank is not in")
    return 4


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="")
    parser.add_argument("--signal-dir", required=True)
    parser.add_argument(
        "--tensorflow", action="store_true", help="also check commsched.tensorflow (eager and in tf.function)"
    )
    args = parser.parse_args()
    commsched.init(**({"transport": args.transport} if args.transport else {}))
    me = commsched.rank()
    assert commsched.size() == 3, "this program runs at 3 ranks"
    assert commsched.global_process_set.size() == 3 and commsched.global_process_set.included()

    sets = [commsched.add_process_set(ranks) for ranks in PAIRS]
    assert len({s.process_set_id for s in sets}) == 3 and 0 not in {s.process_set_id for s in sets}
    checks = 0
    for salt, process_set in enumerate([*sets, commsched.global_process_set]):
        if process_set.included():
            checks += check_collectives(process_set, salt)

    # The same name on two sets at once: rank 1 is in both {0,1} and {1,2}.
    mine = [s for s in sets[:2] if s.included()]
    handles = [
        commsched.allreduce_async(np.full(3, 10.0 * (i + 1) + me), name="same", process_set=s)
        for i, s in enumerate(sets[:2])
        if s.included()
    ]
    for handle, process_set in zip(handles, mine):
        index = sets.index(process_set)
        np.testing.assert_array_equal(
            handle.wait(), np.full(3, sum(10.0 * (index + 1) + r for r in process_set.ranks))
        )

    check_not_blocked(sets[0], Path(args.signal_dir))
    check_refusals(sets)

    # Remove {0,1} and add it again: the old object is dead, the new one works.
    old = sets[0]
    assert commsched.remove_process_set(old) and old.process_set_id is None
    assert not commsched.remove_process_set(commsched.global_process_set)
    again = commsched.add_process_set(commsched.ProcessSet([0, 1]))
    if me in (0, 1):
        try:
            commsched.allreduce(np.ones(2), process_set=old)
        except ValueError as error:
            assert "not registered" in str(error), error
        else:
            raise AssertionError("a removed process set still ran a collective")
        np.testing.assert_array_equal(
            commsched.allreduce(np.ones(2), name="again", process_set=again), [2.0, 2.0]
        )
        checks += 1

    checks += check_torch_optimizer(sets[1])
    if args.tensorflow:
        checks += check_tensorflow(sets[1])
    for process_set in (again, *sets[1:]):
        commsched.remove_process_set(process_set)
    transport = commsched.config()["transport"]
    if transport == "gloo":
        from commsched.transports import gloo

        transport += f" ({gloo.last_path.split(' ')[0]})"
    commsched.shutdown()
    print(f"rank {me}: PROCESS SETS OK {checks} checks over {transport}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
