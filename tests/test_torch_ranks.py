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


def _check_buckets(result: object, ranks: int, cases: int) -> None:
    output = result.stdout  # type: ignore[attr-defined]
    assert result.returncode == 0, output[-4000:]  # type: ignore[attr-defined]
    passes = re.findall(r"PASS (\S+)", unglue(output, "PASS ", "FAIL "))
    assert len(passes) == ranks * cases * 2, output[-4000:]  # barrier and overlap


@needs_mpi
def test_mpiexec_buckets_follow_layout_changes() -> None:
    """Buckets against one process on the whole batch: a layer unfrozen and one frozen mid-training,
    many small buckets, buckets off, and a sparse embedding with two passes per step."""
    _check_buckets(launch("mpiexec", 2, "bucket_cases.py", timeout=120), ranks=2, cases=5)


@needs_mpi
def test_mpiexec_three_ranks_buckets_on_a_slow_fake_gpu(
    fake_nccl: tuple[Path, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path at three ranks (fake NCCL summing across processes) with every stream operation
    2 ms late: buckets, layout changes and both modes still give the one-process weights."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    monkeypatch.setenv("FAKE_CUDA_DELAY_US", "2000")
    library = str(fake_nccl[0])
    cases = "unfreeze,freeze,small,off"
    result = launch("mpiexec", 3, "bucket_cases.py", "--fake-gpu", library, "--cases", cases, timeout=180)
    _check_buckets(result, ranks=3, cases=4)
