"""Rank script: every Horovod collective of `commsched.tensorflow` inside tf.function, and its gradient.

Each result is checked against numpy over every rank's inputs (which every rank can compute, the
inputs being seeded by rank); each gradient taken with tf.GradientTape inside tf.function is checked
against the same tape run eagerly and against its closed form. Prints "PASS <check>" or
"FAIL <check> ..." per check.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import commsched.tensorflow as hvd
import numpy as np
import tensorflow as tf

failures = 0
REDUCED = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8", "int16"]
MOVED = [*REDUCED, "uint16", "bool"]
NUMPY_REFERENCE = {"sum": np.sum, "average": np.mean, "min": np.min, "max": np.max, "product": np.prod}
HVD_OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}


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
    """Small exact values of `rank` for one check (non-negative for unsigned dtypes, bool for bool)."""
    rng = np.random.default_rng([salt, rank])
    low = 0 if dtype in ("uint8", "uint16", "bool") else -3
    raw = rng.integers(low, 4, shape)
    return raw > 1 if dtype == "bool" else raw.astype(np.float64)


def tensor(array: np.ndarray, dtype: str) -> tf.Tensor:
    """`array` as a TF tensor of `dtype` (bfloat16 and uint16 through a cast)."""
    return tf.cast(tf.constant(array), getattr(tf, dtype))


def equal(got: Any, want: Any, tolerance: float = 0.0, what: str = "") -> None:
    got = np.asarray(tf.cast(got, tf.float64).numpy() if isinstance(got, tf.Tensor) else got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.allclose(got, want, rtol=tolerance, atol=tolerance), f"{what}: {got} != {want}"


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def allreduce_ops() -> None:
        for op, reference in NUMPY_REFERENCE.items():
            for dtype in REDUCED:
                inputs = [values(r, 1, (3, 2), dtype) for r in range(size)]
                run = tf.function(lambda t, op=op: hvd.allreduce(t, op=HVD_OPS[op]))
                want = reference(inputs, axis=0)
                if op == "average" and not dtype.startswith(("float", "bfloat")):
                    want = np.trunc(want)  # integer average rounds toward zero, as in Horovod
                tolerance = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
                equal(run(tensor(inputs[rank], dtype)), want, tolerance, f"{op} {dtype}")
        flags = [values(r, 2, (5,), "bool") for r in range(size)]
        for op, reference in [(hvd.Max, np.any), (hvd.Min, np.all), (hvd.Product, np.all)]:
            got = tf.function(lambda t, op=op: hvd.allreduce(t, op=op))(tf.constant(flags[rank]))
            assert got.dtype == tf.bool
            equal(got, reference(flags, axis=0), what=f"bool {op}")
        # A process set id never registered fails the op, naming the set.
        from commsched.tensorflow import _build, _ops

        try:
            _build.load().commsched_allreduce(
                tf.constant([1.0]), tensor_name="set.1", process_set_id=1, core_library=_ops.core_library()
            )
        except tf.errors.FailedPreconditionError as refusal:
            assert "process set 1" in str(refusal), refusal
        else:
            raise AssertionError("the unregistered process_set_id=1 was not refused")

    def adasum() -> None:
        # Horovod's pairwise formula in float64, computed here from both ranks' inputs (2 ranks: one pair).
        def formula(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            dot = float(np.dot(a.ravel(), b.ravel()))
            return (1 - dot / (2 * np.dot(a.ravel(), a.ravel()))) * a + (
                1 - dot / (2 * np.dot(b.ravel(), b.ravel()))
            ) * b

        inputs = [values(r, 9, (4, 3)) + 0.5 for r in range(size)]
        for dtype, tolerance in [("float16", 2e-2), ("float32", 1e-5), ("float64", 1e-12)]:
            run = tf.function(
                lambda t: hvd.allreduce(t, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
            )
            equal(
                run(tensor(inputs[rank], dtype)),
                formula(2 * inputs[0], 2 * inputs[1]) * 0.5,
                tolerance,
                dtype,
            )
        equal(hvd.allreduce(tf.constant(inputs[rank]), op=hvd.Adasum), formula(*inputs), 1e-12, "eager")
        weights = [values(r, 10, (4, 3)) for r in range(size)]

        @tf.function
        def gradient(x: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(hvd.allreduce(x, op=hvd.Adasum) * tf.constant(weights[rank]))
            return tape.gradient(loss, x)

        equal(gradient(tf.constant(inputs[rank])), formula(*weights), 1e-12, "gradient")
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            reduced = hvd.allreduce(tf.constant(inputs[rank]), op=hvd.Adasum, name="adasum.graph")
            equal(session.run(reduced), formula(*inputs), 1e-12, "graph mode")
        solo = hvd.add_process_set([0])
        for bad, error in [
            (lambda: hvd.allreduce(tf.ones(2, tf.int32), op=hvd.Adasum), TypeError),
            (lambda: hvd.allreduce(tf.ones(2), op=hvd.Adasum, process_set=solo), NotImplementedError),
        ]:
            try:
                bad()
            except error as refusal:
                assert "Adasum" in str(refusal), refusal
            else:
                raise AssertionError(f"Adasum did not raise {error.__name__}")
        hvd.remove_process_set(solo)

    def scale_factors() -> None:
        for dtype in ["float32", "float64", "int32", "int64", "float16"]:
            inputs = [values(r, 3, (4,), dtype) for r in range(size)]
            run = tf.function(
                lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
            )
            scaled = np.sum([x * 0.5 for x in inputs], axis=0) * 3.0
            if dtype.startswith("int"):
                # Scaled in double precision and rounded back to the integer type at each step, as in Horovod.
                scaled = np.trunc(np.sum([np.trunc(x * 0.5) for x in inputs], axis=0) * 3.0)
            equal(run(tensor(inputs[rank], dtype)), scaled, 1e-3, f"scaled {dtype}")

    def grouped() -> None:
        same = [values(rank, 4 + i, (i + 1, 2)) for i in range(3)]
        run = tf.function(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Max))
        got = run([tf.constant(x) for x in same])
        for i, part in enumerate(got):
            equal(
                part, np.max([values(r, 4 + i, (i + 1, 2)) for r in range(size)], axis=0), what=f"member {i}"
            )
        mixed = [tf.constant(values(rank, 7, (3,))), tf.constant(values(rank, 8, (2,), "int32"), tf.int32)]
        summed = tf.function(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Sum))(mixed)
        assert summed[1].dtype == tf.int32
        equal(summed[0], np.sum([values(r, 7, (3,)) for r in range(size)], axis=0))
        equal(summed[1], np.sum([values(r, 8, (2,), "int32") for r in range(size)], axis=0))

    def allgather() -> None:
        for dtype in MOVED:
            inputs = [values(r, 9, (r + 1, 3), dtype) for r in range(size)]
            spec = tf.TensorSpec([None, 3], getattr(tf, dtype))
            run = tf.function(lambda t: hvd.allgather(t), input_signature=[spec])
            got = run(tensor(inputs[rank], dtype))
            assert got.dtype == getattr(tf, dtype), got.dtype
            equal(got, np.concatenate(inputs), what=f"allgather {dtype}")
        empty_here = np.zeros((0, 2)) if rank == 0 else values(rank, 10, (2, 2))
        gathered = tf.function(lambda t: hvd.allgather(t))(tf.constant(empty_here))
        equal(gathered, np.concatenate([np.zeros((0, 2))] + [values(r, 10, (2, 2)) for r in range(1, size)]))
        scalars = tf.function(lambda t: hvd.allgather(t))(tf.constant(float(rank)))
        equal(scalars, np.arange(size, dtype=np.float64), what="scalars")

    def reducescatter() -> None:
        for rows in (2 * size, 2 * size + 1):  # the first rows % size ranks keep one row more
            inputs = [values(r, 11, (rows, 3)) for r in range(size)]
            cuts = np.cumsum([0] + [rows // size + (1 if r < rows % size else 0) for r in range(size)])
            for op in ("sum", "average"):
                run = tf.function(lambda t, op=op: hvd.reducescatter(t, op=HVD_OPS[op]))
                want = NUMPY_REFERENCE[op](inputs, axis=0)[cuts[rank] : cuts[rank + 1]]
                equal(run(tf.constant(inputs[rank])), want, 1e-6, f"{op} {rows} rows")
        ints = [values(r, 12, (size, 2), "int32") for r in range(size)]
        part = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0))(
            tf.constant(ints[rank], tf.int32)
        )
        equal(part, 2 * np.sum(ints, axis=0)[rank : rank + 1], what="int32 prescaled")

    def alltoall() -> None:
        for dtype in ["float32", "int64", "bool", "uint16", "bfloat16"]:
            splits = [(rank + d) % 3 for d in range(size)]
            sent = np.concatenate([np.full((splits[d], 2), 10 * rank + d) for d in range(size)])
            sent = sent > 10 if dtype == "bool" else sent
            run = tf.function(lambda t, s: hvd.alltoall(t, splits=s))
            output, received = run(tensor(sent, dtype), tf.constant(splits, tf.int32))
            from_each = [(s + rank) % 3 for s in range(size)]
            want = np.concatenate([np.full((from_each[s], 2), 10 * s + rank) for s in range(size)])
            equal(output, want > 10 if dtype == "bool" else want, what=f"alltoall {dtype}")
            equal(received, from_each, what="received splits")
        equal_parts = tf.function(lambda t: hvd.alltoall(t))(tf.constant(np.full((size, 1), rank)))
        equal(equal_parts, np.arange(size).reshape(size, 1), what="no splits")

    def broadcast_and_barrier() -> None:
        for dtype in MOVED:
            mine = values(rank, 13, (4,), dtype)
            got = tf.function(lambda t: hvd.broadcast(t, root_rank=size - 1))(tensor(mine, dtype))
            equal(got, values(size - 1, 13, (4,), dtype), what=f"broadcast {dtype}")
        counter = tf.Variable(0)

        @tf.function
        def fenced() -> tf.Tensor:
            counter.assign_add(1)
            hvd.barrier()
            return counter.read_value()

        assert int(fenced()) == 1 and int(fenced()) == 2
        hvd.barrier()

    def gradients() -> None:
        x = values(rank, 14, (2 * size + 1, 3))
        weights = [values(r, 15, (2 * size + 1, 3)) for r in range(size)]

        def tape_of(
            collective: Callable[[tf.Tensor], tf.Tensor], weight: np.ndarray
        ) -> Callable[[tf.Tensor], tf.Tensor]:
            def gradient(variable: tf.Tensor) -> tf.Tensor:
                with tf.GradientTape() as tape:
                    tape.watch(variable)
                    loss = tf.reduce_sum(collective(variable) * weight)
                return tape.gradient(loss, variable)

            return gradient

        rows = 2 * size + 1
        cuts = np.cumsum([0] + [rows // size + (1 if r < rows % size else 0) for r in range(size)])
        cases = {
            "allreduce sum": (lambda t: hvd.allreduce(t, op=hvd.Sum), weights[rank], np.sum(weights, axis=0)),
            "allreduce average": (lambda t: hvd.allreduce(t), weights[rank], np.sum(weights, axis=0) / size),
            "grouped": (
                lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)[1],
                weights[rank],
                2 * np.sum(weights, axis=0),
            ),
            "broadcast": (
                lambda t: hvd.broadcast(t, root_rank=0),
                weights[rank],
                np.mean(weights, axis=0) if rank == 0 else np.zeros_like(x),
            ),
            "reducescatter sum": (
                lambda t: hvd.reducescatter(t, op=hvd.Sum),
                weights[rank][cuts[rank] : cuts[rank + 1]],
                size * np.concatenate([weights[r][cuts[r] : cuts[r + 1]] for r in range(size)]),
            ),
            "reducescatter average": (
                lambda t: hvd.reducescatter(t, op=hvd.Average),
                weights[rank][cuts[rank] : cuts[rank + 1]],
                np.concatenate([weights[r][cuts[r] : cuts[r + 1]] for r in range(size)]),
            ),
        }
        gathered_weights = [values(r, 16, (rows * size, 3)) for r in range(size)]
        cases["allgather"] = (
            lambda t: hvd.allgather(t),
            gathered_weights[rank],
            np.mean(gathered_weights, axis=0)[rank * rows : (rank + 1) * rows],
        )
        # Alltoall: rank d receives splits[d] rows from every rank, so its weights cover size * splits[d]
        # rows, and the gradient of this rank's rows sent to d is d's weights on this rank's block.
        splits = [1] * (size - 1) + [rows - (size - 1)]
        a2a_weights = [values(d, 17, (size * splits[d], 3)) for d in range(size)]
        cases["alltoall"] = (
            lambda t: hvd.alltoall(t, splits=splits)[0],
            a2a_weights[rank],
            np.concatenate([a2a_weights[d][rank * splits[d] : (rank + 1) * splits[d]] for d in range(size)]),
        )
        for label, (collective, weight, closed_form) in cases.items():
            eager = tape_of(collective, weight)(tf.constant(x))
            graph = tf.function(tape_of(collective, weight))(tf.constant(x))
            equal(graph, eager.numpy(), 1e-6, f"{label}: graph against eager")
            equal(graph, closed_form, 1e-6, f"{label}: closed form")

    check("allreduce-ops", allreduce_ops)
    check("scale-factors", scale_factors)
    check("grouped-allreduce", grouped)
    check("allgather", allgather)
    check("reducescatter", reducescatter)
    check("alltoall", alltoall)
    check("broadcast-barrier", broadcast_and_barrier)
    check("gradients", gradients)
    check("adasum", adasum)
    hvd.shutdown()
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
