"""horovod.common.util's helpers as commsched._horovod_util gives them: one process, no ranks."""

from __future__ import annotations

import importlib.util

import pytest

from commsched import _horovod_util as util


def test_split_list_cuts_into_near_equal_consecutive_parts() -> None:
    """Lengths differ by at most one, the longer parts first, and the parts join back in order."""
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert util.split_list([1, 2], 4) == [[1], [2], [], []]
    for length in range(12):
        for parts in range(1, 6):
            pieces = util.split_list(list(range(length)), parts)
            assert len(pieces) == parts and [v for piece in pieces for v in piece] == list(range(length))
            sizes = [len(piece) for piece in pieces]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_cache_computes_once_per_arguments() -> None:
    """A cached function's first answer stands, per distinct arguments."""
    state = {"calls": 0}

    @util._cache
    def counted(value: int) -> int:
        state["calls"] += 1
        return value * 10 + state["calls"]

    assert [counted(1), counted(1), counted(2), counted(1)] == [11, 11, 22, 11]
    assert state["calls"] == 2


def test_build_questions_answer_for_commsched() -> None:
    """Extensions and GPUs are reported as they are here; a missing extension raises ImportError by name."""
    import commsched

    assert util.mpi_built() == bool(commsched.mpi_built())
    assert util.gloo_built() == bool(commsched.gloo_built())
    assert util.extension_available("mxnet") is False
    has_torch = importlib.util.find_spec("torch") is not None
    assert util.extension_available("torch") == has_torch
    if has_torch:
        import torch

        assert util.gpu_available("torch") == torch.cuda.is_available()
        util.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", "horovod/torch", "mpi_lib_v2")
    assert util.gpu_available("mxnet") is False
    with pytest.raises(ImportError, match="horovod.mxnet: commsched's mxnet plug-in does not load"):
        util.check_extension("horovod.mxnet", "HOROVOD_WITH_MXNET", "horovod/mxnet", "mpi_lib")


def test_small_predicates() -> None:
    """is_iterable and num_rank_is_power_2 as Horovod's."""
    assert util.is_iterable([1]) and util.is_iterable("ab") and not util.is_iterable(3)
    assert [n for n in range(10) if util.num_rank_is_power_2(n)] == [1, 2, 4, 8]
