"""Checkpointer with DistributedOptimizer(shard=True): each rank writes its own optimizer shard, and a
version loads at the same rank count as saved (nothing cut again) and at another (the shards re-cut).

The rank script (tests/torch_ranks/shard_checkpoint.py) also checks that the sharded Adam keeps each
parameter's own `step`, as a plain torch Adam does, before the save and after each load.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from mpirun import unglue
from torch_launcher import have_mpiexec, launch

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

SCRIPT = "shard_checkpoint.py"


def _run(ranks: int, phase: str, directory: Path) -> str:
    result = launch("mpiexec", ranks, SCRIPT, phase, str(directory), timeout=90)
    text = unglue(result.stdout, "PASS ", "FAIL ")
    assert result.returncode == 0, text[-4000:]
    assert len(re.findall(rf"PASS {phase} ranks={ranks}", text)) == ranks, text[-4000:]
    return text


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Version 4 of a sharded Adam at 2 ranks, and the parameters of the run that went on to 8."""
    root = tmp_path_factory.mktemp("sharded")
    _run(2, "save", root)
    return root


def test_each_rank_writes_its_own_shard_and_the_manifest_records_the_layout(saved: Path) -> None:
    """Each rank's file holds only its own shard of the optimizer state (nothing gathered); the
    manifest names the rank count, every bucket's members (a weight over the bucket limit as pieces
    that cover it once) and each rank's flat pieces."""
    (version,) = [p for p in (saved / "versions").iterdir()]
    manifest = json.loads((version / "manifest.json").read_text())
    layout = manifest["sharded"]
    assert layout["ranks"] == 2 and manifest["ranks"] == 2
    members = [m for bucket in layout["buckets"] for m in bucket["members"]]
    covered: dict[int, list[tuple[int, int]]] = {}
    for m in members:
        covered.setdefault(m["index"], []).append((m["start"], m["numel"]))
    for index, spans in covered.items():  # each parameter whole, or in pieces that cover it once
        shape = next(m["shape"] for m in members if m["index"] == index)
        assert [start for start, _ in spans] == list(itertools.accumulate([0] + [n for _, n in spans[:-1]]))
        assert sum(n for _, n in spans) == math.prod(shape), (index, spans)
    assert max(len(spans) for spans in covered.values()) == 4, covered  # skip.weight: 4 pieces
    assert not all(m["state"] for m in members), "the never-used layer has no state"
    shard_keys = [k for k in manifest["tensors"] if k.startswith("optimizer.shard.")]
    assert shard_keys and {k.split(".")[3] for k in shard_keys} == {
        str(k) for k, bucket in enumerate(layout["buckets"]) if any(m["state"] for m in bucket["members"])
    }
    for key in shard_keys:
        rank = int(key.split(".")[2])
        bucket = layout["buckets"][int(key.split(".")[3])]
        record = manifest["tensors"][key]
        assert record["shape"] == [bucket["padded"] // 2]
        assert [p["shard"] for p in record["pieces"]] == [rank], (key, record["pieces"])
    for rank in (0, 1):
        keys = [k for k in shard_keys if k.split(".")[2] == str(rank)]
        assert {k.split(".", 4)[4] for k in keys} == {"exp_avg", "exp_avg_sq"}, keys


def test_loads_at_the_same_rank_count_as_saved(saved: Path) -> None:
    """At 2 ranks each rank installs its own shard as saved; training on gives exactly the parameters
    of the run that was never interrupted, and the same state as an unsharded Adam loading the version."""
    text = _run(2, "load", saved)
    assert "recut=False" in text


def test_loads_at_three_ranks(saved: Path) -> None:
    """At 3 ranks the shards are joined and cut again; training on matches the unsharded Adam."""
    text = _run(3, "load", saved)
    assert "recut=True" in text


def test_a_damaged_optimizer_shard_or_layout_is_not_trusted(saved: Path, tmp_path: Path) -> None:
    """The CRC of each rank's file and the manifest's checksum cover the optimizer shards and the layout."""
    import shutil

    import commsched.torch.checkpoint_format as fmt
    from commsched.torch.checkpoint_read import read_version

    (original,) = [p for p in (saved / "versions").iterdir()]
    contents = read_version(fmt.Version(4, original))
    assert contents.sharded is not None and contents.shards is not None
    held = [k for k, b in enumerate(contents.sharded["buckets"]) if any(m["state"] for m in b["members"])]
    assert set(contents.shards) == {(r, k) for r in (0, 1) for k in held}  # the never-used layer's: none
    copy = tmp_path / original.name
    shutil.copytree(original, copy)
    data = bytearray((copy / "shard-00001-of-00002.safetensors").read_bytes())
    data[-3] ^= 0x10
    (copy / "shard-00001-of-00002.safetensors").write_bytes(bytes(data))
    with pytest.raises(fmt.DamagedVersion, match="CRC-32"):
        read_version(fmt.Version(4, copy))
    shutil.rmtree(copy)
    shutil.copytree(original, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["sharded"]["buckets"][0]["members"][0]["offset"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(fmt.DamagedVersion, match="checksum"):
        read_version(fmt.Version(4, copy))
    # Sealed again after the change, as a faulty writer would: the layout itself must not fit.
    k = held[0]
    changes = {
        "(no place for|holds part of) parameter": lambda m: m["sharded"]["buckets"][k]["members"].clear(),
        "has no sharded layout": lambda m: m.pop("sharded"),
        rf"members of sharded.buckets\[{k}\] overlap": lambda m: m["sharded"]["buckets"][k]["members"].append(
            dict(m["sharded"]["buckets"][k]["members"][0])
        ),
    }
    for words, change in changes.items():
        manifest = json.loads((original / "manifest.json").read_text())
        del manifest[fmt.CHECKSUM]
        change(manifest)
        (copy / "manifest.json").write_bytes(fmt.manifest_bytes(manifest))
        with pytest.raises(fmt.DamagedVersion, match=words):
            read_version(fmt.Version(4, copy))
