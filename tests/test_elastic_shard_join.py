"""A rank joining a running DistributedOptimizer(shard=True) job: commsched-run --max-np with the
discovery script grows 2 ranks to 3 at a commit; the joiner gets the committed state from rank 0,
every rank lays the buckets out and cuts the state at 3 ranks, and the job ends at the parameters of
a 3-rank run from that commit, every sample seen once per epoch. Without model= the joiner lays its
buckets out at its first gradient, as the others do after the state sync, instead of as it is built
(a collective the others, waiting in the sync, would never join)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_elastic import FAST_FAILURE, _discovery, assert_every_sample_once, launch, results

GLOO = {"COMMSCHED_TRANSPORT": "gloo"}


def grow(tmp_path: Path, shard: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """2 ranks with ELASTIC_SHARD=`shard`; the script edited to 3 slots in step 2, so a third rank
    joins at that commit."""
    out = tmp_path / f"grown-{shard}"
    script = _discovery(tmp_path, "echo localhost:2")
    done = launch(
        out,
        *("-n", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script)),
        ELASTIC_GROW="0:2:3",  # 36 samples left: 12 per rank, no padding
        ELASTIC_SCRIPT=str(script),
        ELASTIC_SHARD=shard,
        **FAST_FAILURE,
        **GLOO,
    )
    return out, done


def check_grown(out: Path, done: subprocess.CompletedProcess[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job grew to 3 at the step-2 commit and saw every sample once; its final and restored state."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 3 ranks (no rank, numbered as at launch, lost; rank 2 joining)" in done.stderr
    final = results(out)
    assert final["size"] == 3
    assert_every_sample_once(final)
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 2 * 2}  # 3 commits of 2 ranks x 2
    assert "shard" not in restored["optimizer"]  # the plain form, cut again at 3 ranks
    return final, restored


@pytest.fixture(scope="module")
def with_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The growth with DistributedOptimizer(shard=True, model=model)."""
    return check_grown(*grow(tmp_path_factory.mktemp("with-model"), "model"))


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
    final, restored = check_grown(*grow(tmp_path, "1"))
    expected_final, expected_restored = with_model
    assert torch.equal(restored["model"]["weight"], expected_restored["model"]["weight"])
    assert torch.equal(
        restored["optimizer"]["state"][0]["momentum_buffer"],
        expected_restored["optimizer"]["state"][0]["momentum_buffer"],
    )
    assert torch.equal(final["weight"], expected_final["weight"])
    assert final["seen"] == expected_final["seen"]
