"""Reading a checkpoint version back: every shard verified, tensors reassembled, optimizer state rebuilt.

A version saved from an unsharded optimizer holds per-parameter state (``optimizer.<i>.<key>``).
One saved from ``DistributedOptimizer(shard=True)`` holds each rank's flat shard of every bucket's
per-element state (``optimizer.shard.<rank>.<bucket>.<key>``, written by that rank), the members'
per-parameter values (Adam's step) per parameter, and the layout under the manifest's "sharded":
loaded at the same rank count and layout each rank installs its own shard as it is; otherwise the
shards are joined into the plain per-parameter form, which any optimizer (sharded at any rank count,
or not) loads.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commsched.torch import checkpoint_format as fmt

import torch

_SHARD_KEY = re.compile(r"optimizer\.shard\.(\d+)\.(\d+)\.(.+)", re.DOTALL | re.ASCII)


def shard_name(rank: int, size: int) -> str:
    """The file name of one rank's shard of a version."""
    return f"shard-{rank:05d}-of-{size:05d}.safetensors"


def shard_state_key(rank: int, bucket: int, key: str) -> str:
    """The tensor key of one rank's flat shard of a bucket's per-element state `key`."""
    return f"optimizer.shard.{rank}.{bucket}.{key}"


def discard(path: Path) -> None:
    """Removes the folder of a save that failed, unless it holds a complete version."""
    if not (path / fmt.MANIFEST).exists():
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Contents:
    """A version read and verified, in the form load_state_dict() takes."""

    step: int
    verified: bool  # the manifest carries a checksum that matched (False: saved before checksums)
    model: dict[str, torch.Tensor]
    optimizer_state: dict[int, dict[str, Any]]  # sharded: only the per-parameter values (Adam's step)
    param_groups: list[dict[str, Any]]
    lr_scheduler: Any
    extra: dict[str, Any]
    sharded: dict[str, Any] | None = None  # the layout of a sharded optimizer's version
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] | None = None  # (rank, bucket) -> key -> flat
    optimizer_class: str | None = None  # the wrapped optimizer's class name, as saved

    def rank_shard(self, rank: int) -> list[dict[str, torch.Tensor]]:
        """Per bucket, the per-element state tensors `rank` saved."""
        assert self.sharded is not None and self.shards is not None
        return [self.shards.get((rank, k), {}) for k in range(len(self.sharded["buckets"]))]

    def plain_state(self) -> dict[str, Any]:
        """The optimizer state_dict in plain per-parameter form (a sharded version's shards joined)."""
        state = {i: dict(values) for i, values in self.optimizer_state.items()}
        if self.sharded is not None:
            assert self.shards is not None
            ranks = self.sharded["ranks"]
            for k, bucket in enumerate(self.sharded["buckets"]):
                keys = sorted(self.shards.get((0, k), {}))
                for key in keys:
                    flat = torch.cat([self.shards[(r, k)][key] for r in range(ranks)])
                    for member in bucket["members"]:
                        if member["state"]:
                            _place(state.setdefault(member["index"], {}), key, member, flat)
        return {"state": state, "param_groups": self.param_groups}


def _place(into: dict[str, Any], key: str, member: dict[str, Any], flat: torch.Tensor) -> None:
    """Puts a member's elements of a joined flat state into its parameter's tensor (a piece: its part)."""
    values = flat[member["offset"] : member["offset"] + member["numel"]]
    start, shape = member.get("start", 0), member["shape"]
    if start == 0 and member["numel"] == math.prod(shape):
        into[key] = values.reshape(shape).clone()
        return
    whole = into.get(key)
    if whole is None:
        whole = into[key] = values.new_zeros(shape)
    whole.view(-1)[start : start + member["numel"]].copy_(values)


def read_version(version: fmt.Version) -> Contents:
    """Every tensor and value of a version, verified against its manifest; raises DamagedVersion."""
    manifest = fmt.read_manifest(version)
    pieces: dict[str, torch.Tensor] = {}
    try:
        for shard in manifest["shards"]:
            data = fmt.read_verified(version.path / shard["file"], shard["bytes"], shard["crc32"])
            for name, tensor in fmt.shard_tensors(data).items():
                pieces[f"{shard['file']}/{name}"] = tensor
        tensors = {}
        named = set()
        for key, record in manifest["tensors"].items():
            places = [f"{manifest['shards'][p['shard']]['file']}/{p['name']}" for p in record["pieces"]]
            named.update(places)
            parts = [pieces[place] for place in places]
            tensor = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
            if list(tensor.shape) != record["shape"] or fmt.DTYPES[tensor.dtype] != record["dtype"]:
                raise fmt.DamagedVersion(
                    f"'{key}' is a {fmt.DTYPES[tensor.dtype]} tensor of shape {list(tensor.shape)}, the "
                    f"manifest says {record['dtype']} of {record['shape']}"
                )
            tensors[key] = tensor
    except (KeyError, IndexError, ValueError, RuntimeError) as error:  # cat of unlike pieces: RuntimeError
        raise fmt.DamagedVersion(f"its shards do not match the manifest ({error!r})") from None
    unnamed = sorted(set(pieces) - named)
    if unnamed:
        # A tensor record taken out of a manifest: the state would load without it.
        raise fmt.DamagedVersion(f"its shards hold {unnamed[0]!r}, which the manifest does not name")
    optimizer_state: dict[int, dict[str, Any]] = {}
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _SHARD_KEY.fullmatch(key)
        if match:
            shards.setdefault((int(match.group(1)), int(match.group(2))), {})[match.group(3)] = value
        elif key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            optimizer_state.setdefault(int(index), {})[name] = value
    try:
        for index, values in manifest["optimizer"]["values"].items():
            optimizer_state.setdefault(int(index), {}).update(fmt.from_json(values, tensors))
        groups = [fmt.from_json(group) for group in manifest["optimizer"]["param_groups"]]
        scheduler = None if manifest["lr_scheduler"] is None else fmt.from_json(manifest["lr_scheduler"])
        extra = {k: fmt.from_json(v) for k, v in manifest["extra"].items()}
    except (TypeError, ValueError, KeyError) as error:  # a malformed tuple or item list, a tensor not saved
        raise fmt.DamagedVersion(f"its manifest holds a value that cannot be read ({error!r})") from None
    extra.update({k[len("extra.") :]: v for k, v in tensors.items() if k.startswith("extra.")})
    sharded = manifest.get("sharded")
    if sharded is not None:
        _check_shards(sharded, shards, set(optimizer_state))
    return Contents(
        step=manifest["step"],
        verified=fmt.CHECKSUM in manifest,
        model={k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")},
        optimizer_state=optimizer_state,
        param_groups=groups,
        lr_scheduler=scheduler,
        extra=extra,
        sharded=sharded,
        shards=shards if sharded is not None else None,
        optimizer_class=manifest["optimizer"]["class"],
    )


def _check_shards(
    layout: dict[str, Any], shards: dict[tuple[int, int], dict[str, torch.Tensor]], valued: set[int]
) -> None:
    """Raises DamagedVersion unless every rank saved the same keys of every bucket, each of its shard
    length, and the members with state cover every element of each parameter with per-parameter values."""
    ranks = layout["ranks"]
    held: dict[int, int] = {}  # parameter index -> elements of its state the members hold
    elements: dict[int, int] = {}
    for bucket in layout["buckets"]:
        for member in bucket["members"]:
            elements[member["index"]] = math.prod(member["shape"])
            if member["state"]:
                held[member["index"]] = held.get(member["index"], 0) + member["numel"]
    for index in sorted(valued):
        if index not in held:
            raise fmt.DamagedVersion(f"its layout has no place for parameter {index}'s state")
        if held[index] != elements[index]:
            raise fmt.DamagedVersion(f"its layout holds part of parameter {index}'s state")
    for k, bucket in enumerate(layout["buckets"]):
        keys = sorted(shards.get((0, k), {}))
        for r in range(ranks):
            saved = shards.get((r, k), {})
            if sorted(saved) != keys:
                raise fmt.DamagedVersion(
                    f"rank {r}'s shard of bucket {k} holds {sorted(saved)}, rank 0's {keys}"
                )
            for key, tensor in saved.items():
                if list(tensor.shape) != [bucket["padded"] // ranks]:
                    raise fmt.DamagedVersion(
                        f"rank {r}'s shard of bucket {k} '{key}' has shape {list(tensor.shape)}, not "
                        f"[{bucket['padded'] // ranks}]"
                    )
        for member in bucket["members"]:
            # A piece of a parameter cut across buckets ("start"; whole when absent, as before pieces).
            if member.get("start", 0) + member["numel"] > math.prod(member["shape"]):
                raise fmt.DamagedVersion(f"parameter {member['index']} has shape {member['shape']}")
    if any(r >= ranks or k >= len(layout["buckets"]) for r, k in shards):
        raise fmt.DamagedVersion("it holds a shard of a rank or bucket its layout does not have")
