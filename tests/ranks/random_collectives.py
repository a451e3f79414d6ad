"""Rank program: thousands of random collectives, submitted in a per-rank random order with
random delays, checked against a numpy reference; loops over policies and size settings.

Run as: mpiexec -n N python random_collectives.py --tensors 2000 --seed 1
(--configs 0,3 runs a subset, --transport grpc picks a transport; tests/test_transports.py uses both)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import commsched

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]
CONFIGS = [
    {"policy": "priority"},
    {"policy": "priority", "partition_bytes": "64KiB", "credit_bytes": "256KiB", "fusion_bytes": "32KiB"},
    {"policy": "priority", "partition_bytes": "1MiB", "credit_bytes": "1MiB", "fusion_bytes": 0},
    {"policy": "priority", "partition_bytes": "16KiB", "credit_bytes": "8KiB", "fusion_bytes": "4KiB"},
    {"policy": "fifo"},
    {"policy": "fifo", "fusion_bytes": 0},
    {"policy": "priority", "inline_bytes": 0},  # small tensors as collectives, not inline in the round
]


def plan(count: int, seed: int) -> list[dict]:
    """The tensors every rank submits (same on all ranks): name, dtype, size, op, kind, priority."""
    rng = np.random.default_rng(seed)
    tensors = []
    for i in range(count):
        dtype = DTYPES[rng.choice(len(DTYPES), p=[0.35, 0.2, 0.2, 0.2, 0.05])]
        size = int(
            rng.choice([0, 1, 3, 17]) if rng.random() < 0.05 else np.exp(rng.uniform(0, np.log(200_000)))
        )
        kind = "broadcast" if rng.random() < 0.1 else "allreduce"
        floating = np.issubdtype(dtype, np.floating)
        op = "average" if floating and kind == "allreduce" and rng.random() < 0.5 else "sum"
        tensors.append(
            {
                "name": f"t{i}",
                "dtype": dtype,
                "size": size,
                "kind": kind,
                "op": op,
                "priority": int(rng.integers(-50, 50)),
            }
        )
    return tensors


def base_data(spec: dict, index: int, seed: int) -> np.ndarray:
    """Per-tensor values; rank r holds base * (r + 1) + r, so the reference is plain numpy."""
    rng = np.random.default_rng([seed, index])
    if spec["dtype"] == np.float16:  # small integers keep half-precision sums exact
        return rng.integers(-8, 8, spec["size"]).astype(np.float16)
    if np.issubdtype(spec["dtype"], np.integer):
        return rng.integers(-1000, 1000, spec["size"]).astype(spec["dtype"])
    return rng.uniform(-1, 1, spec["size"]).astype(spec["dtype"])


def rank_data(base: np.ndarray, rank: int) -> np.ndarray:
    """What rank `rank` submits for a tensor."""
    return (base * (rank + 1) + rank).astype(base.dtype)


def expected(spec: dict, base: np.ndarray, size: int, root: int) -> np.ndarray:
    """The reference result, computed with numpy in float64."""
    if spec["kind"] == "broadcast":
        return rank_data(base, root)
    total = sum(rank_data(base, r).astype(np.float64) for r in range(size))
    if spec["op"] == "average":
        total = total / size
    return total


def run_config(config: dict, tensors: list[dict], seed: int) -> None:
    """Submits every tensor in this rank's own order with random delays, then checks all results."""
    commsched.init(**config)
    rank, size = commsched.rank(), commsched.size()
    rng = np.random.default_rng([seed, rank, 7])
    order = rng.permutation(len(tensors))
    handles = {}
    for position, index in enumerate(order):
        spec = tensors[index]
        base = base_data(spec, int(index), seed)
        array = rank_data(base, rank)
        if position % 97 == 0:
            time.sleep(rng.uniform(0, 0.004))
        if spec["kind"] == "broadcast":
            root = int(index) % size
            handle = commsched.broadcast_async(array, root=root, name=spec["name"], priority=spec["priority"])
        else:
            root = 0
            handle = commsched.allreduce_async(array, spec["name"], priority=spec["priority"], op=spec["op"])
        handles[int(index)] = (handle, base, root)
    for index, (handle, base, root) in handles.items():
        spec = tensors[index]
        result = handle.wait(timeout=120)
        reference = expected(spec, base, size, root)
        if np.issubdtype(spec["dtype"], np.integer) or spec["dtype"] == np.float16 and spec["op"] == "sum":
            ok = np.array_equal(result.astype(np.float64), reference)
        else:
            tolerance = 1e-3 if spec["dtype"] == np.float16 else 1e-5
            ok = np.allclose(result.astype(np.float64), reference, rtol=tolerance, atol=tolerance)
        if not ok:
            raise AssertionError(f"rank {rank}: {spec} differs from the numpy reference under {config}")
    probed = fusion_probe(rank, size)
    stats = commsched.stats()
    settings = commsched.config()
    if settings["policy"] == "priority" and settings["partition_bytes"] <= settings["credit_bytes"]:
        largest_chunk = settings["partition_bytes"]
        assert stats["max_bytes_in_flight"] <= max(settings["credit_bytes"], largest_chunk), stats
    assert stats["completed_tensors"] == len(tensors) + probed, stats
    if settings["fusion_bytes"] > 0:
        assert stats["fused_launches"] > 0, stats  # small tensors ready together must share collectives
    commsched.shutdown()
    print(
        f"rank {rank}: OK {config} launches={stats['launches']} fused={stats['fused_launches']}", flush=True
    )


def fusion_probe(rank: int, size: int) -> int:
    """Small tensors that become ready while an urgent large one holds the link, checked after.

    The random phase fuses only when its timing happens to queue small tensors together (a
    handful of times per run); here they wait behind the large tensor's chunks on every rank,
    so the fusion check does not hang on how quickly rounds run. Empty tensors join them: they
    always go as collectives, also where every small size would ride inline in the reports.
    Returns how many tensors it sent.
    """
    fusion_bytes = commsched.config()["fusion_bytes"]
    # 4 MiB: many chunks, and the link held for them, where partition and credit are small (the
    # configs whose random phase fuses least); the default sizes fuse plenty in the random phase.
    large = np.full(1 << 20, rank + 1, np.float32)
    small = [np.full(max(1, min(8192, fusion_bytes // 3) // 4), rank + i, np.float32) for i in range(16)]
    small += [np.empty(0, np.float32) for _ in range(8)]
    handles = [commsched.allreduce_async(large, "probe.large", priority=-1000)]
    handles += [
        commsched.allreduce_async(a, f"probe.small{i}", priority=1000 + i) for i, a in enumerate(small)
    ]
    for handle in handles:
        handle.wait(timeout=120)
    ranks_sum = size * (size + 1) / 2
    assert np.all(large == ranks_sum), f"rank {rank}: probe.large summed wrong"
    for i, a in enumerate(small):
        assert np.all(a == ranks_sum - size + size * i), f"rank {rank}: probe.small{i} summed wrong"
    return len(handles)


def main() -> int:
    """Runs every configuration."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--configs", default="", help="comma-separated indices into CONFIGS (default: all)")
    parser.add_argument("--transport", default="", help="COMMSCHED_TRANSPORT for every configuration")
    args = parser.parse_args()
    tensors = plan(args.tensors, args.seed)
    chosen = [int(i) for i in args.configs.split(",")] if args.configs else range(len(CONFIGS))
    for number in chosen:
        config = dict(CONFIGS[number], transport=args.transport) if args.transport else CONFIGS[number]
        run_config(config, tensors, args.seed + number)
    print(f"rank {commsched.rank() if commsched.is_initialized() else '?'}: ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
