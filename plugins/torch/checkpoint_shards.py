"""What a checkpoint holds of DistributedOptimizer(shard=True): each rank's own shard, nothing gathered.

Every rank saves the flat per-element state of its shard of every bucket (momentum, Adam's moments)
into its own safetensors file; each parameter's per-parameter values (Adam's step) go to rank 0's
file (tensors) or the manifest (numbers), by parameter index as an unsharded optimizer's would; the
manifest's "sharded" field records the layout (rank count, buckets, members). Every rank can list
every rank's entries, since all ranks hold the same keys, dtypes and shard lengths, so the plan of
who writes what is computed, not sent.
"""

from __future__ import annotations

from typing import Any

from commsched.torch import checkpoint_format as fmt
from commsched.torch.checkpoint_read import Contents, shard_state_key

import torch

Source = tuple[Any, Any]  # (owner parameter or None, a function returning the tensor to copy)


def is_sharded(optimizer: Any) -> bool:
    """True for DistributedOptimizer(shard=True)."""
    return bool(getattr(optimizer, "sharded", False))


def own_shards(optimizer: Any, layout: dict[str, Any]) -> list[tuple[int, str, Any, torch.Tensor]]:
    """This rank's per-element state tensors, each as (bucket, key, owner, tensor): the owner is the
    parameter whose update hook comes before the bucket's next update, so a capture copies it then."""
    params = optimizer.plain_parameters()
    found = []
    for k, (bucket, keyed) in enumerate(zip(layout["buckets"], optimizer.shard_tensors())):
        owner = params[bucket["members"][0]["index"]]
        found += [(k, key, owner, value) for key, value in keyed.items()]
    return found


def entries(
    optimizer: Any, layout: dict[str, Any], rank: int, size: int
) -> tuple[list[fmt.Entry], dict[str, Source], dict[str, int], dict[str, Any]]:
    """The optimizer's entries of a version: (entries, this rank's sources, the rank each shard entry
    goes to, the per-parameter values that are not tensors, for the manifest)."""
    found: list[fmt.Entry] = []
    sources: dict[str, Source] = {}
    fixed: dict[str, int] = {}
    own = own_shards(optimizer, layout)
    for r in range(size):
        for k, key, owner, value in own:
            name = shard_state_key(r, k, key)
            found.append(fmt.Entry(name, value.dtype, tuple(value.shape)))
            fixed[name] = r
            if r == rank:
                sources[name] = (owner, lambda v=value: v)
    values: dict[str, Any] = {}
    for index, record in sorted(optimizer.member_values().items()):
        numbers = {}
        for name, value in record.items():
            if isinstance(value, torch.Tensor):
                key = f"optimizer.{index}.{name}"
                found.append(fmt.Entry(key, value.dtype, tuple(value.shape)))
                sources[key] = (None, lambda v=value: v)  # small: copied inside save()
            else:
                numbers[name] = value
        if numbers:
            values[str(index)] = fmt.to_json(numbers, f"optimizer state of parameter {index}")
    return found, sources, fixed, values


def restore(optimizer: Any, contents: Contents, rank: int) -> None:
    """Loads a version's optimizer state: this rank's own shard as it is when the layout matches."""
    if (
        contents.sharded is not None
        and is_sharded(optimizer)
        and optimizer.load_shards(
            contents.sharded, contents.rank_shard(rank), contents.optimizer_state, contents.plain_state
        )
    ):
        for group, saved in zip(optimizer.param_groups, contents.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    optimizer.load_state_dict(contents.plain_state())
