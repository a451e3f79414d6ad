"""hvd.init(process_sets=...) as Horovod 0.28.1's (its test_process_sets_static): duplicates refused
after the others are registered, a repeated init() binds sets by their ranks, and
hvd.global_process_set.ranks is filled while running; 2 ranks under mpiexec."""

from __future__ import annotations

import re

import pytest
from mpirun import mpiexec, run_ranks, unglue

pytest.importorskip("torch")


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_init_process_sets_like_horovod() -> None:
    """Both ranks pass every check of tests/ranks/horovod_init_sets.py."""
    result = run_ranks(2, "horovod_init_sets.py", timeout=90)
    output = unglue(result.stdout + result.stderr, "PASS ")
    assert result.returncode == 0, output[-4000:]
    assert sorted(re.findall(r"^PASS init-sets rank (\d)", output, re.MULTILINE)) == ["0", "1"], output[
        -4000:
    ]


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
def test_process_sets_from_communicators_like_horovod() -> None:
    """Every rank passes every check of tests/ranks/horovod_comm_sets.py (Horovod's multi-comm rules)."""
    result = run_ranks(3, "horovod_comm_sets.py", timeout=90)
    output = unglue(result.stdout + result.stderr, "PASS ")
    assert result.returncode == 0, output[-4000:]
    found = sorted(re.findall(r"^PASS comm-sets rank (\d)", output, re.MULTILINE))
    assert found == ["0", "1", "2"], output[-4000:]
