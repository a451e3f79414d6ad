"""A rank joining a running DistributedOptimizer(shard=True) job: commsched-run --max-np with the
discovery script grows 2 ranks to 3 at a commit; the joiner gets the committed state from rank 0,
every rank lays the buckets out and cuts the state at 3 ranks, and the job ends at the parameters of
a 3-rank run from that commit, every sample seen once per epoch. Without model= the joiner lays its
buckets out at its first gradient, as the others do after the state sync, instead of as it is built
(a collective the others, waiting in the sync, would never join)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_elastic import check_grown, grow_2_to_3, launch, results

GLOO = {"COMMSCHED_TRANSPORT": "gloo"}


def grow(tmp_path: Path, shard: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The growth of tests/test_elastic.py with ELASTIC_SHARD=`shard`; its final and restored state."""
    final, restored = check_grown(*grow_2_to_3(tmp_path, ELASTIC_SHARD=shard))
    assert "shard" not in restored["optimizer"]  # the plain form, cut again at 3 ranks
    return final, restored


@pytest.fixture(scope="module")
def with_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The growth with DistributedOptimizer(shard=True, model=model)."""
    return grow(tmp_path_factory.mktemp("with-model"), "model")


def test_grow_with_model_equals_a_3_rank_run_from_the_commit(
    with_model: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """The 3 ranks end at the parameters of a 3-rank shard=True run from the commit the 2 restored."""
    final, restored = with_model
    torch.save(restored, tmp_path / "restored.pt")
    assert torch.count_nonzero(restored["optimizer"]["state"][0]["momentum_buffer"]) > 0
    reference = launch(
        tmp_path / "reference",
        "-n",
        "3",
        ELASTIC_START=str(tmp_path / "restored.pt"),
        ELASTIC_SHARD="model",
        **GLOO,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = results(tmp_path / "reference")
    assert torch.count_nonzero(expected["weight"]) > 0
    assert torch.equal(final["weight"], expected["weight"])
    assert final["seen"] == expected["seen"]


def test_grow_without_model_lays_out_after_the_sync(
    with_model: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """Without model= the joiner does not wait in a layout of its own: the job grows at the same commit
    and ends where the run with model= ends (the layout order does not change these exact sums)."""
    final, restored = grow(tmp_path, "1")
    expected_final, expected_restored = with_model
    assert torch.equal(restored["model"]["weight"], expected_restored["model"]["weight"])
    assert torch.equal(
        restored["optimizer"]["state"][0]["momentum_buffer"],
        expected_restored["optimizer"]["state"][0]["momentum_buffer"],
    )
    assert torch.equal(final["weight"], expected_final["weight"])
    assert final["seen"] == expected_final["seen"]
