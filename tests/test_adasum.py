"""op=Adasum: the pairwise combination (numpy, one process) and commsched.torch's allreduce on 2 ranks."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from commsched import adasum

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))


def test_orthogonal_vectors_add_up() -> None:
    """Orthogonal gradients are summed, at every level of the pairing (4 ranks)."""
    vectors = [np.eye(4, dtype=np.float32)[i] * (i + 1) for i in range(4)]
    np.testing.assert_allclose(adasum.combine(vectors), [1, 2, 3, 4])


def test_parallel_vectors_average() -> None:
    """Parallel gradients are averaged (4 ranks, different lengths of one direction)."""
    direction = np.array([0.5, -2.0, 3.0])
    result = adasum.combine([direction * k for k in (1.0, 2.0, 3.0, 6.0)])
    np.testing.assert_allclose(result, direction * 3.0)


def test_pairing_order_is_horovods() -> None:
    """4 ranks combine as (0,1) and (2,3) first, then the two results: checked against the formula."""
    rng = np.random.default_rng(3)
    v = [rng.standard_normal(9) for _ in range(4)]

    def two(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot = a @ b
        return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b

    np.testing.assert_allclose(adasum.combine(v), two(two(v[0], v[1]), two(v[2], v[3])), rtol=1e-12)
    assert not np.allclose(adasum.combine(v), two(two(v[0], v[2]), two(v[1], v[3])))


def test_zero_vector_and_dtype() -> None:
    """A zero gradient leaves the other as it is; the result keeps float16."""
    b = np.array([1.0, 2.0], dtype=np.float16)
    result = adasum.combine([np.zeros(2, dtype=np.float16), b])
    assert result.dtype == np.float16
    np.testing.assert_array_equal(result, b)


def test_refusals_name_the_problem() -> None:
    """Three ranks, integer tensors and unequal lengths are refused with the reason."""
    with pytest.raises(NotImplementedError, match="power-of-two"):
        adasum.combine([np.ones(2)] * 3)
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        adasum.combine([np.ones(2, dtype=np.int32)] * 2)
    with pytest.raises(ValueError, match="same number of elements"):
        adasum.combine([np.ones(2), np.ones(3)])


def test_torch_allreduce_adasum_two_ranks() -> None:
    """allreduce_, allreduce_async (scaled) with op=Adasum on 2 MPI ranks; refusals by name."""
    pytest.importorskip("torch")
    from mpirun import unglue
    from torch_launcher import have_mpiexec, launch

    if not have_mpiexec():
        pytest.skip("needs mpiexec and mpi4py")
    result = launch("mpiexec", 2, "adasum_ranks.py")
    output = unglue(result.stdout, "PASS ", "FAIL ")
    assert "FAIL" not in output and result.returncode == 0, output[-6000:]
    passes = sorted(re.findall(r"^PASS ([\w-]+)", output, re.MULTILINE))
    labels = [
        "adasum-async-scaled",
        "adasum-delta-optimizer",
        "adasum-differentiable",
        "adasum-in-place",
        "adasum-parallel-averages",
        "adasum-refused",
    ]
    assert passes == sorted(labels * 2), output[-6000:]
