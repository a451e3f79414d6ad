"""Checkpointer faults in one process: saves from several threads at once, a save that fails on a
full disk.

The reference for every state is torch's own state_dict(), kept in memory when the version was
saved; what load() restores is compared with it bit for bit.
"""

from __future__ import annotations

import copy
import errno
import itertools
import threading
import warnings
from collections.abc import Iterator
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
