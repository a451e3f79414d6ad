"""Checkpointer on real ranks: saving while training changes nothing, a version is the exact state
of its iteration, a job killed at any point of a save resumes from the newest intact version with
the losses of an uninterrupted run, and a version loads at another rank count.

The reference is a run without checkpoints that keeps every iteration's state in memory (through
torch's own state_dict()); checkpoints are compared with it bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from mpirun import unglue
from torch_launcher import have_mpiexec, launch

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

SCRIPT = "checkpoint_train.py"
# history: an optimizer whose state keeps tensors inside lists and dicts (LBFGS, Shampoo-style).
COMBOS = ["sgd-barrier", "sgd-overlap", "adamw-barrier", "adamw-overlap", "history-overlap"]
KILLED = "adamw-overlap"


def _run(ranks: int, *args: str, ok: bool = True) -> str:
    result = launch("mpiexec", ranks, SCRIPT, *args, timeout=120)
    output = unglue(result.stdout, "PASS ")
    if ok:
        assert result.returncode == 0, output[-4000:]
    return output


def _passes(output: str, phase: str) -> list[str]:
    return re.findall(rf"PASS {phase} (\S+)", output)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """References and checkpointed runs of every combination at 2 ranks (versions at 2, 5, 8, 11)."""
    root = tmp_path_factory.mktemp("checkpoints")
    # One launch: every reference first, then the checkpointed runs, which compare with them.
    output = _run(2, "reference,train", "--dir", str(root), "--timeline", str(root / "trace.json"))
    assert sorted(_passes(output, "reference")) == sorted(COMBOS * 2), output[-3000:]
    assert sorted(_passes(output, "train")) == sorted(COMBOS * 2), output[-3000:]
    return root


def test_timeline_has_a_checkpoint_track(trained: Path) -> None:
    """COMMSCHED_TIMELINE shows capture and write of every save on a track named "checkpoint"."""
    text = (trained / "trace.json").read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    tracks = {
        e["tid"] for e in events if e.get("name") == "thread_name" and e["args"]["name"] == "checkpoint"
    }
    assert len(tracks) == 1, "no checkpoint track"
    spans = {e["name"] for e in events if e.get("tid") in tracks and e.get("ph") == "X"}
    for step in (2, 5, 8, 11):
        assert {f"save {step}", f"capture {step}", f"write {step}"} <= spans, sorted(spans)


def test_versions_are_balanced_safetensors_shards(trained: Path) -> None:
    """keep=2 leaves the two newest versions; each rank wrote about half the bytes, in safetensors form."""
    safetensors = pytest.importorskip("safetensors")
    import torch

    for combo in COMBOS:
        versions = sorted(p.name for p in (trained / combo).iterdir())
        assert [v.split("-")[1] for v in versions] == ["0000000008", "0000000011"], versions
        folder = trained / combo / versions[-1]
        manifest = json.loads((folder / "manifest.json").read_text())
        sizes = [shard["bytes"] for shard in manifest["shards"]]
        assert len(sizes) == 2 and abs(sizes[0] - sizes[1]) < 0.02 * sum(sizes), sizes
        pieces: dict[str, list[torch.Tensor]] = {}
        for shard in manifest["shards"]:
            with safetensors.safe_open(str(folder / shard["file"]), framework="pt") as file:
                for name in file.keys():  # noqa: SIM118 - safe_open is not a mapping
                    pieces.setdefault(name.split("[")[0], []).append(file.get_tensor(name))
        for key, record in manifest["tensors"].items():
            parts = pieces[key]
            whole = parts[0] if len(parts) == 1 else torch.cat(parts)
            assert list(whole.shape) == record["shape"], key


def test_resume_same_rank_count(trained: Path) -> None:
    """A new job at 2 ranks loads step 11, equal to the reference, and trains on with its losses."""
    work = trained.parent / "resume2"
    shutil.copytree(trained, work)
    output = _run(2, "resume", "--dir", str(work))
    assert sorted(_passes(output, "resume")) == sorted(COMBOS * 2), output[-3000:]
    assert output.count("step=11") == 2 * len(COMBOS), output[-3000:]


@pytest.mark.parametrize("ranks", [3, pytest.param(1, marks=pytest.mark.full)])
def test_resume_other_rank_count(trained: Path, ranks: int) -> None:
    """A version saved by 2 ranks loads exactly at 3 ranks and at 1; one saved there loads back too."""
    work = trained.parent / f"resume{ranks}"
    shutil.copytree(trained, work)
    combos = "sgd-overlap,adamw-barrier,history-overlap"
    output = _run(ranks, "resume", "--dir", str(work), "--combos", combos)
    assert len(_passes(output, "resume")) == 3 * ranks, output[-3000:]


@pytest.mark.parametrize("damage", ["shard", "manifest"])
def test_damaged_version_is_skipped(trained: Path, damage: str) -> None:
    """A flipped byte in the newest version's shard, or its learning rate edited in the manifest:
    a warning naming it, and the previous version loads."""
    work = trained.parent / f"damaged-{damage}"
    shutil.copytree(trained, work)
    newest = max((work / KILLED).iterdir())
    if damage == "shard":
        shard = newest / "shard-00001-of-00002.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x40
        shard.write_bytes(bytes(data))
    else:
        manifest = json.loads((newest / "manifest.json").read_text())
        manifest["optimizer"]["param_groups"][0]["lr"] = 5.0
        (newest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    output = _run(1, "resume", "--dir", str(work), "--combos", KILLED)
    reason = "CRC-32" if damage == "shard" else "fails its sha256 checksum"
    assert f"{newest} is skipped" in output and reason in output, output[-3000:]
    assert "step=8" in output, output[-3000:]


# point of save(8) -> which ranks die -> step that must load
KILLS = [
    ("disk-full", "1", 11),  # one rank's shard write fails: nobody dies, save(8) fails and leaves nothing
    ("shard-middle", "1", 5),  # one rank's shard torn
    ("shard-renamed", "all", 5),  # every shard durable, no manifest yet: the whole job dies
    ("manifest-middle", "0", 5),  # torn manifest
    ("after-manifest", "0", 8),  # manifest durable: the version counts
    ("removing", "0", 8),  # old version half removed after the new one completed
    ("timer", "all", None),  # a random moment around save(8) (or save(11) after it), whole job
]


def test_kill_while_saving_then_resume(trained: Path) -> None:
    """SIGKILL at each point of save(8) (one rank or the whole job), or a full disk on one rank; a
    2-rank restart resumes exactly."""
    root = trained.parent / "killed"
    root.mkdir()
    shutil.copy(trained / f"{KILLED}.ref", root)
    folders = []
    for point, ranks, _ in KILLS:
        run_dir = root / point
        run_dir.mkdir()
        shutil.copy(trained / f"{KILLED}.ref", run_dir)
        args = ["train", "--dir", str(run_dir), "--combos", KILLED, "--kill", point, "--kill-ranks", ranks]
        if point == "disk-full":
            assert "PASS train" in _run(2, *args)  # every rank heard of the failure and trained on
        else:
            output = _run(2, *args, ok=False)
            assert "PASS train" not in output, f"{point}: the job was not killed\n{output[-3000:]}"
        folders.append(f"{point}/{KILLED}")
    output = _run(2, "resume", "--dir", str(root), "--combos", KILLED, "--resume-dirs", ",".join(folders))
    loaded = re.findall(r"PASS resume \S+ (\S+)/\S+ step=(\d+)", output)
    assert len(loaded) == 2 * len(KILLS), output[-3000:]
    for point, _, expected in KILLS:
        steps = {int(step) for where, step in loaded if where == point}
        assert len(steps) == 1, f"{point}: ranks loaded {steps}"
        assert steps <= ({expected} if expected is not None else {5, 8, 11}), f"{point}: loaded {steps}"
