"""`import commsched.torch as hvd`: Horovod's collectives, their gradients and DistributedOptimizer's
arguments, on 2 ranks over MPI (mpiexec) and Gloo (torchrun), and on 3 ranks over MPI; where
Horovod's own suite checks exact behaviour (shapes that differ with equal element counts, float
alltoall splits, scale factors in the tensor's dtype, broadcast_optimizer_state's zero gradients,
join() with allreduce, broadcast and allgather); and Horovod 0.28.1's grouped allgather and
reducescatter (with their gradients, scale factors and process sets), sparse_allreduce_async, integer
averages rounded toward zero, object collectives after a join, a join that fails naming the rank that
left, HorovodInternalError and a name refused until synchronized.

Each rank script checks its results against references computed another way (torch on every
rank's inputs, one process on the whole batch) and prints PASS or FAIL per check. One launch per
launcher and rank count runs every script of that cell in turn (tests/in_turn.py), so
the cell pays Python's and torch's start-up once; each test judges its own script's lines.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from in_turn import check_script
from mpirun import unglue
from torch_launcher import HERE, have_mpiexec, launch

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
PARITY = [
    "shape-mismatch",
    "alltoall-float-splits",
    "scale-in-dtype",
    "optimizer-state-zero-grads",
    "join-average",
    "join-refuses",
]
GROUPED = [
    "grouped-allgather",
    "grouped-allgather-grad",
    "grouped-reducescatter-sum",
    "grouped-reducescatter-average",
    "grouped-reducescatter-grad-sum",
    "grouped-reducescatter-grad-average",
    "grouped-process-sets",
    "sparse-allreduce-sum",
    "sparse-allreduce-average",
    "integer-average-truncates",
    "object-after-join",
    "internal-error",
    "duplicate-name-refused",
    "join-fails-when-a-rank-leaves",
]
# What each cell runs, in this order; grouped goes last, as its last check stops rank 1.
SCRIPTS = {
    2: ["horovod_collectives", "horovod_autograd", "horovod_optimizer", "horovod_parity", "horovod_grouped"],
    3: ["horovod_collectives", "horovod_autograd"],
}


@functools.cache
def _cell(launcher: str, ranks: int) -> subprocess.CompletedProcess[str]:
    """The one launch of every script of this cell."""
    scripts = [str(HERE / f"{script}.py") for script in SCRIPTS[ranks]]
    return launch(launcher, ranks, str(HERE.parent / "in_turn.py"), *scripts, timeout=300)


def _check(launcher: str, ranks: int, script: str, expected: list[str]) -> None:
    """`script`'s checks all passed on every rank, and the launch ended well unless another script failed."""
    result = _cell(launcher, ranks)
    output = unglue(result.stdout, "PASS ", "FAIL ")
    passes = re.findall(r"^PASS (\S+)", output, re.MULTILINE)
    failures = re.findall(r"^FAIL (.*)", output, re.MULTILINE)
    check_script(result.returncode, passes, failures, script, expected, ranks, output[-6000:])


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_mpi(ranks: int) -> None:
    """Every collective, sync and async, every dtype it takes, against torch references (MPI)."""
    _check("mpiexec", ranks, "horovod_collectives", COLLECTIVES)


def test_collectives_gloo() -> None:
    """The same under torchrun (the Gloo transport)."""
    _check("torchrun", 2, "horovod_collectives", COLLECTIVES)


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_gradients_mpi(ranks: int) -> None:
    """Gradients through each collective and SyncBatchNorm equal one process's autograd (MPI)."""
    _check("mpiexec", ranks, "horovod_autograd", GRADIENTS)


def test_gradients_gloo() -> None:
    """The same under torchrun (Gloo)."""
    _check("torchrun", 2, "horovod_autograd", GRADIENTS)


@needs_mpi
def test_optimizer_mpi() -> None:
    """DistributedOptimizer's Horovod arguments and patterns against one process on the whole batch (MPI)."""
    _check("mpiexec", 2, "horovod_optimizer", OPTIMIZER)


def test_optimizer_gloo() -> None:
    """The same under torchrun (Gloo)."""
    _check("torchrun", 2, "horovod_optimizer", OPTIMIZER)


@needs_mpi
def test_parity_mpi() -> None:
    """Where Horovod's suite checks exact behaviour, against torch arithmetic on all inputs (MPI)."""
    _check("mpiexec", 2, "horovod_parity", PARITY)


def test_parity_gloo() -> None:
    """The same under torchrun (Gloo)."""
    _check("torchrun", 2, "horovod_parity", PARITY)


@needs_mpi
def test_grouped_mpi() -> None:
    """Grouped collectives, sparse allreduce, join's and errors' paths, against torch on every rank's inputs (MPI)."""
    _check("mpiexec", 2, "horovod_grouped", GROUPED)


def test_grouped_gloo() -> None:
    """The same under torchrun (Gloo)."""
    _check("torchrun", 2, "horovod_grouped", GROUPED)
