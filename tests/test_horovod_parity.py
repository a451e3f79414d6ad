"""`import commsched.torch as hvd` where Horovod's own test suite checks exact behaviour: shapes that
differ with equal element counts, float alltoall splits, scale factors in the tensor's dtype,
broadcast_optimizer_state's zero gradients, and join() with allreduce, broadcast and allgather;
2 ranks over MPI and Gloo.
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
    "shape-mismatch",
    "alltoall-float-splits",
    "scale-in-dtype",
    "optimizer-state-zero-grads",
    "join-average",
    "join-refuses",
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
def test_horovod_parity(launcher: str) -> None:
    """Every check passes on both ranks (each rank compares against torch arithmetic on all inputs)."""
    result = launch(launcher, 2, "horovod_parity.py", timeout=120)
    output = unglue(result.stdout, "PASS ", "FAIL ")
    tail = output[-6000:]
    assert "FAIL" not in output, tail
    assert result.returncode == 0, tail
    assert sorted(re.findall(r"^PASS ([\w-]+)", output, re.MULTILINE)) == sorted(CHECKS * 2), tail
