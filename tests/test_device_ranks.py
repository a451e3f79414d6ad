"""GPU tensors through the core and the native NCCL transport at 2 and 3 real ranks, over the fake
CUDA/NCCL library (tests/fake_cuda): stream work runs asynchronously there and NCCL reduces across
the ranks, so exact results prove the ordering (events, in-stream fusion copies), not just the calls."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from mpirun import run_ranks

pytest.importorskip("mpi4py")


@pytest.mark.parametrize("ranks", [2, 3])
def test_device_collectives_are_exact(ranks: int, fake_nccl: tuple[Path, ctypes.CDLL]) -> None:
    """Both policies, partitioned and fused, average and broadcast, and a producer that writes late on a
    side stream: every rank's every tensor equals the numpy reference. A tensor the transport refuses on
    one rank fails on every rank at once."""
    library = str(fake_nccl[0])
    # One GPU per rank, as NCCL wants: the fake shows as many devices as asked.
    env = {"COMMSCHED_NCCL_LIBRARY": library, "COMMSCHED_CUDART_LIBRARY": library, "FAKE_CUDA_DEVICES": "4"}
    result = run_ranks(ranks, "device_collectives.py", timeout=180, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stdout.count("DEVICE ALL OK") == ranks, output
    assert result.stdout.count("DEVICE OK late-producer") == ranks, output
    assert result.stdout.count("DEVICE OK refusal") == ranks, output
    assert result.stdout.count("DEVICE OK reductions") == ranks, output
    assert result.stdout.count("DEVICE OK output-collectives") == ranks, output


def test_cuda_aware_mpi_takes_device_buffers(fake_nccl: tuple[Path, ctypes.CDLL], tmp_path: Path) -> None:
    """An MPI library that reports CUDA support (here through MPIX_Query_cuda_support interposed by the
    fake) reduces GPU tensors directly: exact results, fused and partitioned, and a late producer waited for."""
    import fake_cuda

    mpix = fake_cuda.build_mpix(tmp_path)
    assert mpix is not None
    library = str(fake_nccl[0])
    env = {
        "COMMSCHED_CUDART_LIBRARY": library,
        "LD_PRELOAD": str(mpix),
        "FAKE_MPIX_CUDA": "1",
        "FAKE_CUDA_DEVICES": "4",
    }
    result = run_ranks(2, "device_collectives.py", "--transport", "mpi", timeout=180, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stdout.count("DEVICE ALL OK") == 2, output


def test_mpi_without_cuda_support_refuses_device_buffers(fake_nccl: tuple[Path, ctypes.CDLL]) -> None:
    """An MPI library that does not report CUDA support: init(device="cuda") over MPI fails at once on
    every rank, saying to use the NCCL transport."""
    library = str(fake_nccl[0])
    env = {"COMMSCHED_CUDART_LIBRARY": library, "FAKE_CUDA_DEVICES": "4"}
    result = run_ranks(2, "device_collectives.py", "--transport", "mpi", timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "does not report CUDA support" in output and "COMMSCHED_TRANSPORT=nccl" in output, output
