"""DistributedOptimizer(shard=True) against the unsharded DistributedOptimizer on the same data.

Each case trains two copies of one model side by side on this rank's shard of the batch, one
through the unsharded optimizer and one sharded, and compares their parameters after training:

  sgd      Net (frozen, unused and rank-skipped layers), SGD with nesterov momentum and weight decay,
           after broadcast_parameters and broadcast_optimizer_state from rank 0
  small    sgd with COMMSCHED_BUCKET_BYTES=256: many buckets, parameters over it cut into pieces across
           buckets (skip.weight: 4), smaller ones bucketed together
  adamw    Net with every layer used, AdamW
  exact    float64 linear model, integer-valued data, SGD momentum, 2 backward passes per step, buckets
           of 256 bytes (its weights cut into pieces): equal bits
  mixed    a float32 layer and a float64 layer (one bucket per dtype), SGD momentum
  clip     SGD with global-norm clipping: clip_grad_norm_ on the shards vs torch's on the full gradients
  pset     sgd over a process set of all ranks but the last (that one keeps a plain optimizer)
  memory   optimizer state and reduced gradient bytes per rank within 5% of 1/N of the unsharded ones
  state    Net with the skipped layer, AdamW, buckets of 256 bytes (weights cut into pieces, Adam's
           `step` differing between parameters): full_state_dict() equals the unsharded state; loaded
           into a new sharded optimizer, training goes on to the same parameters

With --recut FILE, after the cases (`--cases ""` for none), the first run (2 ranks) saves
full_state_dict() and the model to FILE; the second (another rank count) loads it into a sharded optimizer whose shards are laid out already: gathering
again gives the saved state, and training on gives the parameters of the unsharded optimizer that
loaded the same state.

--transport NAME runs over that transport (e.g. grpc under torchrun); --fake-gpu LIBRARY runs the
CUDA path (CUDA-claiming parameters over commsched's NCCL transport on that fake library).

Prints PASS <case>/<mode> or FAIL <case>/<mode> with the difference.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

import commsched.torch as ct
import torch
import torch.nn.functional as F
from commsched.torch._shard import ShardedOptimizer
from torch_common import Net, data, shard, skips

import commsched

ITERATIONS = 6
FAKE_GPU = False  # --fake-gpu: both copies of every model claim to live on a GPU


class MixedNet(torch.nn.Module):
    """A float32 layer feeding a float64 one: two dtypes, two buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 3).double()

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)).double()).float()


def exact_model() -> torch.nn.Module:
    """A float64 linear model with dyadic weights: every gradient and update is exact."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)).double()
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.copy_(torch.arange(param.numel()).reshape(param.shape).remainder(5 + i).sub(2) / 8)
    return model


def _loss(case: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    rank = commsched.rank()
    if case == "exact":
        inputs = shard(x[step], rank).mul(4).round().double()
        return model(inputs).sum() * 0.25
    if case == "memory":
        return F.cross_entropy(model(shard(x[step], rank)), shard(y[step], rank))
    skip = skips(rank, step) if case in ("sgd", "small", "clip", "pset", "state") else False
    return F.cross_entropy(model(shard(x[step], rank), skip), shard(y[step], rank))


def _make(case: str) -> Callable[[Any], torch.optim.Optimizer]:
    if case in ("adamw", "memory", "state"):
        return lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2)
    if case == "exact":
        return lambda p: torch.optim.SGD(p, lr=0.25, momentum=0.5)
    return lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _model(case: str) -> torch.nn.Module:
    model = _plain_model(case)
    if FAKE_GPU:
        from fake_gpu import claim_cuda

        return claim_cuda(model)
    return model


def _plain_model(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "exact":
        return exact_model()
    if case == "mixed":
        return MixedNet()
    if case == "memory":
        return torch.nn.Sequential(
            torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Linear(256, 3)
        )
    return Net()


def _train(
    case: str, model: torch.nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor, first: int, last: int
) -> None:
    passes = 2 if case == "exact" else 1
    for it in range(first, last):
        optimizer.zero_grad()
        for p in range(passes):
            (_loss(case, model, x, y, it * passes + p) / passes).backward()
        if case == "clip":
            if isinstance(optimizer, ShardedOptimizer):
                optimizer.clip_grad_norm_(0.05)
            else:
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    optimizer.synchronize()


def _difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _grad_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.grad.numel() * t.grad.element_size() for t in tensors if t.grad is not None)


def run(case: str, overlap: bool, process_set: Any = None) -> tuple[bool, str]:
    """Trains the case both ways; returns (passed, what was measured)."""
    size = commsched.size()
    plain_model = _model(case)
    sharded_model = copy.deepcopy(plain_model)
    initial = copy.deepcopy(plain_model)
    make = _make(case)
    passes = 2 if case == "exact" else 1
    where: dict[str, Any] = {} if process_set is None else {"process_set": process_set}
    if case == "exact" and size & (size - 1):
        # An average over 3 ranks rounds, and then sum order (which differs between a ring allreduce
        # and a ring reduce-scatter) shows in the last bit; a sum keeps every value dyadic and exact.
        where["op"] = ct.Sum
    plain = ct.DistributedOptimizer(
        make(plain_model.parameters()),
        model=plain_model,
        overlap_forward=overlap,
        backward_passes_per_step=passes,
        **where,
    )
    sharded = ct.DistributedOptimizer(
        make(sharded_model.parameters()),
        model=sharded_model,
        overlap_forward=overlap,
        backward_passes_per_step=passes,
        shard=True,
        **where,
    )
    if case == "sgd":
        for model, optimizer in ((plain_model, plain), (sharded_model, sharded)):
            ct.broadcast_parameters(model.state_dict(), root_rank=0)
            ct.broadcast_optimizer_state(optimizer, root_rank=0)
    x, y = data(size)
    if case == "memory":
        for model, optimizer in ((plain_model, plain), (sharded_model, sharded)):
            optimizer.zero_grad()
            _loss(case, model, x, y, 0).backward()
            optimizer.synchronize()
        grads = (
            _grad_bytes(list(sharded.param_groups[0]["params"])),
            _grad_bytes(list(plain_model.parameters())),
        )
        for optimizer in (plain, sharded):
            with optimizer.skip_synchronize():
                optimizer.step()
        plain.synchronize()
        states = (_state_bytes(sharded.optimizer), _state_bytes(plain.optimizer))
        ratios = [s * size / p for s, p in (grads, states)]
        ok = all(0.95 <= r <= 1.05 for r in ratios)
        return ok, f"grad_ratio={ratios[0]:.4f} state_ratio={ratios[1]:.4f} (x{size} ranks)"
    half = ITERATIONS // 2 if case == "state" else ITERATIONS
    _train(case, plain_model, plain, x, y, 0, half)
    _train(case, sharded_model, sharded, x, y, 0, half)
    extra = ""
    if case == "state":
        full = sharded.full_state_dict()
        reference = plain.state_dict()
        state_difference = max(
            (full["state"][i][key] - value).abs().max().item()
            for i, entry in reference["state"].items()
            for key, value in entry.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )
        # Parameters no rank used yet have no state in either, and every `step` counts that parameter's updates.
        keys_match = set(reference["state"]) == set(full["state"]) and bool(reference["state"])
        keys_match = keys_match and all(
            torch.equal(full["state"][i]["step"], entry["step"]) for i, entry in reference["state"].items()
        )
        sharded.remove()  # the new optimizer takes over this model's gradient hooks
        fresh = ct.DistributedOptimizer(make(sharded_model.parameters()), model=sharded_model, shard=True)
        fresh.load_state_dict(full)
        _train(case, plain_model, plain, x, y, half, ITERATIONS)
        _train(case, sharded_model, fresh, x, y, half, ITERATIONS)
        extra = f" state_difference={state_difference:.3g} keys_match={keys_match}"
        if not keys_match or state_difference > 1e-6:
            return False, extra
    difference = _difference(plain_model, sharded_model)
    moved = _difference(initial, sharded_model)  # equal because nothing trained would prove nothing
    tolerance = {"exact": 0.0, "adamw": 1e-4, "state": 1e-4}.get(case, 2e-5)
    ok = difference <= tolerance and moved > 1e-3
    labels = [label for bucket in sharded.buckets() for label in bucket]
    cut = len({label for label in labels if labels.count(label) > 1})  # parameters cut across buckets
    return (
        ok,
        f"difference={difference:.3g} moved={moved:.3g} buckets={len(sharded.buckets())} cut={cut}{extra}",
    )


def recut(path: str) -> bool:
    """Saves the full state at this rank count, or loads one saved at another and trains on."""
    import os

    torch.manual_seed(0)
    make = _make("adamw")
    x, y = data(commsched.size())
    if not os.path.exists(path):
        model = Net()
        sharded = ct.DistributedOptimizer(make(model.parameters()), model=model, shard=True)
        _train("adamw", model, sharded, x, y, 0, 3)
        full = sharded.full_state_dict()
        if commsched.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": full}, path + ".tmp")
            os.replace(path + ".tmp", path)
        print(f"PASS recut/save ranks={commsched.size()}", flush=True)
        return True
    saved = torch.load(path, weights_only=False)
    plain_model, sharded_model = Net(), Net()
    plain_model.load_state_dict(saved["model"])
    sharded_model.load_state_dict(saved["model"])
    plain = ct.DistributedOptimizer(make(plain_model.parameters()), model=plain_model)
    sharded = ct.DistributedOptimizer(make(sharded_model.parameters()), model=sharded_model, shard=True)
    plain.load_state_dict(saved["optimizer"])
    with torch.no_grad():
        sharded_model(shard(x[0], commsched.rank()))  # lays the shards out before the state comes
    sharded.load_state_dict(saved["optimizer"])
    again = sharded.full_state_dict()["state"]
    state_difference = max(
        (again[i][key] - value).abs().max().item()
        for i, entry in saved["optimizer"]["state"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    )
    _train("adamw", plain_model, plain, x, y, 3, 6)
    _train("adamw", sharded_model, sharded, x, y, 3, 6)
    difference = _difference(plain_model, sharded_model)
    ok = state_difference == 0 and difference <= 1e-4
    verdict = "PASS" if ok else "FAIL"
    print(
        f"{verdict} recut/load ranks={commsched.size()} state_difference={state_difference:.3g} "
        f"difference={difference:.3g}",
        flush=True,
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="sgd,small,adamw,exact,mixed,clip,pset,memory,state")
    parser.add_argument("--modes", default="barrier,overlap")
    parser.add_argument("--recut", metavar="FILE", help="then save the state here, or load it if it exists")
    parser.add_argument("--transport", default=None, help="commsched.init(transport=...)")
    parser.add_argument(
        "--fake-gpu", metavar="LIBRARY", help="the CUDA path over this fake libnccl/libcudart"
    )
    args = parser.parse_args()
    where: dict[str, str] = {} if args.transport is None else {"transport": args.transport}
    if args.fake_gpu:
        from fake_gpu import route_through

        global FAKE_GPU
        FAKE_GPU = True
        route_through(args.fake_gpu)
        where["device"] = "cuda"
    failed = 0
    for case in filter(None, args.cases.split(",")):
        # Buckets of 256 bytes cut most weights into pieces across buckets.
        cut = case in ("small", "exact", "state")
        commsched.init(stall_timeout=10, bucket_bytes=256 if cut else None, **where)
        modes = ["barrier"] if case in ("memory", "clip") else args.modes.split(",")
        # All ranks but the last: that one keeps a plain optimizer on its own gradients.
        process_set = (
            ct.add_process_set(list(range(max(commsched.size() - 1, 1)))) if case == "pset" else None
        )
        for mode in modes:
            ok, measured = run(case, mode == "overlap", process_set)
            over = commsched.config()["transport"]
            if over == "gloo":  # native or python
                from commsched.transports import gloo

                over += f"({gloo.last_path.split()[0]})"
            print(f"{'PASS' if ok else 'FAIL'} {case}/{mode} {measured} transport={over}", flush=True)
            failed += not ok
        # A rank outside the set must not stop the others; the core's in-place allreduce asks torch for
        # no CUDA device (the fake GPU has none to give).
        commsched.allreduce(torch.zeros(1), name=f"done.{case}")
        commsched.shutdown()
    if args.recut:
        commsched.init(stall_timeout=10)
        failed += not recut(args.recut)
        commsched.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
