"""Reliability: memory safety of dropped handles, refusals that reach every rank, the error
hierarchy, clear messages for bad input, no half-started state, bounded per-name state."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import run_ranks

import commsched
from commsched import _core
from commsched.config import SettingError, parse_size, resolve

ROOT = Path(__file__).resolve().parent.parent
MAX_CACHED_NAMES = 16384  # kDefaultMaxCachedNames in csrc/core/agreement.h


@pytest.fixture
def runtime():
    """A loopback runtime, shut down after the test."""
    commsched.init(transport="loopback")
    yield
    commsched.shutdown()


def _ranks(scenario: str, ranks: int, *args: str, timeout: float = 180) -> None:
    pytest.importorskip("mpi4py")
    result = run_ranks(ranks, "reliability_scenarios.py", scenario, *args, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == ranks, result.stdout + result.stderr


# 1. Use after free


def test_dropped_handles_never_write_into_freed_memory() -> None:
    """numpy, torch, broadcast and the one-call path, dropped in flight: new arrays stay intact."""
    pytest.importorskip("torch")
    _ranks("dropped_handles", 2)


def test_owners_are_released_once_collectives_finish(runtime: None) -> None:
    """The core keeps owners only while their collectives run; a dropped array goes once done."""
    dropped = np.ones(1 << 16, np.float32)
    commsched.allreduce_async(dropped, "dropped")
    kept = commsched.allreduce_async(np.ones(4), "kept")
    kept.wait(timeout=10)
    commsched.allreduce(np.ones(1), "settle")
    assert _core.kept_owners() == 0
    assert sys.getrefcount(dropped) == 2  # this frame and getrefcount's argument: the core let go
    handles = [commsched.allreduce_async(np.ones(8), f"many{i}") for i in range(500)]
    del handles
    gc.collect()
    commsched.allreduce(np.ones(1), "settle again")
    assert _core.kept_owners() == 0


def test_an_owner_whose_release_runs_collectives_leaves_the_table_whole() -> None:
    """Releasing a finished owner may run Python code that submits and waits itself (here a
    finalizer, while another thread waits too): every collective completes, every owner goes, and
    the heap stays whole (releasing owners from inside the table's compaction crashed the process)."""
    code = """
import itertools, threading
import numpy as np
import commsched

commsched.init(transport="loopback")
numbers = itertools.count()
finalized = []

class Reentrant(np.ndarray):
    def __del__(self):
        finalized.append(float(commsched.allreduce(np.ones(2), name=f"inner.{next(numbers)}")[0]))

stop = threading.Event()
def other():
    while not stop.is_set():
        commsched.allreduce_async(np.ones(4), name=f"other.{next(numbers)}").wait()

thread = threading.Thread(target=other)
thread.start()
for round_ in range(100):
    handles = []
    for i in range(40):
        commsched.allreduce_async(np.zeros(8).view(Reentrant), name=f"dropped.{round_}.{i}")
        handles.append(commsched.allreduce_async(np.ones(3), name=f"kept.{round_}.{i}"))
    for handle in handles:
        handle.wait()
stop.set()
thread.join()
commsched.allreduce(np.ones(1), name="settle")
print("finalized", len(finalized), sum(finalized), "kept", commsched._core.kept_owners())
commsched.shutdown()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == ["finalized", "4000", "4000.0", "kept", "0"], done.stdout


# 2. A refusal on one rank reaches every rank


@pytest.mark.parametrize("ranks", [2, 3])
def test_refusal_on_one_rank_fails_every_rank_at_once(ranks: int) -> None:
    """Integer average, a root that is no rank, a read-only array: on one rank only."""
    _ranks("refused_on_one_rank", ranks)


def test_non_finite_scale_factors_are_refused_on_every_rank() -> None:
    """NaN on every rank: refused at submit by name (NaN != NaN read as a mismatch); inf on one rank."""
    _ranks("non_finite_scale", 2)


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), -float("inf"), np.float64("nan"), 10**400],
    ids=["nan", "inf", "-inf", "numpy-nan", "huge-int"],
)
def test_non_finite_scale_factors_are_refused_at_submit(runtime: None, bad: object) -> None:
    """Every road that takes scale factors refuses NaN and infinity naming the argument and the fix."""
    message = "{} of '{}' is .*; a scale factor must be a finite number: pass a finite {}"
    for argument in ("prescale_factor", "postscale_factor"):
        fix = message.format(argument, "x", argument)
        with pytest.raises(ValueError, match=fix):
            commsched.allreduce(np.ones(2), "x", **{argument: bad})
        with pytest.raises(ValueError, match=fix):
            commsched.allreduce_async(np.ones(2), "x", **{argument: bad})
        with pytest.raises(ValueError, match=message.format(argument, "g", argument)):
            commsched.grouped_allreduce([np.ones(2), np.ones(3)], "g", **{argument: bad})
        with pytest.raises(ValueError, match=message.format(argument, "r", argument)):
            commsched.reducescatter(np.ones(2), name="r", **{argument: bad})
    values = np.arange(4.0)
    assert np.array_equal(
        commsched.allreduce(values, "ok", prescale_factor=0.5, postscale_factor=3.0), np.arange(4.0) * 1.5
    )


def test_non_finite_scale_factors_are_refused_on_the_torch_road(runtime: None) -> None:
    """commsched.torch's allreduce and the optimizer's gradient_predivide_factor refuse NaN by name."""
    torch = pytest.importorskip("torch")
    import commsched.torch as ct

    with pytest.raises(ValueError, match="prescale_factor of 'allreduce.t' is nan"):
        ct.allreduce(torch.ones(2), name="t", op=ct.Sum, prescale_factor=float("nan"))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(
        ValueError, match="gradient_predivide_factor must be a finite number above 0, not nan"
    ):
        ct.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            gradient_predivide_factor=float("nan"),
        )
    assert torch.equal(
        ct.allreduce(torch.ones(2), name="u", op=ct.Sum, prescale_factor=2.0), torch.full((2,), 2.0)
    )


# 3. Tensor names are limited


@pytest.mark.parametrize("length", [4097, 70_000])
def test_overlong_name_is_refused_at_submit_naming_the_limit(runtime: None, length: int) -> None:
    """A name past 4 KiB is refused where it is submitted; commsched keeps running."""
    for submit in (commsched.allreduce, commsched.allreduce_async):
        with pytest.raises(
            ValueError, match=f"is {length} bytes long; tensor names are limited to 4096 bytes"
        ):
            submit(np.ones(2), "n" * length)
    assert commsched.allreduce(np.ones(2), "n" * 4096).tolist() == [1.0, 1.0]
    assert _core.running()


# 4. Scalars


def test_zero_dim_arrays_are_reduced_and_scalars_refused() -> None:
    """0-d numpy arrays and torch tensors reduce in place on every rank; np.float64(2.5) is refused."""
    pytest.importorskip("torch")
    _ranks("zero_dim", 2)


@pytest.mark.parametrize("scalar", [np.float64(2.5), np.int32(3), 2.5, 7], ids=repr)
def test_immutable_scalars_are_refused_with_the_fix(runtime: None, scalar: object) -> None:
    """A value with no memory to write into is refused, saying what to pass instead."""
    for submit in (commsched.allreduce, commsched.allreduce_async):
        with pytest.raises(TypeError, match="immutable.*1-element or 0-d array"):
            submit(scalar, "scalar")


# 5. One exception hierarchy


def test_runtime_errors_form_one_hierarchy() -> None:
    """Every runtime failure is a CommschedError; argument errors stay TypeError/ValueError."""
    assert issubclass(commsched.CommschedError, RuntimeError)
    assert issubclass(commsched.CollectiveError, commsched.CommschedError)
    assert issubclass(commsched.NotRunningError, commsched.CommschedError)
    assert issubclass(commsched.RankFailure, commsched.NotRunningError)
    assert not issubclass(commsched.NotRunningError, ValueError)
    for call in (
        lambda: commsched.allreduce_async(np.ones(2), "early"),
        lambda: commsched.allreduce(np.ones(2), "early"),
        lambda: commsched.broadcast(np.ones(2), 0, "early"),
        commsched.config,
        commsched.rank,
    ):
        with pytest.raises(commsched.NotRunningError, match=r"needs commsched.init\(\) first") as caught:
            call()
        assert caught.value.rank is None


def test_submitting_after_shutdown_is_not_running() -> None:
    """After shutdown() every path raises NotRunningError, not ValueError."""
    commsched.init(transport="loopback")
    commsched.shutdown()
    for call in (
        lambda: commsched.allreduce_async(np.ones(2), "late"),
        lambda: commsched.allreduce(np.ones(2), "late"),
        lambda: commsched.reconfigure(policy="fifo"),
    ):
        with pytest.raises(commsched.NotRunningError):
            call()


# 6. Clear messages


def test_object_dtype_names_the_dtype(runtime: None) -> None:
    """An object array says its dtype is unsupported, not that int() failed."""
    with pytest.raises(TypeError, match=r"tensor 'objects': dtype object .*not supported"):
        commsched.allreduce(np.array([1, "a"], dtype=object), "objects")


def test_huge_sizes_roots_and_fractional_bytes_are_refused_by_name(runtime: None) -> None:
    """Sizes past 2**62, roots past 32 bits and fractional byte counts name the setting or argument."""
    with pytest.raises(
        SettingError, match=r"init\(partition_bytes=...\): 99999999999999999999999 is not valid"
    ):
        resolve({"partition_bytes": 99999999999999999999999}, {})
    with pytest.raises(
        SettingError, match=r"COMMSCHED_CREDIT_BYTES: '1.5' is not valid \(1.5 bytes is not a whole"
    ):
        resolve({}, {"COMMSCHED_CREDIT_BYTES": "1.5"})
    assert parse_size("1.5MiB") == 1572864 and parse_size("0.1KB") == 100
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_size("1.0001KiB")
    for root in (2**40, -(2**40)):
        with pytest.raises(
            ValueError, match=f"root of 'b' is {root}, which is not a rank; use a rank between 0 and 0"
        ):
            commsched.broadcast(np.ones(2), root, "b")
    with pytest.raises(TypeError, match="root of 'b' must be a rank number"):
        commsched.broadcast(np.ones(2), 0.0, "b")  # type: ignore[arg-type]


def test_numpy_integer_priorities_are_taken_and_bools_refused(runtime: None) -> None:
    """np.int64 works as a priority or root; True and np.True_ are refused on every path."""
    assert commsched.allreduce(np.ones(2), "p", priority=np.int64(3)).tolist() == [1.0, 1.0]
    commsched.allreduce_async(np.ones(2), "pa", priority=np.int32(-2)).wait(timeout=10)
    commsched.broadcast(np.ones(2), np.int64(0), "r")
    for flag in (True, np.True_):
        for submit in (commsched.allreduce, commsched.allreduce_async):
            with pytest.raises(TypeError, match="priority of 'p' must be a 32-bit integer, not the boolean"):
                submit(np.ones(2), "p", priority=flag)


def test_bench_without_mpi4py_says_what_to_install() -> None:
    """commsched-bench allreduce where mpi4py cannot be imported: the fix, not a traceback."""
    program = (
        "import sys; sys.modules['mpi4py'] = None\n"  # makes `import mpi4py` fail as if not installed
        "from commsched.bench.cli import main\n"
        "sys.exit(main(['allreduce']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert "needs mpi4py" in result.stderr and "pip install mpi4py" in result.stderr, result.stderr
    assert "--transport grpc" in result.stderr and "--transport gloo" in result.stderr


# 7. No half-started state


def test_failed_autotune_log_leaves_commsched_not_initialised(tmp_path: Path) -> None:
    """An unwritable COMMSCHED_AUTOTUNE_LOG fails init() naming it, and the next init() works."""
    pytest.importorskip("optuna")
    log = tmp_path / "missing-dir" / "trials.csv"
    with pytest.raises(SettingError, match=f"COMMSCHED_AUTOTUNE_LOG='{log}': cannot write"):
        commsched.init(transport="loopback", autotune=True, autotune_log=str(log))
    assert not commsched.is_initialized() and not _core.running()
    with pytest.raises(commsched.NotRunningError):
        commsched.config()
    commsched.init(transport="loopback")
    commsched.shutdown()


# 8. Bounded per-name state


def test_name_cache_stays_bounded(runtime: None) -> None:
    """Past the cache's size, distinct names stop growing the core's per-name state."""
    names = MAX_CACHED_NAMES + 3000
    for step in range(names):
        commsched.allreduce(np.ones(1, np.float32), f"step{step}")
    cached = commsched.stats()["cached_names"]
    assert MAX_CACHED_NAMES * 3 // 4 <= cached <= MAX_CACHED_NAMES, cached
    for step in range(names):  # every name again, forgotten or not
        commsched.allreduce(np.ones(1, np.float32), f"step{step}")
    assert commsched.stats()["cached_names"] <= MAX_CACHED_NAMES
    assert commsched.stats()["completed_tensors"] == 2 * names


def test_name_cache_forgets_alike_on_every_rank() -> None:
    """Two ranks past the cache's size, then old and new names mixed in flight: results stay exact."""
    _ranks("many_names", 2, str(MAX_CACHED_NAMES + 1000), str(MAX_CACHED_NAMES), timeout=400)
