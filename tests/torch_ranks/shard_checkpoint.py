"""Rank script: the sharded optimizer's per-parameter Adam state, and Checkpointer versions of it.

    save DIR   trains Net (a layer no rank runs every 4th iteration, one never used) with Adam, sharded
               and unsharded side by side, for 4 iterations; full_state_dict() must hold the same
               parameters with state and the same per-parameter `step` as the unsharded optimizer (a
               plain torch Adam); then a Checkpointer saves version 4 of the sharded optimizer, training
               goes on to iteration 8 and rank 0 stores the final parameters in DIR/reference.pt
    load DIR   a fresh model and sharded optimizer load version 4 through a Checkpointer before the
               first forward, and next to them an unsharded optimizer loads the same version; both
               train to iteration 8. At the save's rank count the sharded model must end with exactly
               the parameters of the uninterrupted run, its shard installed as saved (nothing cut again);
               at another rank count the shards are cut again and the sharded model must match the
               unsharded one, with equal per-parameter `step`

Both phases cut buckets at 512 bytes, so the weights over it are saved and loaded as pieces across
buckets. Prints "PASS <phase> ..." or "FAIL <phase> ..." per rank.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import commsched.torch as ct
import torch
import torch.nn.functional as F
from torch_common import Net, data, shard, skips

import commsched

SAVED_AT, LAST = 4, 8


def make(params: Any) -> torch.optim.Optimizer:
    """Adam: its per-parameter `step` drives the bias correction, so a wrong count changes the update."""
    return torch.optim.Adam(params, lr=1e-2)


def model() -> torch.nn.Module:
    """Net in float64, so the sharded and unsharded runs can be compared tightly."""
    torch.manual_seed(0)
    return Net().double()


def train(net: torch.nn.Module, optimizer: Any, first: int, last: int) -> None:
    """Iterations [first, last) on this rank's shard of the batch."""
    rank = commsched.rank()
    x, y = data(commsched.size())
    for it in range(first, last):
        optimizer.zero_grad()
        out = net(shard(x[it], rank).double(), skips(rank, it))
        F.cross_entropy(out, shard(y[it], rank)).backward()
        optimizer.step()
    optimizer.synchronize()


def compare_state(full: dict[str, Any], plain: dict[str, Any]) -> tuple[bool, str]:
    """Same parameters with state, same `step` each, moments within float64 noise."""
    if set(full["state"]) != set(plain["state"]):
        return False, f"state of parameters {sorted(full['state'])} vs {sorted(plain['state'])}"
    steps = {i: float(s["step"]) for i, s in full["state"].items()}
    plain_steps = {i: float(s["step"]) for i, s in plain["state"].items()}
    moments = max(
        (full["state"][i][k] - v).abs().max().item()
        for i, s in plain["state"].items()
        for k, v in s.items()
        if k != "step"
    )
    return (
        steps == plain_steps and moments < 1e-12,
        f"steps={steps} plain={plain_steps} moments={moments:.3g}",
    )


def difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest parameter difference."""
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def save(directory: Path) -> bool:
    """Trains sharded and unsharded side by side, checks the state, saves version 4, trains on."""
    net = model()
    plain_net = copy.deepcopy(net)
    sharded = ct.DistributedOptimizer(make(net.parameters()), model=net, shard=True, overlap_forward=True)
    plain = ct.DistributedOptimizer(make(plain_net.parameters()), model=plain_net)
    train(net, sharded, 0, SAVED_AT)
    train(plain_net, plain, 0, SAVED_AT)
    ok, measured = compare_state(sharded.full_state_dict(), plain.state_dict())
    checkpointer = ct.Checkpointer(net, sharded, directory / "versions")
    checkpointer.save(SAVED_AT)
    train(net, sharded, SAVED_AT, LAST)
    checkpointer.close()
    train(plain_net, plain, SAVED_AT, LAST)
    gap = difference(net, plain_net)
    if commsched.rank() == 0:
        torch.save([p.detach().clone() for p in net.parameters()], directory / "reference.pt")
    ok = ok and gap < 1e-12
    print(
        f"{'PASS' if ok else 'FAIL'} save ranks={commsched.size()} {measured} difference={gap:.3g}",
        flush=True,
    )
    return ok


def load(directory: Path) -> bool:
    """Loads version 4 into a sharded and an unsharded optimizer, trains both on, compares."""
    net = model()
    plain_net = copy.deepcopy(net)
    sharded = ct.DistributedOptimizer(make(net.parameters()), model=net, shard=True)
    cuts: list[int] = []
    cut = sharded._cut
    sharded._cut = lambda state: (cuts.append(sum(1 for s in state.values() if s)), cut(state))[1]
    plain = ct.DistributedOptimizer(make(plain_net.parameters()), model=plain_net)
    restored = ct.Checkpointer(net, sharded, directory / "versions").load()
    ct.Checkpointer(plain_net, plain, directory / "versions").load()
    assert restored is not None and restored.step == SAVED_AT, restored
    train(net, sharded, SAVED_AT, LAST)
    train(plain_net, plain, SAVED_AT, LAST)
    ok, measured = compare_state(sharded.full_state_dict(), plain.state_dict())
    gap = difference(net, plain_net)
    recut = bool(cuts and cuts[0])
    saved_ranks = 2
    if commsched.size() == saved_ranks:
        reference = torch.load(directory / "reference.pt")
        exact = max((p - q).abs().max().item() for p, q in zip(net.parameters(), reference))
        ok = ok and exact == 0 and not recut
        measured += f" to_uninterrupted={exact:.3g}"
    else:
        ok = ok and recut
    ok = ok and gap < 1e-12
    verdict = "PASS" if ok else "FAIL"
    print(
        f"{verdict} load ranks={commsched.size()} recut={recut} {measured} difference={gap:.3g}", flush=True
    )
    return ok


def main() -> int:
    phase, directory = sys.argv[1], Path(sys.argv[2])
    # Buckets of 512 bytes: skip.weight (2 KiB in float64) is cut into pieces across 4 buckets.
    commsched.init(stall_timeout=10, bucket_bytes=512)
    ok = save(directory) if phase == "save" else load(directory)
    commsched.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
