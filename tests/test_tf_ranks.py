"""2 and 3 ranks of the TensorFlow plug-in under mpiexec, checked against one process on the whole batch.

Each run covers collectives of every dtype, Keras fit() with DistributedOptimizer and the
broadcast callback, a tf.function loop with DistributedOptimizer, and tf.function loops
with DistributedGradientTape on an embedding model (IndexedSlices gradients) in float32,
float64 and float16; under the priority and the fifo policy (3 ranks: priority). A timeline
test shows that inside tf.function the first gradient is on the wire before the backward pass
ends; it runs at the end of the 2-rank launch (overlap.py through equivalence.py's --overlap), so
TensorFlow starts once for both.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tf_ranks"))
from mpirun import full_matrix
from tf_launcher import have_mpiexec, launch, verdicts

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

ALL = [
    "collectives/{p}",
    "fit/{p}",
    "optimizer-loop/{p}",
    "tape/float32/{p}",
    "tape/float64/{p}",
    "tape/float16/{p}",
]


POLICIES = ["priority", "fifo"]
THREE_RANKS = ["collectives/{p}", "fit/{p}", "tape/float32/{p}"]


@functools.cache
def _launch(ranks: int, policies: tuple[str, ...], *args: str) -> subprocess.CompletedProcess[str]:
    """One launch runs `policies` in turn (each between its own init and shutdown), so the tests of
    a rank count share TensorFlow's start-up; each test judges its own policy's lines."""
    return launch(ranks, "equivalence.py", "--policy", ",".join(policies), *args, timeout=300)


def _two_ranks(traces: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The 2-rank launch's policies and arguments: every policy with the full matrix, then overlap.py's
    check with its timelines in `traces`."""
    return tuple(POLICIES) if full_matrix() else ("priority",), ("--overlap", str(traces))


@pytest.fixture(scope="module")
def overlap_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the 2-rank launch's timelines."""
    return tmp_path_factory.mktemp("overlap")


def _policy_of(verdict: str) -> str:
    """The policy a PASS or FAIL label ends with ("tape/float16/fifo rank=1 ..." -> "fifo")."""
    words = verdict.split()
    return words[0].rstrip(":").rsplit("/", 1)[-1] if words else ""


def _check(ranks: int, policies: tuple[str, ...], policy: str, expected: list[str], *args: str) -> None:
    result = _launch(ranks, policies, *args)
    passes, failures = verdicts(result)
    tail = result.stdout[-4000:]
    assert result.returncode == 0, tail
    # This policy's failures, and any that names no policy, fail the test (overlap.py's have their own).
    failures = [f for f in failures if not f.startswith("overlap/")]
    assert not [f for f in failures if _policy_of(f) == policy or _policy_of(f) not in POLICIES], tail
    assert sorted(p for p in passes if _policy_of(p) == policy) == sorted(
        label.format(p=policy) for label in expected for _ in range(ranks)
    ), tail


@pytest.mark.parametrize("policy", [POLICIES[0], pytest.param(POLICIES[1], marks=pytest.mark.full)])
def test_two_ranks_match_one_process(policy: str, overlap_traces: Path) -> None:
    """2 ranks: every configuration ends with the single-process weights. The plug-in's path is the
    same under fifo, so only the full matrix runs it (in the same launch as priority)."""
    policies, arguments = _two_ranks(overlap_traces)
    _check(2, policies, policy, ALL, *arguments)


def test_three_ranks_match_one_process() -> None:
    """3 ranks (averaging divides by an odd count): fit, the tape in float32, the collectives, under
    the priority policy (the plug-in's path is the same under fifo, which the 2-rank run covers)."""
    _check(
        3, ("priority",), "priority", THREE_RANKS, "--configs", "collectives,fit,tape", "--dtypes", "float32"
    )


def test_reduction_starts_before_backward_ends(overlap_traces: Path, tmp_path: Path) -> None:
    """From the commsched timeline: in tf.function, the first gradient is on the wire before the last is computed.

    On a loaded host TensorFlow's executor now and then runs a whole job's reductions after its
    backward ops, so a job that shows no overlap gets one more try, a launch of overlap.py alone; a
    scheduler that holds reductions until backward ends fails both.
    """
    policies, arguments = _two_ranks(overlap_traces)
    result = _launch(2, policies, *arguments)
    passes, failures = verdicts(result)
    passes = [p.removeprefix("overlap/") for p in passes if p.startswith("overlap/")]
    failures = [f for f in failures if f.startswith("overlap/")]
    if failures or len(passes) != 4:
        result = launch(2, "overlap.py", str(tmp_path))
        passes, failures = verdicts(result)
        assert result.returncode == 0, result.stdout[-4000:]
    assert not failures and sorted(passes) == ["fit", "fit", "tape", "tape"], result.stdout[-4000:]
