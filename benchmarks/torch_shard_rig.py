#!/usr/bin/env python3
"""Sharded training on a shaped link: commsched `shard=True` against DDP, ZeRO and FSDP2, in one run.

Every variant trains the same model with Adam on the same rig (Gloo underneath each of them), the
link rate set so one iteration's allreduce of all gradients takes about as long as its compute:

    python benchmarks/torch_shard_rig.py --model vgg --ranks 2          # table, JSON
    python benchmarks/torch_shard_rig.py --model transformer --ranks 4 --repeats 5

Variants: PyTorch DDP; `ZeroRedundancyOptimizer` over DDP; FSDP2 `fully_shard` per layer; commsched
unsharded `overlap_forward`; commsched `shard=True` with `overlap_forward` (and, with --variants
shard_wait, the same with step() waiting for every reduce-scatter before any update; shard_gloo, the
same over Gloo's own alltoall and allgather instead of the native transport's ring; shard_root, the
same with parameters used outside their own module settled at the root; shard_whole, the same with
each parameter whole in its bucket however big, the layout before parameters were cut). ZeRO's
`overlap_with_ddp` is left out: torch refuses it on Gloo ("Gloo backend using Overlapping DDP with
ZeRO may meet hangs", torch 2.13), and the rig carries Gloo only. The rounds take turns, so a host
that speeds up or slows down weighs on each alike. Bytes are what rank 0 holds: gradients after a
backward (the local shards where a variant shards them) and optimizer state after a step.

Needs root (network namespaces and tc); see benchmarks/netrig.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
RESULT_TAG = "SHARD_RIG_RESULT "
VARIANTS = {
    "ddp": "PyTorch DDP, Adam",
    "zero": "ZeroRedundancyOptimizer over DDP",
    "fsdp2": "FSDP2 fully_shard",
    "overlap": "commsched overlap_forward",
    "shard": "commsched shard=True, overlap_forward",
    "shard_wait": "commsched shard=True, unpipelined step",
    "shard_gloo": "commsched shard=True, Gloo's own RS/AG",
    "shard_root": "commsched shard=True, out_proj at the root",
    "shard_whole": "commsched shard=True, parameters whole",
}
# shard_wait is step() before it was pipelined per bucket, shard_gloo shard=True over Gloo's own
# alltoall and allgather instead of commsched's ring (COMMSCHED_GLOO_RING=0): asked for by name, to
# measure the pipelining and the ring; shard_root, parameters used outside their own module
# (MultiheadAttention's out_proj) sent last and settled before the root module, the layout before
# plugins/torch/_shard_order.py; shard_whole, a parameter over the bucket limit in a bucket of its own
# (one reduce-scatter and one all-gather), not cut into pieces across buckets.
DEFAULT_VARIANTS = ("ddp", "zero", "fsdp2", "overlap", "shard")
MODELS = ("vgg", "transformer")
_VOCAB, _WIDTH, _SEQUENCE = 4096, 256, 64


class TinyTransformer(torch.nn.Module):
    """A GPT-shaped stack: token embedding, causal encoder layers, a vocabulary head (~22 MiB)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(_VOCAB, _WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(_WIDTH, 4, 4 * _WIDTH, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(_WIDTH, _VOCAB)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(_SEQUENCE))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for the next token at every position."""
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden, src_mask=self.mask, is_causal=True)
        return self.head(hidden)


def build(model: str) -> torch.nn.Module:
    """The named model, seeded alike on every rank."""
    torch.manual_seed(0)
    if model == "vgg":
        from torch_vgg import vgg

        return vgg()
    return TinyTransformer()


def layers_of(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP2 shards one by one (each its own all-gather and reduce-scatter)."""
    if isinstance(module, TinyTransformer):
        return [module.embed, *module.blocks, module.head]
    return [m for m in module if any(True for _ in m.parameters(recurse=False))]


def batch_for(model: str, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one rank's batch."""
    generator = torch.Generator().manual_seed(1 + rank)
    if model == "vgg":
        return torch.randn(batch, 3, 32, 32, generator=generator), torch.randint(
            0, 10, (batch,), generator=generator
        )
    tokens = torch.randint(0, _VOCAB, (batch, _SEQUENCE + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over classes (the CNN) or over every position's next token (the transformer)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def calibrate(model: str, batch: int, repeats: int = 4) -> tuple[float, int]:
    """(median forward+backward+Adam step seconds on one thread, gradient bytes) of one rank's batch."""
    torch.set_num_threads(1)
    net = build(model)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = batch_for(model, batch, 0)
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_of(net(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]), sum(p.numel() * p.element_size() for p in net.parameters())


def _local_bytes(tensors: Any) -> int:
    """Bytes of these tensors held on this rank (a DTensor counts its local shard)."""
    total = 0
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


# -- one rank -------------------------------------------------------------------------------
def _setup(variant: str, net: torch.nn.Module) -> tuple[Any, Any, Any, Any, int]:
    """(module to call, optimizer, optimizer holding the state, finish, rank) for one variant."""
    import torch.distributed as dist

    adam = torch.optim.Adam
    if variant in ("ddp", "zero", "fsdp2"):
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in layers_of(net):
                fully_shard(layer)
            fully_shard(net)
            optimizer = adam(net.parameters(), lr=1e-3)
            return net, optimizer, optimizer, None, rank
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        if variant == "ddp":
            optimizer = adam(net.parameters(), lr=1e-3)
            return ddp, optimizer, optimizer, None, rank
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=adam, lr=1e-3)
        return ddp, zero, zero.optim, None, rank
    import commsched.torch as ct

    import commsched

    commsched.init(transport="gloo")
    if variant == "shard_root":
        from commsched.torch._shard import ShardedOptimizer

        ShardedOptimizer._first_use = False
    if variant == "shard_whole":
        from commsched.torch import _shard_layout

        cut = _shard_layout.plan
        _shard_layout.plan = lambda entries, priorities, limit, ranks=0: cut(entries, priorities, limit, 0)
    optimizer = ct.DistributedOptimizer(
        adam(net.parameters(), lr=1e-3), model=net, overlap_forward=True, shard=variant.startswith("shard")
    )
    if variant == "shard_wait":
        optimizer._pipelined = False
    return net, optimizer, optimizer.optimizer, optimizer.synchronize, commsched.rank()


def worker(variant: str, model: str, batch: int, warmup: int, iterations: int) -> None:
    """Runs inside a rank: trains, then rank 0 prints the iteration times and bytes held as JSON."""
    torch.set_num_threads(1)
    net = build(model)
    call, optimizer, holder, finish, rank = _setup(variant, net)
    x, y = batch_for(model, batch, rank)

    def step() -> None:
        optimizer.zero_grad()
        loss_of(call(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    if finish is not None:
        finish()
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    if finish is not None:
        finish()  # overlap mode: the last updates are part of the work
    elapsed = time.perf_counter() - started
    optimizer.zero_grad()
    loss_of(call(x), y).backward()
    if finish is not None:
        finish()
    grads = _local_bytes(p.grad for p in net.parameters())
    if variant.startswith("shard"):  # the reduced shards live in the inner optimizer's groups
        grads += _local_bytes(p.grad for g in holder.param_groups for p in g["params"])
    state = _local_bytes(v for s in holder.state.values() for v in s.values())
    if rank == 0:
        result = {"variant": variant, "seconds_per_iteration": elapsed / iterations}
        result.update(grad_bytes=grads, state_bytes=state)
        print(RESULT_TAG + json.dumps(result), flush=True)
    if variant == "overlap" or variant.startswith("shard"):
        import commsched

        commsched.shutdown()
        return
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DDP's teardown can deadlock in torch's Gloo group; the result is out


# -- the driver -----------------------------------------------------------------------------
def _run_variant(rig: Any, variant: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    from local_ranks import run_on_rig

    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--model", args.model]
    argv += ["--batch", str(args.batch), "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "COMMSCHED_GLOO_RING": "0" if variant == "shard_gloo" else "1",
    }
    return run_on_rig(rig, argv, env, port, args.timeout, RESULT_TAG, variant)


def _table(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant: median ms per iteration over the rounds, its range, bytes, speed of shard=True."""
    shard = results.get("shard")
    shard_ms = statistics.median(1e3 * r["seconds_per_iteration"] for r in shard) if shard else None
    rows = []
    for variant, runs in results.items():
        ms = [1e3 * r["seconds_per_iteration"] for r in runs]
        row = {
            "variant": variant,
            "ms_per_iteration": statistics.median(ms),
            "min_ms": min(ms),
            "max_ms": max(ms),
        }
        row.update(grad_bytes=runs[-1]["grad_bytes"], state_bytes=runs[-1]["state_bytes"])
        row["shard_speedup"] = row["ms_per_iteration"] / shard_ms if shard_ms else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs every variant in turns on one rig, prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, default="vgg")
    parser.add_argument("--ranks", type=int, default=2, help="2 to 4 ranks")
    parser.add_argument(
        "--batch", type=int, default=None, help="samples per rank (default: vgg 64, transformer 8)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of every variant; medians across rounds"
    )
    parser.add_argument(
        "--rate", default="auto", help='link rate ("1gbit"), or "auto": communication = compute'
    )
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument(
        "--json", default=None, help="where the results go (default torch_shard_rig_MODEL_N.json)"
    )
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    args.batch = args.batch or (64 if args.model == "vgg" else 8)
    if args.worker:
        worker(args.worker, args.model, args.batch, args.warmup, args.iterations)
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not 2 <= args.ranks <= 4 or args.repeats < 1:
        parser.error(f"--variants from {', '.join(VARIANTS)} (not {unknown}), --ranks 2-4, --repeats >= 1")
    sys.path.insert(0, str(HERE))
    from netrig import NetRig, available, expected_allreduce_seconds, parse_rate

    ok, why = available()
    if not ok:
        print(f"torch_shard_rig needs the shaped-network rig: {why}", file=sys.stderr)
        return 2
    compute_s, nbytes = calibrate(args.model, args.batch)
    # Ranks beyond the host's cores share them: each one's compute stretches alike.
    compute_s *= max(1.0, args.ranks / (os.cpu_count() or 1))
    if args.rate == "auto":
        probe = 1e9
        rate = f"{probe * expected_allreduce_seconds(nbytes, args.ranks, probe) / compute_s / 1e6:.0f}mbit"
    else:
        rate = args.rate
    comm_s = expected_allreduce_seconds(nbytes, args.ranks, parse_rate(rate))
    print(
        f"{args.model}, {nbytes / 2**20:.1f} MiB of gradients, {args.ranks} ranks, batch {args.batch}/rank, Adam; "
        f"compute {1e3 * compute_s:.0f} ms, link {rate}: allreduce {1e3 * comm_s:.0f} ms",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with NetRig(n_ranks=args.ranks, rate=rate) as rig:
        for round_index in range(args.repeats):
            for k, variant in enumerate(variants):
                result = _run_variant(rig, variant, args, 29500 + (round_index * len(variants) + k) % 500)
                results[variant].append(result)
                print(
                    f"  round {round_index + 1} {variant:13s} {1e3 * result['seconds_per_iteration']:8.1f} ms",
                    flush=True,
                )
    rows = _table(results)
    print(
        f"\n{'variant':<44s} {'ms/iter':>8s} {'range':>15s} {'x shard':>8s} {'grad KiB':>9s} {'state KiB':>10s}"
    )
    for row in rows:
        speed = f"{row['shard_speedup']:.2f}" if row["shard_speedup"] else "-"
        print(
            f"{VARIANTS[row['variant']]:<44s} {row['ms_per_iteration']:8.1f} "
            f"{row['min_ms']:7.1f}-{row['max_ms']:<7.1f} {speed:>8s} "
            f"{row['grad_bytes'] / 1024:9.0f} {row['state_bytes'] / 1024:10.0f}"
        )
    report = {
        "model": args.model,
        "ranks": args.ranks,
        "gradient_bytes": nbytes,
        "batch_per_rank": args.batch,
        "rate": rate,
        "compute_seconds": compute_s,
        "allreduce_seconds_expected": comm_s,
        "arguments": vars(args),
        "rows": rows,
        "runs": results,
    }
    out = Path(args.json or f"torch_shard_rig_{args.model}_{args.ranks}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
