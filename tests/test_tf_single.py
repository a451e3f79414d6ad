"""The TensorFlow plug-in in one process: wrong uses fail clearly, the op build cache, forward order.

Multi-rank behaviour is in test_tf_ranks.py; here one rank (loopback transport) checks
the wrappers against the plain optimizer, and the build against racing processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import commsched.tensorflow as cst
from commsched.tensorflow import _build

import commsched

sys.path.insert(0, str(Path(__file__).resolve().parent / "tf_ranks"))
import tf_common as common


@pytest.fixture
def started() -> Iterator[None]:
    """commsched running on one rank for the test's duration."""
    commsched.init(transport="loopback")
    try:
        yield
    finally:
        commsched.shutdown()


@pytest.fixture
def stopped() -> None:
    """commsched not running."""
    if commsched.is_initialized():
        commsched.shutdown()


def test_calls_before_init_fail_clearly(stopped: None) -> None:
    """allreduce, the tape and fit() with the wrapped optimizer all name commsched.init()."""
    with pytest.raises(RuntimeError, match=r"needs commsched\.init\(\) first"):
        cst.allreduce(tf.ones(2))
    variable = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = variable * 2.0
    with pytest.raises(
        RuntimeError, match=r"DistributedGradientTape\.gradient\(\) needs commsched\.init\(\)"
    ):
        cst.DistributedGradientTape(tape).gradient(loss, [variable])
    model = common.dense_model()
    model.compile(optimizer=cst.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=common.loss_fn)
    x, y = common.dense_data(1)
    with pytest.raises(RuntimeError, match=r"DistributedOptimizer\.apply\(\) needs commsched\.init\(\)"):
        model.fit(x, y, verbose=0)


def test_graph_broadcasts_build_before_init_and_name_it_when_run(stopped: None) -> None:
    """In graph mode the broadcast ops build before init(), as Horovod's do; running one without
    init() fails naming it."""
    with tf.Graph().as_default():
        cst.broadcast_global_variables(0)  # no global variables yet
        variable = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 2.0]))
        op = cst.broadcast_variables([variable], root_rank=0)
        with tf.compat.v1.Session() as session:
            session.run(variable.initializer)
            with pytest.raises(tf.errors.FailedPreconditionError, match=r"needs commsched\.init\(\) first"):
                session.run(op)


def test_wrapping_twice_is_rejected() -> None:
    """A second wrap of an optimizer or a tape is a ValueError that says so."""
    optimizer = cst.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="already a commsched DistributedOptimizer"):
        cst.DistributedOptimizer(optimizer)
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="already a commsched DistributedGradientTape"):
        cst.DistributedGradientTape(cst.DistributedGradientTape(tape))


@pytest.mark.parametrize("bad", ["sgd", "torch-like"])
def test_non_keras_optimizer_is_rejected(bad: str) -> None:
    """A string or any other object (not a TF1 optimizer, wrapped as Horovod's legacy one) is a TypeError
    pointing at Keras 3 optimizers."""
    candidate = {
        "sgd": "sgd",
        "torch-like": type("SGD", (), {"step": lambda self: None})(),
    }[bad]
    with pytest.raises(TypeError, match="wraps a Keras 3 optimizer"):
        cst.DistributedOptimizer(candidate)


def test_other_wrong_uses() -> None:
    """A built optimizer, a bad op and a non-tape are refused with the reason."""
    built = keras.optimizers.SGD(0.1)
    built.build([keras.Variable(np.zeros(2))])
    with pytest.raises(ValueError, match="before its first step"):
        cst.DistributedOptimizer(built)
    with pytest.raises(ValueError, match='"sum" or "average"'):
        cst.DistributedOptimizer(keras.optimizers.SGD(0.1), op="max")
    with pytest.raises(TypeError, match=r"wraps a tf\.GradientTape"):
        cst.DistributedGradientTape(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 10**400], ids=["nan", "inf", "huge-int"])
def test_non_finite_scale_factors_never_reach_the_core(bad: object) -> None:
    """The ops skip commsched's Python checks, so scale factors are checked here (NaN reads as a mismatch)."""
    from commsched.tensorflow import _ops

    with pytest.raises(ValueError, match="postscale_factor is .*; a scale factor must be a finite number"):
        _ops._scale(bad, "postscale_factor")
    assert _ops._scale(3, "prescale_factor") == 3.0


def test_one_rank_matches_the_plain_optimizer(started: None) -> None:
    """On one rank, fit() with the wrapped optimizer and the wrapped tape equal plain Keras."""
    x, y = common.dense_data(2)
    reference = common.dense_model()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=common.loss_fn)
    reference.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    model = common.dense_model()
    model.compile(optimizer=cst.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=common.loss_fn)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert common.max_difference(model, reference) == 0.0
    looped = common.dense_model()
    common.train_loop(looped, keras.optimizers.Adam(0.01), x, y, 4, wrap=cst.DistributedGradientTape)
    assert common.max_difference(looped, reference) == 0.0
    assert isinstance(model.optimizer, keras.optimizers.Adam)


def test_eager_tape_reduces_sparse_gradients(started: None) -> None:
    """Eagerly, an embedding's IndexedSlices gradient comes back dense and equal to the plain one."""
    model = common.embedding_model("float32")
    tokens = np.array([[1, 2, 2]], np.int32)
    with tf.GradientTape(persistent=True) as tape:
        loss = common.loss_fn(np.array([1]), model(tokens))
    plain = tape.gradient(loss, model.trainable_variables)
    reduced = cst.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    assert any(isinstance(g, tf.IndexedSlices) for g in plain)
    for want, got in zip(plain, reduced):
        assert isinstance(got, tf.Tensor)
        np.testing.assert_array_equal(got.numpy(), tf.convert_to_tensor(want).numpy())


def test_forward_order_is_measured_not_declared() -> None:
    """A model that declares its head first but uses its embedding first gets the use order."""
    model = common.embedding_model("float32")
    used = [
        model.embed.embeddings,
        model.hidden.kernel,
        model.hidden.bias,
        model.head.kernel,
        model.head.bias,
    ]
    assert [id(v) for v in model.trainable_variables] != [id(v) for v in used]  # declared order differs
    measured = cst.forward_order(model, np.zeros((1, 3), np.int32))
    assert [id(v) for v in measured] == [id(v) for v in used]


def test_cache_key_follows_version_and_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A new TensorFlow version or an edited source gives another library path; the root is overridable."""
    assert _build.cache_key("2.21.0", [b"a"]) != _build.cache_key("2.22.0", [b"a"])
    assert _build.cache_key("2.21.0", [b"a"]) != _build.cache_key("2.21.0", [b"b"])
    assert _build.cache_key("2.21.0", [b"ab", b""]) != _build.cache_key("2.21.0", [b"a", b"b"])
    monkeypatch.setenv("COMMSCHED_TF_OPS_DIR", str(tmp_path))
    current = _build.library_path()
    assert current.parent.parent == tmp_path and current.parent.name.startswith(tf.__version__ + "-")
    monkeypatch.setattr(tf, "__version__", "0.0.0-test")
    assert _build.library_path() != current


def test_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No compiler on PATH, or a CXX that does not exist, is a BuildError saying what to install or set."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cst.BuildError, match="needs a C\\+\\+17 compiler"):
        _build.compiler()
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(cst.BuildError, match="CXX='no-such-compiler'"):
        _build.compiler()


RACER = """
import importlib.util, os, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("racing_build", sys.argv[1])
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
build.SOURCES = (Path(sys.argv[2]),)
build.HEADERS = ()
build.tf_flags = lambda: ([], [])  # a plain C++ file: the race, not TensorFlow's headers, is under test
print("INODE", os.stat(build.build(Path(sys.argv[3]))).st_ino)
"""


def test_ranks_racing_to_build_share_one_library(tmp_path: Path) -> None:
    """Three processes building at once into an empty cache: one compiles, all get the same file."""
    count = tmp_path / "compiles"
    compiler = tmp_path / "slow-c++"
    # Counts its runs and is slow, so the racers really overlap.
    compiler.write_text(f'#!/bin/sh\necho run >> {count}\nsleep 1\nexec {_build.compiler()} "$@"\n')
    compiler.chmod(0o755)
    source = tmp_path / "tiny.cc"
    source.write_text('extern "C" int commsched_tiny() { return 1; }\n')
    target = tmp_path / "cache" / "key" / _build.LIBRARY_NAME
    env = dict(os.environ, CXX=str(compiler))
    argv = [sys.executable, "-c", RACER, _build.__file__, str(source), str(target)]
    racers = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(3)
    ]
    outputs = [racer.communicate(timeout=120)[0] for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), "\n".join(outputs)[-4000:]
    assert count.read_text().split() == ["run"], "more than one process compiled"
    inodes = {line for output in outputs for line in output.splitlines() if line.startswith("INODE")}
    assert len(inodes) == 1, outputs
    assert sorted(p.name for p in target.parent.iterdir()) == [".lock", _build.LIBRARY_NAME]
