"""Every Horovod collective of `commsched.tensorflow` inside tf.function on 2 ranks under mpiexec: allreduce
with every op, dtype and scale factors, grouped_allreduce, allgather with an uneven (dynamic) first
dimension, reducescatter, alltoall with splits, broadcast and barrier against numpy over every rank's
inputs, and their gradients taken inside tf.function against the eager tape and their closed forms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tf_ranks"))
from tf_launcher import have_mpiexec, launch, verdicts

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

CHECKS = [
    "allreduce-ops",
    "scale-factors",
    "grouped-allreduce",
    "allgather",
    "reducescatter",
    "alltoall",
    "broadcast-barrier",
    "gradients",
    "adasum",
]


def test_collectives_in_tf_function() -> None:
    """Every check passes on both ranks."""
    ranks = 2
    result = launch(ranks, "graph_collectives.py", timeout=300)
    passes, failures = verdicts(result)
    tail = result.stdout[-8000:]
    assert not failures, tail
    assert result.returncode == 0, tail
    assert sorted(passes) == sorted(label for label in CHECKS for _ in range(ranks)), tail
