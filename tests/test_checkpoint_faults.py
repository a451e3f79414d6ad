"""Checkpointer faults in one process: saves from several threads at once, a save that fails on a
full disk, and manifests that are damaged, edited or still valid JSON of the wrong shape.

The reference for every state is torch's own state_dict(), kept in memory when the version was
saved; what load() restores is compared with it bit for bit.
"""

from __future__ import annotations

import copy
import errno
import itertools
import json
import math
import random
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import commsched.torch as ct
import commsched.torch.checkpoint_format as fmt


def _build() -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


def _train(model: Any, optimizer: Any, scheduler: Any, iteration: int) -> None:
    generator = torch.Generator().manual_seed(iteration)
    model(torch.randn(5, 4, generator=generator)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _snapshot(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
    }


def _assert_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for index, state in want["optimizer"]["state"].items():
        assert got["optimizer"]["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][index][key], value), (index, key)
    assert got["scheduler"] == want["scheduler"]


class _Loader:
    """Fresh objects and one Checkpointer that loads into them; poisons the model before each load."""

    def __init__(self, directory: Path) -> None:
        self.model, self.optimizer, self.scheduler = _build()
        self.checkpointer = ct.Checkpointer(
            self.model, self.optimizer, directory, lr_scheduler=self.scheduler
        )

    def load(self, step: int | None = None) -> tuple[ct.Restored | None, list[str]]:
        """What load() restored and the warnings it gave."""
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.fill_(7.0)  # nothing of an earlier load may pass for this one
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = self.checkpointer.load(step)
        return restored, [str(w.message) for w in caught]

    def state(self) -> dict[str, Any]:
        """The loaded objects' state, through torch's own state_dict()."""
        return _snapshot(self.model, self.optimizer, self.scheduler)


@pytest.fixture
def two_versions(tmp_path: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    """Versions of steps 0 and 1 (an iteration apart) and the reference state of each."""
    model, optimizer, scheduler = _build()
    checkpointer = ct.Checkpointer(model, optimizer, tmp_path, keep=2, lr_scheduler=scheduler)
    references = {}
    for step in range(2):
        _train(model, optimizer, scheduler, step)
        checkpointer.save(step, extra={"step": step})
        references[step] = _snapshot(model, optimizer, scheduler)
    checkpointer.close()
    return tmp_path, references


def _newest_manifest(directory: Path) -> Path:
    return fmt.versions(directory)[-1].path / fmt.MANIFEST


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# -- saves from several threads ---------------------------------------------------------------
def test_concurrent_saves_are_serialized_and_none_is_lost(tmp_path: Path) -> None:
    """8 threads, 3 saves each: a save returns and its version loads exactly, or its own caller hears why."""
    model, optimizer, scheduler = _build()
    _train(model, optimizer, scheduler, 0)
    reference = _snapshot(model, optimizer, scheduler)
    checkpointer = ct.Checkpointer(model, optimizer, tmp_path, keep=10, lr_scheduler=scheduler)
    steps = itertools.count()
    outcomes: dict[int, BaseException | None] = {}
    start = threading.Barrier(8)

    def saver() -> None:
        start.wait()
        for _ in range(3):
            step = next(steps)
            try:
                checkpointer.save(step, extra={"step": step})
                outcomes[step] = None
            except Exception as error:  # noqa: BLE001 - judged below
                outcomes[step] = error

    threads = [threading.Thread(target=saver) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    checkpointer.close()  # raises if the last save failed
    assert sorted(outcomes) == list(range(24))
    for step, error in outcomes.items():
        # Only a step lower than one already saved may be refused, and only to its own caller.
        assert error is None or (
            isinstance(error, ValueError) and f"save({step}) after save(" in str(error)
        ), (
            step,
            error,
        )
    saved = sorted(step for step, error in outcomes.items() if error is None)
    assert saved and saved[-1] == max(saved)
    kept = saved[-10:]
    assert [v.step for v in fmt.versions(tmp_path)] == kept
    assert all(v.complete for v in fmt.versions(tmp_path))
    assert not [name for name in _files(tmp_path) if name.endswith(".tmp")]
    loader = _Loader(tmp_path)
    for step in kept:
        restored, caught = loader.load(step)
        assert restored is not None and restored.step == step and restored.extra == {"step": step}
        assert caught == []
        _assert_state(loader.state(), reference)


# -- a save that fails ------------------------------------------------------------------------
@pytest.mark.parametrize("failing", ["shard", "manifest"])
def test_failed_save_leaves_no_files_and_the_next_save_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A full disk midway through a write: no temporary file, no half version; reported once, then saves go on."""
    model, optimizer, scheduler = _build()
    checkpointer = ct.Checkpointer(model, optimizer, tmp_path, keep=3, lr_scheduler=scheduler)
    _train(model, optimizer, scheduler, 0)
    checkpointer.save(0)
    checkpointer.wait()
    before = _files(tmp_path)
    real_write = fmt.write_durable

    def full_disk(path: Path, chunks: Any) -> tuple[int, int]:
        if (path.name == fmt.MANIFEST) != (failing == "manifest"):
            return real_write(path, chunks)

        def half() -> Iterator[memoryview]:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                yield view[: len(view) // 2]
                raise OSError(errno.ENOSPC, "No space left on device")

        return real_write(path, half())

    monkeypatch.setattr(fmt, "write_durable", full_disk)
    _train(model, optimizer, scheduler, 1)
    checkpointer.save(1)
    message = r"checkpoint step 1 was not saved: \[Errno 28\] No space left on device"
    with pytest.raises(
        RuntimeError, match=rf"save\(2\) did not start, because the save before it failed: {message}"
    ):
        checkpointer.save(2)
    assert _files(tmp_path) == before
    monkeypatch.undo()
    checkpointer.wait()  # the failure was reported once
    checkpointer.save(3)
    reference = _snapshot(model, optimizer, scheduler)
    checkpointer.close()
    assert [v.step for v in fmt.versions(tmp_path)] == [0, 3]
    loader = _Loader(tmp_path)
    restored, caught = loader.load()
    assert restored is not None and restored.step == 3 and caught == []
    _assert_state(loader.state(), reference)


# -- manifests load() cannot trust ------------------------------------------------------------
def _set_lr(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest["optimizer"]["param_groups"][0]["lr"] = 5.0
    return manifest


def _rename_state(manifest: dict[str, Any]) -> dict[str, Any]:
    key = next(k for k in manifest["tensors"] if k.startswith("optimizer."))
    manifest["tensors"][key + "X"] = manifest["tensors"].pop(key)
    return manifest


def _pieces_elsewhere(manifest: dict[str, Any]) -> dict[str, Any]:
    next(iter(manifest["tensors"].values()))["pieces"][0]["shard"] = 3
    return manifest


def _state_key(manifest: dict[str, Any], suffix: str) -> str:
    return next(k for k in manifest["tensors"] if k.startswith("optimizer.") and k.endswith(suffix))


def _dtype_a_list(manifest: dict[str, Any]) -> dict[str, Any]:
    next(iter(manifest["tensors"].values()))["dtype"] = ["F32"]
    return manifest


def _record_taken_out(manifest: dict[str, Any]) -> dict[str, Any]:
    del manifest["tensors"][_state_key(manifest, ".step")]  # Adam's step would be missing
    return manifest


def _rows_skipped(manifest: dict[str, Any]) -> dict[str, Any]:
    record = manifest["tensors"][_state_key(manifest, ".exp_avg")]
    record["pieces"][-1]["rows"][1] += 1
    return manifest


def _listed_twice(manifest: dict[str, Any]) -> dict[str, Any]:
    params = manifest["optimizer"]["param_groups"][0]["params"]
    params[1] = params[0]
    return manifest


def _betas(value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(manifest: dict[str, Any]) -> dict[str, Any]:
        manifest["optimizer"]["param_groups"][0]["betas"] = value
        return manifest

    return change


# name -> (change, whether a manifest of that shape could pass with a fresh checksum)
CHANGES: dict[str, tuple[Callable[[dict[str, Any]], Any], bool]] = {
    "a list": (lambda m: [], False),
    "shards a number": (lambda m: {**m, "shards": 5}, False),
    "tensors null": (lambda m: {**m, "tensors": None}, False),
    "optimizer values a list": (lambda m: {**m, "optimizer": {**m["optimizer"], "values": []}}, False),
    "shard name outside the folder": (
        lambda m: {**m, "shards": [{**m["shards"][0], "file": "../other.safetensors"}]},
        False,
    ),
    "piece of a shard that is not there": (_pieces_elsewhere, False),
    "step 99": (lambda m: {**m, "step": 99}, False),
    "a tensor's dtype a list": (_dtype_a_list, False),
    "a state tensor's record taken out": (_record_taken_out, False),
    "pieces that miss a row": (_rows_skipped, False),
    "a parameter listed twice": (_listed_twice, False),
    "betas one number": (_betas(0.9), False),
    "a beta Adam refuses": (_betas({"__tuple__": [1.5, 0.999]}), False),
    "no lr_scheduler": (lambda m: {k: v for k, v in m.items() if k != "lr_scheduler"}, False),
    "learning rate 5.0": (_set_lr, True),
    "optimizer state renamed": (_rename_state, True),
}


# Every change with its checksum kept; the malformed ones also as a faulty writer would seal them
# and as a manifest from before checksums would hold them (a well-formed edit without a checksum
# cannot be told, as the guide says).
UNTRUSTED = [(change, "checksum kept") for change in CHANGES] + [
    (change, form)
    for change, (_, plausible) in CHANGES.items()
    for form in ("checksum recomputed", "no checksum")
    if not plausible
]


@pytest.mark.parametrize(("change", "form"), UNTRUSTED)
def test_untrusted_manifest_is_skipped_for_the_previous_version(
    two_versions: tuple[Path, dict[int, dict[str, Any]]], change: str, form: str
) -> None:
    """An edited or malformed manifest never loads and never raises: load() warns and loads the version before."""
    directory, references = two_versions
    path = _newest_manifest(directory)
    manifest = json.loads(path.read_text())
    digest = manifest.pop(fmt.CHECKSUM)
    changed = CHANGES[change][0](manifest)
    if form == "checksum recomputed" and isinstance(changed, dict):
        path.write_bytes(fmt.manifest_bytes(changed))
    else:
        if form == "checksum kept" and isinstance(changed, dict):
            changed[fmt.CHECKSUM] = digest
        path.write_text(json.dumps(changed, indent=1))
    loader = _Loader(directory)
    restored, caught = loader.load()
    assert restored is not None and restored.step == 0 and restored.extra == {"step": 0}
    assert any(f"{path.parent} is skipped" in message for message in caught), caught
    _assert_state(loader.state(), references[0])


def test_manifest_without_checksum_loads_with_a_warning(
    two_versions: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    """A manifest saved before checksums existed loads, saying it is unverified; an intact one loads silently."""
    directory, references = two_versions
    loader = _Loader(directory)
    restored, caught = loader.load()
    assert restored is not None and restored.step == 1 and caught == []
    _assert_state(loader.state(), references[1])
    path = _newest_manifest(directory)
    manifest = json.loads(path.read_text())
    del manifest[fmt.CHECKSUM]
    path.write_text(json.dumps(manifest, indent=1))
    restored, caught = loader.load()
    assert restored is not None and restored.step == 1 and restored.extra == {"step": 1}
    assert len(caught) == 1 and "has no manifest checksum" in caught[0], caught
    _assert_state(loader.state(), references[1])


def test_single_byte_changes_to_a_manifest_never_load_other_state(
    two_versions: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    """150 one-byte changes: load() never raises and restores exactly the state of the step it reports."""
    directory, references = two_versions
    path = _newest_manifest(directory)
    original = path.read_bytes()
    loader = _Loader(directory)
    rng = random.Random(32)
    outcomes = {0: 0, 1: 0}
    for _ in range(150):
        data = bytearray(original)
        position = rng.randrange(len(data))
        data[position] = rng.choice([b for b in range(256) if b != original[position]])
        path.write_bytes(bytes(data))
        restored, caught = loader.load()
        assert restored is not None, position
        if restored.step == 0:
            assert any(f"{path.parent} is skipped" in message for message in caught), (position, caught)
        _assert_state(loader.state(), references[restored.step])
        outcomes[restored.step] += 1
    assert outcomes[0] > 100, outcomes  # only changes of whitespace between tokens leave it intact


def test_another_optimizer_setup_is_refused_before_anything_loads(
    two_versions: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    """Adam's version into SGD, or into Adam with its parameters in two groups: a ValueError naming the
    difference, and model and optimizer left as they were."""
    directory, _ = two_versions
    model, _, _ = _build()
    parameters = list(model.parameters())
    setups = {
        "the optimizer is Adam there, SGD here": torch.optim.SGD(parameters, lr=0.1, momentum=0.9),
        r"parameter groups of \[4\] parameters there, of \[2, 2\] here": torch.optim.Adam(
            [{"params": parameters[:2]}, {"params": parameters[2:], "lr": 0.5}]
        ),
    }
    for words, optimizer in setups.items():
        before = _snapshot(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
        with pytest.raises(ValueError, match=f"saved from another optimizer setup \\({words}\\)"):
            ct.Checkpointer(model, optimizer, directory).load()
        assert all(torch.equal(v, before["model"][k]) for k, v in model.state_dict().items())
        assert optimizer.state_dict() == before["optimizer"]


def test_a_sharded_layout_that_misplaces_a_parameter_is_damaged(tmp_path: Path) -> None:
    """A layout whose members do not have the shapes of the parameters they name cannot be this model's."""
    from commsched.torch.checkpoint_check import check_version
    from commsched.torch.checkpoint_read import Contents

    model, optimizer, _ = _build()
    shapes = [list(p.shape) for p in model.parameters()]
    members = [
        {"index": i, "offset": 0, "numel": math.prod(shape), "start": 0, "shape": shape, "state": True}
        for i, shape in enumerate(shapes)
    ]

    def contents() -> Contents:
        layout = {"ranks": 1, "buckets": [{"group": 0, "padded": 0, "members": members}]}
        groups = optimizer.state_dict()["param_groups"]
        return Contents(0, True, model.state_dict(), {}, groups, None, {}, layout, {}, "Adam")

    check_version(model, optimizer, optimizer, contents(), tmp_path)
    members[0]["shape"], members[2]["shape"] = shapes[2], shapes[0]
    with pytest.raises(fmt.DamagedVersion, match=r"parameter 0 the shape \[3, 8\]; the model's is \[8, 4\]"):
        check_version(model, optimizer, optimizer, contents(), tmp_path)
    members[0]["shape"], members[2]["shape"] = shapes[0], shapes[2]
    members[1]["index"] = 9
    with pytest.raises(
        fmt.DamagedVersion, match="parameter 9 the shape .*; the model's is no such parameter"
    ):
        check_version(model, optimizer, optimizer, contents(), tmp_path)
