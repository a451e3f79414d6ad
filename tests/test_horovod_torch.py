"""`import commsched.torch as hvd`: Horovod's collectives, their gradients and DistributedOptimizer's
arguments, on 2 ranks over MPI (mpiexec) and Gloo (torchrun), and on 3 ranks over MPI.

Each rank script checks its results against references computed another way (torch on every
rank's inputs, one process on the whole batch) and prints PASS or FAIL per check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from mpirun import unglue
from torch_launcher import have_mpiexec, launch

pytest.importorskip("torch")
needs_mpi = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

COLLECTIVES = [
    "allreduce-every-dtype-and-op",
    "allreduce-forms",
    "grouped-allreduce",
    "allgather-every-dtype",
    "broadcast-every-dtype",
    "reducescatter",
    "alltoall",
    "objects-and-barrier",
    "wrong-uses",
    "basics",
]
GRADIENTS = [
    "allreduce-average",
    "allreduce-sum-scaled",
    "grouped-allreduce",
    "allgather",
    "broadcast",
    "reducescatter-average",
    "reducescatter-sum",
    "alltoall",
    "sync-batch-norm",
]
OPTIMIZER = [
    "named-parameters-missing",
    "arguments-refused",
    "predivide",
    "sum-op",
    "skip-synchronize-clipping",
    "warning-without-skip",
    "sparse-embedding",
    "sparse-as-dense",
    "compression-objects",
    "groups-accepted",
    "broadcast-state",
    "parameter-names",
    "outside-the-process-set",
]


def _check(result: object, ranks: int, expected: list[str]) -> None:
    output = unglue(result.stdout, "PASS ", "FAIL ")  # type: ignore[attr-defined]
    tail = output[-6000:]
    assert "FAIL" not in output, tail
    assert result.returncode == 0, tail  # type: ignore[attr-defined]
    passes = re.findall(r"^PASS ([\w-]+)", output, re.MULTILINE)
    assert sorted(passes) == sorted(label for label in expected for _ in range(ranks)), tail


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_mpi(ranks: int) -> None:
    """Every collective, sync and async, every dtype it takes, against torch references (MPI)."""
    _check(launch("mpiexec", ranks, "horovod_collectives.py"), ranks, COLLECTIVES)


def test_collectives_gloo() -> None:
    """The same under torchrun (the Gloo transport)."""
    _check(launch("torchrun", 2, "horovod_collectives.py"), 2, COLLECTIVES)


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_gradients_mpi(ranks: int) -> None:
    """Gradients through each collective and SyncBatchNorm equal one process's autograd (MPI)."""
    _check(launch("mpiexec", ranks, "horovod_autograd.py"), ranks, GRADIENTS)


def test_gradients_gloo() -> None:
    """The same under torchrun (Gloo)."""
    _check(launch("torchrun", 2, "horovod_autograd.py"), 2, GRADIENTS)


@needs_mpi
def test_optimizer_mpi() -> None:
    """DistributedOptimizer's Horovod arguments and patterns against one process on the whole batch (MPI)."""
    _check(launch("mpiexec", 2, "horovod_optimizer.py"), 2, OPTIMIZER)


def test_optimizer_gloo() -> None:
    """The same under torchrun (Gloo)."""
    _check(launch("torchrun", 2, "horovod_optimizer.py"), 2, OPTIMIZER)
