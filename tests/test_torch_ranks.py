"""N ranks of the torch plug-in end with the weights of one process trained on the whole batch.

Covers SGD (momentum, nesterov, weight decay) and AdamW, barrier and overlap modes,
priority and fifo policies, under mpiexec (MPI) and torchrun (Gloo); a model with a
frozen layer, an unused layer and a layer skipped by some ranks on some iterations.
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


def _check(result: object, ranks: int, configs: int, broadcast: bool = False) -> None:
    output = result.stdout  # type: ignore[attr-defined]
    assert result.returncode == 0, output[-4000:]  # type: ignore[attr-defined]
    assert "FAIL" not in output, output[-4000:]
    passes = re.findall(r"PASS (\S+)", unglue(output, "PASS ", "FAIL "))
    assert len([p for p in passes if p != "broadcast"]) == ranks * configs, output[-4000:]
    if broadcast:
        assert passes.count("broadcast") == ranks, output[-4000:]


@needs_mpi
def test_mpiexec_two_ranks_all_modes_and_extras() -> None:
    """Under mpiexec: 8 policy/optimizer/mode combinations, accumulation, clipping, compression, broadcast."""
    _check(
        launch("mpiexec", 2, "equivalence.py", "--extras", "--broadcast"), ranks=2, configs=13, broadcast=True
    )


@needs_mpi
def test_mpiexec_three_ranks() -> None:
    """Three ranks (an odd count, so averaging is not a power-of-two division)."""
    _check(launch("mpiexec", 3, "equivalence.py", "--optimizers", "sgd,adamw"), ranks=3, configs=8)


@needs_mpi
def test_mpiexec_two_ranks_cuda_path_over_the_fake_nccl(fake_nccl: tuple[Path, object]) -> None:
    """The CUDA path (CUDA parameters, commsched's NCCL transport, device fusion) on the fake library,
    whose NCCL sums across the two processes: every mode, accumulation, clipping and compression."""
    library = str(fake_nccl[0])
    _check(launch("mpiexec", 2, "equivalence.py", "--extras", "--fake-gpu", library), ranks=2, configs=13)


def test_torchrun_gloo_two_ranks() -> None:
    """Under torchrun: the Gloo transport, no MPI involved."""
    _check(launch("torchrun", 2, "equivalence.py", "--broadcast"), ranks=2, configs=8, broadcast=True)
