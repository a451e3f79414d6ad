"""`import commsched.tensorflow.keras as hvd` on 2 and 3 ranks under mpiexec: Horovod's collectives on TF
tensors, DistributedOptimizer / DistributedGradientTape with Horovod's arguments, and hvd.callbacks,
each against a reference computed another way (numpy over every rank's inputs, one process on the
whole batch, the callbacks' formulas). Both rank scripts run in one launch (tests/in_turn.py), so
TensorFlow starts once; each test judges its own script's lines."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tf_ranks"))
from in_turn import check_script
from tf_launcher import HERE, have_mpiexec, launch, verdicts

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


@functools.cache
def _launch() -> subprocess.CompletedProcess[str]:
    """horovod_api.py, then horovod_sets.py, on 2 ranks."""
    scripts = [str(HERE / "horovod_api.py"), str(HERE / "horovod_sets.py")]
    return launch(2, str(HERE.parent / "in_turn.py"), *scripts, timeout=300)


def _check(script: str, expected: list[str], ranks: int = 2) -> None:
    """`script`'s checks all passed on every rank, and the launch ended well unless the other script failed."""
    result = _launch()
    passes, failures = verdicts(result)
    check_script(result.returncode, passes, failures, script, expected, ranks, result.stdout[-6000:])


# 2 ranks only: TensorFlow starts once per rank, and odd rank counts are checked by test_tf_ranks.
@pytest.mark.parametrize("ranks", [2])
def test_horovod_keras_api(ranks: int) -> None:
    """Every check passes on every rank."""
    _check("horovod_api", CHECKS, ranks)


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
    _check("horovod_sets", SET_CHECKS)
