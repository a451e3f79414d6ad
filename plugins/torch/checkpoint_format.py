"""On-disk form of a checkpoint: safetensors shards, a JSON manifest, durable writes.

A version lives in ``<directory>/step-<step>-<run>/``: one ``shard-<r>-of-<n>.safetensors`` per
rank that saved it and ``manifest.json``, written last. Each shard is a plain safetensors file
(8-byte little-endian header length, JSON header, packed bytes), so ``safetensors.safe_open``,
Hugging Face tools or any reader of the format open it; a tensor cut between ranks appears as
``name[a:b]`` (rows a to b). The manifest names every piece, each shard's size and CRC-32, and
holds what is not a tensor (optimizer hyper-parameters, LR scheduler state, extras) as JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "commsched-checkpoint/1"
MANIFEST = "manifest.json"
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


def plan(entries: list[Entry], ranks: int, first: frozenset[str] = frozenset()) -> list[list[Piece]]:
    """Splits the entries between ranks by bytes, in order, cutting big tensors between rows.

    Entries named in `first` (state that may differ between ranks, e.g. batch-norm statistics)
    go whole to rank 0, as torch.save on rank 0 would keep them. Every rank computes the same
    plan from the same entries, so nobody sends it.
    """
    total = sum(e.nbytes for e in entries)
    boundaries = [total * (r + 1) / ranks for r in range(ranks)]
    pieces: list[list[Piece]] = [[] for _ in range(ranks)]
    for entry in entries:
        if entry.key in first:
            pieces[0].append(Piece(entry, 0, entry.rows))
    rank, filled = 0, sum(p.nbytes for p in pieces[0])
    for entry in entries:
        if entry.key in first:
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
def to_json(value: Any, where: str) -> Any:
    """`value` in JSON form; raises TypeError naming `where` for what JSON cannot hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {"__items__": [[to_json(k, where), to_json(v, where)] for k, v in value.items()]}
        return {k: to_json(v, where) for k, v in value.items()}
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which a checkpoint keeps only as a tensor or as JSON "
        "(numbers, strings, lists, tuples, dicts)"
    )


def from_json(value: Any) -> Any:
    """Undoes to_json."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__items__"}:
            return {from_json(k): from_json(v) for k, v in value["__items__"]}
        return {k: from_json(v) for k, v in value.items()}
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


def read_manifest(version: Version) -> dict[str, Any]:
    """The manifest of a version; raises DamagedVersion if missing or unreadable."""
    try:
        manifest = json.loads((version.path / MANIFEST).read_text())
    except FileNotFoundError:
        raise DamagedVersion("it has no manifest (the save did not finish)") from None
    except (OSError, ValueError) as error:
        raise DamagedVersion(f"its manifest cannot be read ({error})") from None
    if manifest.get("format") != FORMAT:
        raise DamagedVersion(f"its manifest is not {FORMAT}")
    return manifest


def remove_version(version: Version) -> None:
    """Deletes a version: the manifest first, so a crash midway leaves it incomplete, never half-valid."""
    try:
        (version.path / MANIFEST).unlink()
        fsync_directory(version.path)
    except FileNotFoundError:
        pass
    shutil.rmtree(version.path, ignore_errors=True)
