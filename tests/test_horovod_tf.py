"""`import commsched.tensorflow.keras as hvd` on 2 and 3 ranks under mpiexec: Horovod's collectives on TF
tensors, DistributedOptimizer / DistributedGradientTape with Horovod's arguments, and hvd.callbacks,
each against a reference computed another way (numpy over every rank's inputs, one process on the
whole batch, the callbacks' formulas)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tf_ranks"))
from tf_launcher import have_mpiexec, launch, verdicts

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

CHECKS = [
    "collectives",
    "eager-collectives",
    "optimizer-arguments",
    "tape-arguments",
    "adasum-gradients",
    "metric-average",
    "learning-rate-callbacks",
]


# 2 ranks only: TensorFlow starts once per rank, and odd rank counts are checked by test_tf_ranks.
@pytest.mark.parametrize("ranks", [2])
def test_horovod_keras_api(ranks: int) -> None:
    """Every check passes on every rank."""
    result = launch(ranks, "horovod_api.py")
    passes, failures = verdicts(result)
    tail = result.stdout[-6000:]
    assert not failures, tail
    assert result.returncode == 0, tail
    assert sorted(passes) == sorted(label for label in CHECKS for _ in range(ranks)), tail


SET_CHECKS = [
    "info-ops",
    "eager-gradients-on-a-set",
    "refusals",
    "grouped",
    "integer-average",
    "legacy-optimizer",
    "partial-distributed",
    "sparse-allreduce",
    "graph-broadcast-variables",
]


def test_horovod_process_sets_and_grouped() -> None:
    """Process sets {0} and {1} at 2 ranks: eager gradients, per-set info ops, refusals, grouped forms,
    integer averages."""
    result = launch(2, "horovod_sets.py")
    passes, failures = verdicts(result)
    tail = result.stdout[-6000:]
    assert not failures and result.returncode == 0, tail
    assert sorted(passes) == sorted(SET_CHECKS * 2), tail
