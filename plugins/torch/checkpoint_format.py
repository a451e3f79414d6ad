"""On-disk form of a checkpoint: safetensors shards, a JSON manifest, durable writes.

A version lives in ``<directory>/step-<step>-<run>/``: one ``shard-<r>-of-<n>.safetensors`` per
rank that saved it and ``manifest.json``, written last. Each shard is a plain safetensors file
(8-byte little-endian header length, JSON header, packed bytes), so ``safetensors.safe_open``,
Hugging Face tools or any reader of the format open it; a tensor cut between ranks appears as
``name[a:b]`` (rows a to b). The manifest names every piece, each shard's size and CRC-32, and
holds what is not a tensor (optimizer hyper-parameters, LR scheduler state, extras) as JSON; a
tensor inside such a value (LBFGS's history lists) is stored as ``nested.<index>.<n>`` and named
in the JSON by ``{"__tensor__": key}``. Its ``checksum`` field, computed last, is the sha256 of the
rest in canonical JSON, so a manifest changed after the save (a flipped byte, an edited step or
learning rate) is never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "commsched-checkpoint/1"
MANIFEST = "manifest.json"
CHECKSUM = "checksum"  # the manifest's own field: sha256 over the rest, computed last
# What a manifest written before CHECKSUM held, exactly; one without a checksum has these keys or is refused.
_UNSEALED_KEYS = frozenset(
    {"format", "step", "run", "ranks", "optimizer", "lr_scheduler", "extra", "shards", "tensors"}
)
_SHARD_NAME = re.compile(r"shard-\d+-of-\d+\.safetensors")  # a plain name: nothing outside the folder is read
_TENSOR_KEY = re.compile(
    r"model\..+|optimizer\.\d+\..+|optimizer\.shard\.\d+\.\d+\..+|nested\.\d+\.\d+|extra\..+",
    re.DOTALL | re.ASCII,
)
_PARAMETER_STATE_KEY = re.compile(r"optimizer\.\d+\..+", re.DOTALL | re.ASCII)
_WRITE_CHUNK = 8 * 1024 * 1024
_VERSION_NAME = re.compile(r"step-(\d+)-([0-9a-f]+)")
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
_FROM_NAME = {name: dtype for dtype, name in DTYPES.items()}


class DamagedVersion(Exception):
    """A version whose manifest or shards are missing, truncated or fail their checksum."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the saved state: its key, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def rows(self) -> int:
        """Rows along dim 0 (a scalar counts as one row)."""
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one entry, stored in one rank's shard; whole=True for the full tensor."""

    entry: Entry
    start: int
    stop: int

    @property
    def whole(self) -> bool:
        """True when the piece is the entire tensor."""
        return self.start == 0 and self.stop == self.entry.rows

    @property
    def name(self) -> str:
        """The tensor's name inside the shard."""
        return self.entry.key if self.whole else f"{self.entry.key}[{self.start}:{self.stop}]"

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece."""
        return self.entry.shape if self.whole else (self.stop - self.start, *self.entry.shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes of the piece."""
        return math.prod(self.shape) * self.entry.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a dtype; raises TypeError naming the dtypes it takes."""
    if dtype not in DTYPES:
        raise TypeError(f"checkpoints hold {', '.join(map(str, DTYPES))} tensors, not {dtype}")
    return DTYPES[dtype]


def plan(
    entries: list[Entry], ranks: int, first: frozenset[str] = frozenset(), fixed: dict[str, int] | None = None
) -> list[list[Piece]]:
    """Splits the entries between ranks by bytes, in order, cutting big tensors between rows.

    Entries named in `first` (state that may differ between ranks, e.g. batch-norm statistics)
    go whole to rank 0, as torch.save on rank 0 would keep them; those in `fixed` go whole to the
    rank it names (a sharded optimizer's state, which only that rank holds). Every rank computes
    the same plan from the same entries, so nobody sends it.
    """
    placed = {key: 0 for key in first} | dict(fixed or {})
    total = sum(e.nbytes for e in entries)
    boundaries = [total * (r + 1) / ranks for r in range(ranks)]
    pieces: list[list[Piece]] = [[] for _ in range(ranks)]
    for entry in entries:
        if entry.key in placed:
            pieces[placed[entry.key]].append(Piece(entry, 0, entry.rows))
    held = [sum(p.nbytes for p in pieces[r]) for r in range(ranks)]
    rank, filled = 0, held[0]
    for entry in entries:
        if entry.key in placed:
            continue
        rows, start = entry.rows, 0
        row_bytes = entry.nbytes // rows if rows else 0
        if rows == 0 or row_bytes == 0:
            pieces[rank].append(Piece(entry, 0, rows))
            continue
        while start < rows:
            if rank == ranks - 1:
                take = rows - start
            else:
                take = min(rows - start, max(0, round((boundaries[rank] - filled) / row_bytes)))
            if take:
                pieces[rank].append(Piece(entry, start, start + take))
                filled += take * row_bytes
                start += take
            if rank < ranks - 1 and (start < rows or filled >= boundaries[rank]):
                rank += 1
                filled += held[rank]
    return pieces


def arrange(pieces: list[Piece]) -> list[tuple[Piece, int]]:
    """Pieces with their byte offsets in a shard: widest dtypes first, so every piece is aligned."""
    ordered = sorted(pieces, key=lambda p: -p.entry.dtype.itemsize)
    placed, offset = [], 0
    for piece in ordered:
        placed.append((piece, offset))
        offset += piece.nbytes
    return placed


def shard_header(placed: list[tuple[Piece, int]], metadata: dict[str, str]) -> bytes:
    """The safetensors header (length prefix and JSON, padded to 8 bytes) for arranged pieces."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for piece, offset in placed:
        header[piece.name] = {
            "dtype": dtype_name(piece.entry.dtype),
            "shape": list(piece.shape),
            "data_offsets": [offset, offset + piece.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def fsync_directory(path: Path) -> None:
    """Makes a rename or removal inside `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_durable(path: Path, chunks: Iterable[bytes | memoryview]) -> tuple[int, int]:
    """Writes to a temporary name, fsyncs, renames onto `path`, fsyncs the folder; returns (bytes, crc32)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    crc, size = 0, 0
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for begin in range(0, len(view), _WRITE_CHUNK):
                    part = view[begin : begin + _WRITE_CHUNK]
                    crc = zlib.crc32(part, crc)  # releases the GIL on big buffers, like os.write
                    while part:
                        part = part[os.write(descriptor, part) :]
                size += len(view)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        # A failed write (a full disk) leaves no partial temporary file behind to fill it further.
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_directory(path.parent)
    return size, crc


def read_verified(path: Path, size: int, crc: int) -> bytearray:
    """The file's bytes, checked against the manifest's size and CRC-32; raises DamagedVersion."""
    try:
        with open(path, "rb") as file:
            data = bytearray(file.read())
    except OSError as error:
        raise DamagedVersion(f"shard {path.name} cannot be read ({error.strerror})") from None
    if len(data) != size:
        raise DamagedVersion(f"shard {path.name} has {len(data)} bytes, the manifest says {size}")
    if zlib.crc32(data) != crc:
        raise DamagedVersion(f"shard {path.name} fails its CRC-32 check")
    return data


def shard_tensors(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `data` (views of it, no copy)."""
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(bytes(data[8 : 8 + length]))
    base = 8 + length
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        dtype = _FROM_NAME[spec["dtype"]]
        if end == begin:
            tensors[name] = torch.empty(spec["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=base + begin)
        tensors[name] = raw.view(dtype).reshape(spec["shape"])
    return tensors


# -- JSON for what is not a tensor (tuples survive the round trip: Adam's betas stay a tuple) --
def to_json(value: Any, where: str, tensor_key: Callable[[torch.Tensor], str] | None = None) -> Any:
    """`value` in JSON form; raises TypeError naming `where` for what JSON cannot hold. With
    `tensor_key`, a tensor inside it (LBFGS's history lists) becomes {"__tensor__": tensor_key(t)},
    called in a fixed order, and the tensor is saved beside the JSON under that key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, where, tensor_key) for v in value]}
    if isinstance(value, list):
        return [to_json(v, where, tensor_key) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            pairs = [[to_json(k, where, tensor_key), to_json(v, where, tensor_key)] for k, v in value.items()]
            return {"__items__": pairs}
        return {k: to_json(v, where, tensor_key) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and tensor_key is not None:
        return {"__tensor__": tensor_key(value)}
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which a checkpoint keeps only as a tensor or as JSON "
        "(numbers, strings, lists, tuples, dicts)"
    )


def nested_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside a JSON-like value, in the order to_json meets them."""
    found: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> str:
        found.append(tensor)
        return ""

    to_json(value, "", keep)
    return found


def nested_key(index: int, position: int) -> str:
    """The key of the `position`-th tensor inside parameter `index`'s non-tensor optimizer state."""
    return f"nested.{index}.{position}"


def from_json(value: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Undoes to_json; `tensors` (for optimizer state) gives the tensors its placeholders name (KeyError
    for a missing one)."""
    if isinstance(value, list):
        return [from_json(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v, tensors) for v in value["__tuple__"])
        if set(value) == {"__items__"}:
            return {from_json(k, tensors): from_json(v, tensors) for k, v in value["__items__"]}
        if tensors is not None and set(value) == {"__tensor__"}:  # only where to_json put tensors
            return tensors[value["__tensor__"]]
        return {k: from_json(v, tensors) for k, v in value.items()}
    return value


# -- versions in a directory ----------------------------------------------------------------
def version_name(step: int, run: int) -> str:
    """The folder name of a version."""
    return f"step-{step:010d}-{run:016x}"


@dataclass(frozen=True)
class Version:
    """A version folder: its step, and whether its manifest (written last) exists."""

    step: int
    path: Path

    @property
    def complete(self) -> bool:
        """True once the manifest exists (shards may still be damaged: load verifies them)."""
        return (self.path / MANIFEST).exists()


def versions(directory: Path) -> list[Version]:
    """Version folders in `directory`, oldest step first (same step: older folder first)."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _VERSION_NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), _mtime(path), Version(int(match.group(1)), path)))
    return [version for _, _, version in sorted(found, key=lambda item: (item[0], item[1]))]


def _mtime(path: Path) -> float:
    try:
        return (path / MANIFEST).stat().st_mtime
    except OSError:
        return 0.0


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The manifest's checksum: sha256 of its canonical JSON (sorted keys, no spaces), less the checksum."""
    rest = {key: value for key, value in manifest.items() if key != CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest file's contents: the manifest and, computed over everything else, its checksum."""
    return json.dumps({**manifest, CHECKSUM: manifest_digest(manifest)}, indent=1).encode()


def read_manifest(version: Version) -> dict[str, Any]:
    """The manifest of a version, its checksum and schema verified; raises DamagedVersion otherwise.

    A manifest without a checksum (written before there was one) is returned when it has exactly
    the keys such a manifest had and passes the schema; the caller says it is unverified.
    """
    try:
        manifest = json.loads((version.path / MANIFEST).read_text())
    except FileNotFoundError:
        raise DamagedVersion("it has no manifest (the save did not finish)") from None
    except (OSError, ValueError) as error:
        raise DamagedVersion(f"its manifest cannot be read ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedVersion(f"its manifest is not {FORMAT}")
    if CHECKSUM in manifest:
        if manifest[CHECKSUM] != manifest_digest(manifest):
            raise DamagedVersion("its manifest fails its sha256 checksum (it was changed after the save)")
    elif set(manifest) != _UNSEALED_KEYS:
        # A damaged checksum key must not pass for a manifest from before checksums.
        raise DamagedVersion(f"its manifest has no checksum and keys {sorted(manifest)}")
    try:
        _check_manifest(manifest, version)
    except _Invalid as why:
        raise DamagedVersion(f"its manifest is not valid: {why}") from None
    return manifest


class _Invalid(Exception):
    """A manifest field that does not fit the schema."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Invalid(what)


def _count(value: Any, below: int | None = None) -> bool:
    """True for a plain int >= 0 (and < below)."""
    return type(value) is int and value >= 0 and (below is None or value < below)


def _check_manifest(manifest: dict[str, Any], version: Version) -> None:
    """Raises _Invalid naming the first field that load() could not use as it is."""
    folder = _VERSION_NAME.fullmatch(version.path.name)
    _need(_count(manifest.get("step")), f"step is {manifest.get('step')!r}")
    _need(manifest["step"] == version.step, f"step {manifest['step']} in the folder of step {version.step}")
    run = manifest.get("run")
    _need(
        folder is None or run == folder.group(2),
        f"run {run!r} in the folder of run {folder and folder.group(2)}",
    )
    _need(_count(manifest.get("ranks")) and manifest["ranks"] > 0, f"ranks is {manifest.get('ranks')!r}")
    optimizer = manifest.get("optimizer")
    _need(isinstance(optimizer, dict), "optimizer is not an object")
    _need(isinstance(optimizer.get("class"), str), "optimizer.class is not a string")
    groups = optimizer.get("param_groups")
    _need(isinstance(groups, list), "optimizer.param_groups is not a list")
    for g, group in enumerate(groups):
        _need(isinstance(group, dict), f"optimizer.param_groups[{g}] is not an object")
        params = group.get("params")
        _need(isinstance(params, list) and all(map(_count, params)), f"optimizer.param_groups[{g}].params")
    # load_state_dict() pairs saved indices with parameters by position: an index listed twice
    # would give two parameters one state and another none.
    indices = [index for group in groups for index in group["params"]]
    listed = set(indices)
    _need(len(listed) == len(indices), "optimizer.param_groups list a parameter twice")
    values = optimizer.get("values")
    _need(isinstance(values, dict), "optimizer.values is not an object")
    for index, state in values.items():
        _need(index.isascii() and index.isdigit() and isinstance(state, dict), f"optimizer.values[{index!r}]")
        _need(int(index) in listed, f"optimizer.values[{index!r}] is of a parameter no group lists")
    _need("lr_scheduler" in manifest, "it has no lr_scheduler (null when none was saved)")
    scheduler = manifest["lr_scheduler"]
    _need(scheduler is None or isinstance(scheduler, dict), "lr_scheduler is neither null nor an object")
    _need(isinstance(manifest.get("extra"), dict), "extra is not an object")
    shards = manifest.get("shards")
    _need(
        isinstance(shards, list) and len(shards) == manifest["ranks"],
        f"shards do not list {manifest['ranks']}",
    )
    for r, shard in enumerate(shards):
        _need(isinstance(shard, dict), f"shards[{r}] is not an object")
        name = shard.get("file")
        _need(
            isinstance(name, str) and _SHARD_NAME.fullmatch(name) is not None, f"shards[{r}].file is {name!r}"
        )
        _need(_count(shard.get("bytes")), f"shards[{r}].bytes is {shard.get('bytes')!r}")
        _need(_count(shard.get("crc32"), 2**32), f"shards[{r}].crc32 is {shard.get('crc32')!r}")
    if "sharded" in manifest:
        _check_layout(manifest["sharded"], manifest["ranks"], listed)
    tensors = manifest.get("tensors")
    _need(isinstance(tensors, dict), "tensors is not an object")
    for key, record in tensors.items():
        _need(_TENSOR_KEY.fullmatch(key) is not None, f"tensor key {key!r}")
        _need(
            not key.startswith("optimizer.shard.") or "sharded" in manifest,
            f"tensor {key!r} is a sharded optimizer's, and the manifest has no sharded layout",
        )
        if _PARAMETER_STATE_KEY.fullmatch(key) or key.startswith("nested."):
            index = int(key.split(".", 2)[1])
            _need(index in listed, f"tensor {key!r} is of a parameter no group lists")
        _need(isinstance(record, dict), f"tensors[{key!r}] is not an object")
        dtype = record.get("dtype")
        _need(isinstance(dtype, str) and dtype in _FROM_NAME, f"tensors[{key!r}].dtype is {dtype!r}")
        shape = record.get("shape")
        _need(isinstance(shape, list) and all(map(_count, shape)), f"tensors[{key!r}].shape is {shape!r}")
        pieces = record.get("pieces")
        _need(isinstance(pieces, list) and len(pieces) > 0, f"tensors[{key!r}].pieces is {pieces!r}")
        _check_pieces(key, shape, pieces, len(shards))


def _check_pieces(key: str, shape: list[int], pieces: list[Any], shards: int) -> None:
    """Raises _Invalid unless the pieces follow each other row by row over the whole tensor, each
    named as the save names it (load() joins them in the order listed)."""
    total = shape[0] if shape else 1
    at = 0
    for piece in pieces:
        _need(isinstance(piece, dict), f"a piece of {key!r} is not an object")
        _need(_count(piece.get("shard"), shards), f"a piece of {key!r} names shard {piece.get('shard')!r}")
        rows = piece.get("rows")
        ordered = isinstance(rows, list) and len(rows) == 2 and all(map(_count, rows)) and rows[0] <= rows[1]
        _need(ordered, f"a piece of {key!r} has rows {rows!r}")
        _need(
            rows[0] == at, f"the pieces of {key!r} skip or repeat rows: one has rows {rows}, after row {at}"
        )
        name = key if rows == [0, total] else f"{key}[{rows[0]}:{rows[1]}]"
        _need(
            piece.get("name") == name, f"the piece of {key!r} at rows {rows} is named {piece.get('name')!r}"
        )
        at = rows[1]
    _need(at == total, f"the pieces of {key!r} end at row {at} of its {total}")


def _check_layout(layout: Any, ranks: int, listed: set[int]) -> None:
    """The "sharded" field: a sharded optimizer's rank count and buckets, as load() reads them; every
    member is of a listed parameter, and no two cover the same elements of one."""
    _need(isinstance(layout, dict), "sharded is not an object")
    _need(layout.get("ranks") == ranks, f"sharded.ranks is {layout.get('ranks')!r}, the version has {ranks}")
    buckets = layout.get("buckets")
    _need(isinstance(buckets, list), "sharded.buckets is not a list")
    covered: dict[int, list[tuple[int, int]]] = {}
    for k, bucket in enumerate(buckets):
        _need(isinstance(bucket, dict), f"sharded.buckets[{k}] is not an object")
        padded = bucket.get("padded")
        _need(_count(bucket.get("group")), f"sharded.buckets[{k}].group is {bucket.get('group')!r}")
        _need(_count(padded) and padded % ranks == 0, f"sharded.buckets[{k}].padded is {padded!r}")
        members = bucket.get("members")
        _need(isinstance(members, list), f"sharded.buckets[{k}].members is not a list")
        for member in members:
            where = f"a member of sharded.buckets[{k}]"
            _need(isinstance(member, dict), f"{where} is not an object")
            _need(all(_count(member.get(f)) for f in ("index", "offset", "numel")), f"{where}: {member!r}")
            _need(member["offset"] + member["numel"] <= padded, f"{where} ends past the bucket: {member!r}")
            shape = member.get("shape")
            _need(isinstance(shape, list) and all(map(_count, shape)), f"{where} has shape {shape!r}")
            _need(_count(member.get("start", 0)), f"{where} has start {member.get('start')!r}")
            _need(isinstance(member.get("state"), bool), f"{where} has state {member.get('state')!r}")
            _need(member["index"] in listed, f"{where} is of a parameter no group lists")
            covered.setdefault(member["index"], []).append((member.get("start", 0), member["numel"]))
        _need(
            _disjoint((m["offset"], m["numel"]) for m in members), f"members of sharded.buckets[{k}] overlap"
        )
    for index, spans in covered.items():
        _need(
            _disjoint(spans), f"two members of sharded.buckets cover the same elements of parameter {index}"
        )


def _disjoint(spans: Iterable[tuple[int, int]]) -> bool:
    """True when no two (start, length) spans share an element."""
    at = 0
    for start, length in sorted(spans):
        if start < at:
            return False
        at = start + length
    return True


def remove_version(version: Version) -> None:
    """Deletes a version: the manifest first, so a crash midway leaves it incomplete, never half-valid."""
    try:
        (version.path / MANIFEST).unlink()
        fsync_directory(version.path)
    except FileNotFoundError:
        pass
    shutil.rmtree(version.path, ignore_errors=True)
