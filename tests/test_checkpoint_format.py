"""Checkpoint format pieces in one process: the split between ranks, JSON round trips, settings, durability."""

from __future__ import annotations

import errno
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import importlib

import commsched.torch.checkpoint_format as fmt

config = importlib.import_module("commsched.config")  # commsched.config is also a function


def _entries(seed: int) -> list[fmt.Entry]:
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8]
    shapes = [(), (0,), (7,), (1000, 33), (3, 4, 5), (4096, 64), (1,)]
    return [fmt.Entry(f"t{i}", rng.choice(dtypes), rng.choice(shapes)) for i in range(rng.randint(1, 30))]


@pytest.mark.parametrize("ranks", [1, 2, 3, 7])
@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_every_row_once_and_balances(ranks: int, seed: int) -> None:
    """Every row of every tensor lands on exactly one rank; no rank holds much more than its share."""
    entries = _entries(seed)
    first = frozenset(e.key for e in entries[:2])
    pieces = fmt.plan(entries, ranks, first)
    assert len(pieces) == ranks
    rows: dict[str, list[int]] = {e.key: [0] * e.rows for e in entries}
    for rank, mine in enumerate(pieces):
        for piece in mine:
            if piece.entry.key in first:
                assert rank == 0 and piece.whole
            for row in range(piece.start, piece.stop):
                rows[piece.entry.key][row] += 1
    assert all(count == 1 for counts in rows.values() for count in counts), rows
    total = sum(e.nbytes for e in entries)
    biggest_row = max((e.nbytes // max(e.rows, 1) for e in entries), default=0)
    forced = sum(e.nbytes for e in entries if e.key in first)
    for mine in pieces:
        assert sum(p.nbytes for p in mine) <= max(total / ranks, forced) + biggest_row


def test_arranged_pieces_are_aligned() -> None:
    """Widest dtypes first: every piece starts at a multiple of its element size."""
    entries = _entries(3)
    for piece, offset in fmt.arrange(fmt.plan(entries, 1)[0]):
        assert offset % piece.entry.dtype.itemsize == 0


def test_json_round_trip_keeps_tuples_and_int_keys() -> None:
    """Adam's betas stay a tuple; dicts with non-string keys survive; other objects are refused by name."""
    value = {"betas": (0.9, 0.999), "nested": [1, {"x": None, "y": float("inf")}], "ints": {1: "a"}}
    assert fmt.from_json(fmt.to_json(value, "v")) == value
    with pytest.raises(TypeError, match="lr_scheduler"):
        fmt.to_json({"f": object()}, "lr_scheduler")


def test_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """COMMSCHED_CHECKPOINT_* are read, validated, and a bad value names the variable."""
    env = {"COMMSCHED_CHECKPOINT_DIR": str(tmp_path), "COMMSCHED_CHECKPOINT_KEEP": "5"}
    assert config.checkpoint_settings({}, env) == {"directory": str(tmp_path), "keep": 5}
    assert config.checkpoint_settings({"keep": 1}, env)["keep"] == 1
    with pytest.raises(config.SettingError, match="COMMSCHED_CHECKPOINT_KEEP"):
        config.checkpoint_settings({}, {**env, "COMMSCHED_CHECKPOINT_KEEP": "0"})
    with pytest.raises(config.SettingError, match="COMMSCHED_CHECKPOINT_DIR"):
        config.checkpoint_settings({}, {})


def test_durable_write_and_damage_detection(tmp_path: Path) -> None:
    """write_durable leaves no temporary file; a truncated or flipped file fails its check."""
    size, crc = fmt.write_durable(tmp_path / "f", [b"abc", memoryview(b"defgh")])
    assert (tmp_path / "f").read_bytes() == b"abcdefgh" and size == 8
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
    assert fmt.read_verified(tmp_path / "f", size, crc) == bytearray(b"abcdefgh")
    (tmp_path / "f").write_bytes(b"abcdefgX")
    with pytest.raises(fmt.DamagedVersion, match="CRC-32"):
        fmt.read_verified(tmp_path / "f", size, crc)
    with pytest.raises(fmt.DamagedVersion, match="bytes"):
        fmt.read_verified(tmp_path / "f", size + 1, crc)


def test_failed_durable_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A write that fails midway (a full disk) removes its temporary file; the file it replaces stays."""
    (tmp_path / "f").write_bytes(b"old")

    def full_disk() -> Iterator[bytes]:
        yield b"new bytes, part one"
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        fmt.write_durable(tmp_path / "f", full_disk())
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and (tmp_path / "f").read_bytes() == b"old"


def test_manifest_checksum_covers_every_field_and_nothing_else() -> None:
    """The checksum is sha256 over the canonical JSON of the rest: key order and spacing do not matter."""
    import hashlib
    import json

    manifest = {"format": fmt.FORMAT, "step": 3, "lr": 0.1, "nested": {"b": [1, 2.5], "a": None}}
    canonical = '{"format":"' + fmt.FORMAT + '","lr":0.1,"nested":{"a":null,"b":[1,2.5]},"step":3}'
    assert fmt.manifest_digest(manifest) == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    sealed = json.loads(fmt.manifest_bytes(manifest))
    assert sealed[fmt.CHECKSUM] == fmt.manifest_digest(sealed)
    assert fmt.manifest_digest(dict(reversed(list(sealed.items())))) == sealed[fmt.CHECKSUM]
    assert fmt.manifest_digest({**sealed, "step": 4}) != sealed[fmt.CHECKSUM]


def test_single_process_save_load_round_trip(tmp_path: Path) -> None:
    """Without commsched running: a plain optimizer, a scheduler and tensor extras round-trip exactly."""
    import commsched.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    checkpointer = ct.Checkpointer(model, optimizer, tmp_path, keep=1, lr_scheduler=scheduler)
    for step in range(3):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        rng = torch.get_rng_state()
        checkpointer.save(step, extra={"rng": rng, "step": step})
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_optimizer = optimizer.state_dict()
        model(torch.randn(5, 4)).sum().backward()  # the next forward and backward run while it saves
    checkpointer.close()
    assert [v.step for v in fmt.versions(tmp_path)] == [2]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1.0)
    restored = ct.Checkpointer(fresh, fresh_optimizer, tmp_path).load()
    assert restored is not None and restored.step == 2 and restored.extra["step"] == 2
    assert torch.equal(restored.extra["rng"], rng)
    for key, value in expected.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    got = fresh_optimizer.state_dict()
    assert got["param_groups"] == expected_optimizer["param_groups"]
    for index, state in expected_optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_plan_puts_fixed_entries_whole_on_their_rank() -> None:
    """A sharded optimizer's state goes whole to the rank that holds it; the rest is still split once."""
    entries = _entries(4) + [fmt.Entry(f"s{r}", torch.float32, (1000,)) for r in range(3)]
    fixed = {f"s{r}": r for r in range(3)}
    pieces = fmt.plan(entries, 3, frozenset(), fixed)
    rows: dict[str, int] = {e.key: 0 for e in entries}
    for rank, mine in enumerate(pieces):
        for piece in mine:
            rows[piece.entry.key] += piece.stop - piece.start
            if piece.entry.key in fixed:
                assert piece.whole and fixed[piece.entry.key] == rank
    assert rows == {e.key: e.rows for e in entries}


def _sharded_manifest(padded: int) -> dict[str, object]:
    member = {"index": 0, "offset": 0, "numel": 6, "shape": [2, 3], "state": True}
    return {
        "format": fmt.FORMAT,
        "step": 1,
        "run": "00000000000000ab",
        "ranks": 2,
        "optimizer": {"class": "Adam", "param_groups": [{"params": [0]}], "values": {}},
        "lr_scheduler": None,
        "extra": {},
        "shards": [{"file": f"shard-0000{r}-of-00002.safetensors", "bytes": 0, "crc32": 0} for r in range(2)],
        "tensors": {},
        "sharded": {"ranks": 2, "buckets": [{"group": 0, "padded": padded, "members": [member]}]},
    }


def test_manifest_layout_of_a_sharded_optimizer_is_checked(tmp_path: Path) -> None:
    """The "sharded" field is part of the schema: a bucket not cut evenly between the ranks is refused."""
    folder = tmp_path / fmt.version_name(1, 0xAB)
    folder.mkdir()
    version = fmt.Version(1, folder)
    (folder / fmt.MANIFEST).write_bytes(fmt.manifest_bytes(_sharded_manifest(6)))
    assert fmt.read_manifest(version)["sharded"]["ranks"] == 2
    (folder / fmt.MANIFEST).write_bytes(fmt.manifest_bytes(_sharded_manifest(7)))
    with pytest.raises(fmt.DamagedVersion, match=r"sharded.buckets\[0\].padded is 7"):
        fmt.read_manifest(version)


def test_lbfgs_state_with_tensors_inside_lists_round_trips(tmp_path: Path) -> None:
    """LBFGS keeps its history as lists of tensors: they are saved beside the JSON and come back as
    the same lists, so the next step after a load equals the next step without one."""
    import commsched.torch as ct

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.LBFGS(model.parameters(), history_size=4, line_search_fn="strong_wolfe")

    x = torch.randn(8, 3)

    def closure(model: Any, optimizer: Any) -> Any:
        optimizer.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    model, optimizer = build()
    checkpointer = ct.Checkpointer(model, optimizer, tmp_path)
    for step in range(3):
        optimizer.step(lambda: closure(model, optimizer))
        checkpointer.save(step)
    checkpointer.close()
    assert len(optimizer.state[next(model.parameters())]["old_dirs"]) > 1
    fresh, fresh_optimizer = build()
    restored = ct.Checkpointer(fresh, fresh_optimizer, tmp_path).load()
    assert restored is not None and restored.step == 2
    saved, loaded = optimizer.state_dict()["state"][0], fresh_optimizer.state_dict()["state"][0]
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        if isinstance(value, list):
            assert len(loaded[key]) == len(value) and all(
                torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                for a, b in zip(loaded[key], value)
            ), key
        else:
            assert (
                torch.equal(loaded[key], value) if isinstance(value, torch.Tensor) else loaded[key] == value
            )
    optimizer.step(lambda: closure(model, optimizer))
    fresh_optimizer.step(lambda: closure(fresh, fresh_optimizer))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
