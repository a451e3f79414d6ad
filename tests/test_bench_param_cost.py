"""benchmarks/torch_param_cost.py runs every variant in one invocation (a short round at 2 ranks
here, which exercises the same paths as 1; the figures are in docs/measurements.md) and writes what its table shows: the Gloo set
under torchrun-style variables and, where mpiexec and mpi4py are installed, the MPI set under mpiexec."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import full_matrix, mpiexec

pytest.importorskip("torch")
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "torch_param_cost.py"


def test_every_variant_at_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    argv = [
        sys.executable,
        str(SCRIPT),
        "--layers",
        "4",
        "--warmup",
        "2",
        "--windows",
        "2",
        "--steps",
        "3",
        "--ranks",
        "2",
    ]
    # One of each kind of row; the floor is the plug-in's launch without the plug-in, and barrier mode
    # over Gloo is MPI's barrier row under the Gloo set's launch, so the full matrix alone runs them
    # where MPI is there.
    have_mpi = mpiexec() is not None and importlib.util.find_spec("mpi4py") is not None
    variants = ["plain", "ddp", "overlap"] + (["floor"] if full_matrix() else [])
    if full_matrix() or not have_mpi:
        variants.insert(2, "barrier")
    if have_mpi:
        variants += ["mpi_barrier"]
    argv += ["--repeats", "1", "--json", str(out), "--variants", ",".join(variants)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    cells = {(row["ranks"], row["variant"]) for row in report["results"]}
    assert cells == {(r, v) for r in (2,) for v in variants}
    for row in report["results"]:
        assert row["parameters"] == 8 and row["step_seconds"] > 0
        if row["variant"] == "plain":
            assert row["us_per_parameter"] == 0.0
    assert "PyTorch DDP (Gloo)" in result.stdout and "overlap_forward" in result.stdout
    if "mpi_barrier" in variants:
        assert "commsched over MPI, barrier" in result.stdout
