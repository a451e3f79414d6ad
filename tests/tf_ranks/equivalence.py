"""N ranks of the TensorFlow plug-in end with the weights of one process trained on the whole batch.

Run as `mpiexec -n N python -m mpi4py equivalence.py`; prints `PASS <config>` or
`FAIL <config>` per configuration on every rank. Configurations: Keras fit() with the
wrapped optimizer (ranks other than 0 start from other weights, which the broadcast
callback must undo), a custom tf.function loop with the wrapped optimizer, and custom
loops with the wrapped tape on an embedding model (IndexedSlices gradients) in float32,
float64 and float16; each under the priority and the fifo policy. `--policy priority,fifo` runs
them under each policy in turn in the same processes (init, the configurations, shutdown), so one
launch pays TensorFlow's start once for both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import commsched.tensorflow as cst
import keras
import numpy as np
import tensorflow as tf
import tf_common as common

import commsched


def sgd() -> keras.optimizers.Optimizer:
    """The optimizer every configuration uses (momentum, so state matters too)."""
    return keras.optimizers.SGD(0.1, momentum=0.9)


def check(label: str, trained: keras.Model, reference: keras.Model, dtype: str) -> None:
    """Prints PASS or FAIL with the largest weight difference."""
    difference = common.max_difference(trained, reference)
    verdict = "PASS" if difference <= common.TOLERANCE[dtype] else "FAIL"
    print(f"{verdict} {label} rank={commsched.rank()} max_diff={difference:.3g}", flush=True)


def keras_fit(policy: str, rank: int, size: int) -> None:
    """fit() with DistributedOptimizer and the broadcast callback."""
    x, y = common.dense_data(size)
    reference = common.dense_model()
    reference.compile(optimizer=sgd(), loss=common.loss_fn)
    reference.fit(x, y, batch_size=size * common.PER_RANK, shuffle=False, epochs=1, verbose=0)

    model = common.dense_model()
    if rank != 0:  # the callback must replace these with rank 0's weights
        model.set_weights([w + 0.5 for w in model.get_weights()])
    model.compile(optimizer=cst.DistributedOptimizer(sgd()), loss=common.loss_fn)
    model.fit(
        common.shard(x, rank, size),
        common.shard(y, rank, size),
        batch_size=common.PER_RANK,
        shuffle=False,
        epochs=1,
        verbose=0,
        callbacks=[cst.BroadcastGlobalVariablesCallback(0)],
    )
    check(f"fit/{policy}", model, reference, "float32")


def optimizer_loop(policy: str, rank: int, size: int) -> None:
    """A custom tf.function loop with the wrapped optimizer and a plain tape."""
    x, y = common.dense_data(size)
    reference = common.dense_model()
    common.train_loop(reference, sgd(), x, y, size * common.PER_RANK)
    model = common.dense_model()
    optimizer = cst.DistributedOptimizer(sgd(), name="loop")
    common.train_loop(
        model, optimizer, common.shard(x, rank, size), common.shard(y, rank, size), common.PER_RANK
    )
    check(f"optimizer-loop/{policy}", model, reference, "float32")


def tape_loop(policy: str, rank: int, size: int, dtype: str) -> None:
    """A custom tf.function loop with the wrapped tape on the embedding model."""
    x, y = common.token_data(size)
    reference = common.embedding_model(dtype)
    common.train_loop(reference, sgd(), x, y, size * common.PER_RANK)

    model = common.embedding_model(dtype)
    order = cst.forward_order(model, x[:1])
    first = order[0].path
    if not first.endswith("embeddings"):
        print(f"FAIL forward-order/{dtype}/{policy}: first variable {first}", flush=True)
    common.train_loop(
        model,
        sgd(),
        common.shard(x, rank, size),
        common.shard(y, rank, size),
        common.PER_RANK,
        wrap=lambda tape: cst.DistributedGradientTape(tape, forward_order=order),
    )
    check(f"tape/{dtype}/{policy}", model, reference, dtype)


def collectives(policy: str, rank: int, size: int) -> None:
    """allreduce and broadcast of every dtype, eagerly and in tf.function, against numpy."""
    failures = []
    base = np.arange(1, 7).reshape(2, 3)
    total = size * (size + 1) // 2  # rank r contributes (r + 1) * base
    for dtype in ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8"):
        mine = tf.cast(base * (rank + 1), dtype)
        got = cst.allreduce(mine, name=f"c.sum.{dtype}", op="sum")
        if got.dtype != mine.dtype or not np.array_equal(tf.cast(got, "float64").numpy(), base * total):
            failures.append(f"sum {dtype}: {got.numpy().tolist()}")
    average = tf.function(lambda t: cst.allreduce(t, name="c.avg", op="average"))
    got = average(tf.constant(base * (rank + 1), tf.float64)).numpy()
    if not np.allclose(got, base * total / size, rtol=0, atol=1e-12):
        failures.append(f"average in tf.function: {got.tolist()}")
    # A constant input inside tf.function: the op must still run as a collective.
    folded = tf.function(lambda: cst.allreduce(tf.constant([1.0, 2.0]), name="c.const", op="sum"))().numpy()
    if not np.allclose(folded, [size, 2.0 * size]):
        failures.append(f"constant input: {folded.tolist()}")
    slices = tf.IndexedSlices(tf.ones((1, 2)) * (rank + 1), tf.constant([rank % 2]), tf.constant([2, 2]))
    dense = np.zeros((2, 2))
    for r in range(size):
        dense[r % 2] += r + 1
    # As in Horovod, IndexedSlices come back as IndexedSlices (every rank's rows and indices).
    reduced = cst.allreduce(slices, name="c.slices", op="sum")
    got = tf.convert_to_tensor(reduced).numpy() if isinstance(reduced, tf.IndexedSlices) else None
    if got is None or not np.allclose(got, dense):
        failures.append(f"IndexedSlices: {reduced} != {dense.tolist()}")
    variables = [
        tf.Variable(np.full(3, rank, np.uint32)),
        tf.Variable([float(rank), 1.0]),
        tf.Variable(rank != 0),
    ]
    cst.broadcast_variables(variables, root_rank=size - 1)
    expected = [np.full(3, size - 1, np.uint32), np.array([size - 1.0, 1.0]), np.array(size - 1 != 0)]
    for variable, want in zip(variables, expected):
        if not np.array_equal(variable.numpy(), want):
            failures.append(f"broadcast {variable.dtype.name}: {variable.numpy()} != {want}")
    verdict = "FAIL" if failures else "PASS"
    print(f"{verdict} collectives/{policy} rank={rank} {'; '.join(failures)}", flush=True)


def main() -> None:
    """Runs every configuration under each policy named."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", required=True, help="priority, fifo, or both comma-separated")
    parser.add_argument("--configs", default="collectives,fit,optimizer-loop,tape")
    parser.add_argument("--dtypes", default="float32,float64,float16")
    parser.add_argument(
        "--overlap", metavar="DIR", help="then overlap.py's check, its timelines in DIR (labels overlap/...)"
    )
    args = parser.parse_args()
    configs = args.configs.split(",")
    for policy in args.policy.split(","):
        if policy not in ("priority", "fifo"):
            parser.error(f"--policy {policy!r}: choose priority or fifo")
        run_policy(policy, configs, args.dtypes.split(","))
    if args.overlap:
        import overlap

        overlap.run(Path(args.overlap), prefix="overlap/")


def run_policy(policy: str, configs: list[str], dtypes: list[str]) -> None:
    """The configurations under one policy, between an init() and a shutdown()."""
    commsched.init(policy=policy)
    if commsched.config()["policy"] != policy:
        print(f"FAIL policy/{policy} is {commsched.config()['policy']}", flush=True)
    rank, size = commsched.rank(), commsched.size()
    if "collectives" in configs:
        collectives(policy, rank, size)
    if "fit" in configs:
        keras_fit(policy, rank, size)
    if "optimizer-loop" in configs:
        optimizer_loop(policy, rank, size)
    if "tape" in configs:
        for dtype in dtypes:
            tape_loop(policy, rank, size, dtype)
    commsched.shutdown()


if __name__ == "__main__":
    main()
