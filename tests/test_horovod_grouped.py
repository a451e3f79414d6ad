"""`import commsched.torch as hvd`: Horovod 0.28.1's grouped allgather and reducescatter (with their
gradients, scale factors and process sets), sparse_allreduce_async, integer averages rounded toward
zero, object collectives after a join, a join that fails naming the rank that left,
HorovodInternalError and a name refused until synchronized; 2 ranks over MPI and Gloo.
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

CHECKS = [
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


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param(
            "mpiexec", marks=pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")
        ),
        "torchrun",
    ],
)
def test_horovod_grouped(launcher: str) -> None:
    """Every check passes on both ranks, each against torch on every rank's inputs."""
    result = launch(launcher, 2, "horovod_grouped.py", timeout=90)
    output = unglue(result.stdout, "PASS ", "FAIL ")
    tail = output[-6000:]
    assert "FAIL" not in output, tail
    assert result.returncode == 0, tail
    assert sorted(re.findall(r"^PASS ([\w-]+)", output, re.MULTILINE)) == sorted(CHECKS * 2), tail
