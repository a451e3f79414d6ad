"""Rank program: every collective beyond the plain allreduce, for every dtype, sync and async,
checked on every rank against a numpy reference computed from what every rank submits.

Run as: mpiexec -n N python collectives_suite.py [--transport grpc]  (tests/test_collectives.py)
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import commsched

DTYPES = ["float16", "bfloat16", "float32", "float64", "int16", "int32", "int64", "uint8", "int8", "bool"]
OPS = ["sum", "average", "min", "max", "product"]
# A floating average over 3 ranks is not exact: relative tolerance by dtype.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}


def torch_or_none():
    """PyTorch if installed: numpy has no bfloat16, torch tensors carry it."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def values(dtype: str, shape: tuple[int, ...], rank: int, salt: int) -> np.ndarray:
    """Small exact values per rank: sums, products and averages stay exact in every dtype."""
    rng = np.random.default_rng([salt, rank])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    low = 0 if dtype == "uint8" else -3
    return rng.integers(low, 4, shape).astype(np.float64)


def as_input(reference: np.ndarray, dtype: str):
    """The array a rank submits: numpy, or a torch tensor for bfloat16."""
    if dtype == "bfloat16":
        torch = torch_or_none()
        return torch.tensor(reference, dtype=torch.bfloat16)
    return reference.astype(dtype).copy()


def as_numpy(result) -> np.ndarray:
    """A result as float64 numpy (bool kept)."""
    if hasattr(result, "detach"):
        import torch

        result = result.numpy() if result.dtype == torch.bool else result.detach().float().numpy()
    return np.asarray(result)


def reduce(arrays: list[np.ndarray], op: str, dtype: str, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    """The reference reduction, as commsched defines it (integer average floor-divides)."""
    if dtype == "bool":
        stacked = np.stack(arrays)
        return stacked.all(0) if op in ("min", "product") else stacked.any(0)
    scaled = [a * pre for a in arrays]
    if op in ("sum", "average"):
        result = np.sum(scaled, axis=0)
        if op == "average":
            result = (
                np.floor(result / len(arrays))
                if dtype not in ("float16", "bfloat16", "float32", "float64")
                else result / len(arrays)
            )
    elif op == "min":
        result = np.min(scaled, axis=0)
    elif op == "max":
        result = np.max(scaled, axis=0)
    else:
        result = np.prod(scaled, axis=0)
    result = result * post
    if dtype == "uint8":
        result = np.mod(result, 256)
    elif dtype == "int8":
        result = (result + 128) % 256 - 128
    return result


def check(got, expected: np.ndarray, what: str, rtol: float = 0.0) -> None:
    got = as_numpy(got)
    if expected.dtype == bool:
        ok = got.dtype == bool and np.array_equal(got, expected)
    else:
        values_got = got.astype(np.float64).reshape(expected.shape)
        ok = np.allclose(values_got, expected.astype(np.float64), rtol=rtol, atol=rtol)
    if not ok:
        raise AssertionError(f"rank {commsched.rank()}: {what}: got {got!r}, expected {expected!r}")


def allreduce_cases(rank: int, size: int, dtypes: list[str], asynchronous: bool) -> int:
    """Every op on every dtype it is defined for, with scale factors on the floating ones."""
    pending, checked = [], 0
    for d, dtype in enumerate(dtypes):
        for o, op in enumerate(OPS):
            if dtype == "bool" and op in ("sum", "average"):
                continue
            floating = dtype in ("float16", "bfloat16", "float32", "float64")
            pre, post = (0.5, 4.0) if floating and op in ("sum", "average", "max") else (1.0, 1.0)
            salt = 100 * d + o
            mine = values(dtype, (5,), rank, salt)
            expected = reduce([values(dtype, (5,), r, salt) for r in range(size)], op, dtype, pre, post)
            array = as_input(mine, dtype)
            name = f"ar.{dtype}.{op}.{asynchronous}"
            rtol = TOLERANCE.get(dtype, 0.0) if op == "average" else 0.0
            if asynchronous:
                handle = commsched.allreduce_async(
                    array, name, op=op, prescale_factor=pre, postscale_factor=post
                )
                pending.append((handle, expected, name, rtol))
            else:
                result = commsched.allreduce(
                    array, name, op=op.upper(), prescale_factor=pre, postscale_factor=post
                )
                check(result, expected, name, rtol)
                checked += 1
    for handle, expected, name, rtol in pending:
        check(handle.wait(60), expected, name, rtol)
        checked += 1
    return checked


def shaped_cases(rank: int, size: int, dtypes: list[str], asynchronous: bool) -> int:
    """Allgather (uneven first dimension), reducescatter (uneven split), alltoall (equal and explicit)."""
    pending, checked = [], 0
    row = (2, 3)
    for d, dtype in enumerate(dtypes):
        salt = 1000 + d
        # allgather: rank r has r + 1 rows
        inputs = [values(dtype, (r + 1, *row), r, salt) for r in range(size)]
        name = f"ag.{dtype}.{asynchronous}"
        handle = commsched.allgather_async(as_input(inputs[rank], dtype), name)
        pending.append((handle, np.concatenate(inputs), name, 0.0))
        # reducescatter: 2 * size + 1 rows, the first rank one row more
        if dtype != "bool":
            rows = 2 * size + 1
            full = [values(dtype, (rows, *row), r, salt + 50) for r in range(size)]
            op = "average" if d % 2 else "sum"
            reduced = reduce(full, op, dtype)
            start = sum(rows // size + (1 if r < rows % size else 0) for r in range(rank))
            mine_rows = rows // size + (1 if rank < rows % size else 0)
            name = f"rs.{dtype}.{asynchronous}"
            handle = commsched.reducescatter_async(as_input(full[rank], dtype), op=op, name=name)
            pending.append((handle, reduced[start : start + mine_rows], name, TOLERANCE.get(dtype, 0.0)))
        # alltoall, explicit splits: rank s sends (s + d) % 3 rows to each rank d
        splits_of = [[(s + t) % 3 for t in range(size)] for s in range(size)]
        sent = [values(dtype, (sum(splits_of[s]), *row), s, salt + 70) for s in range(size)]
        pieces = []
        for s in range(size):
            offset = sum(splits_of[s][:rank])
            pieces.append(sent[s][offset : offset + splits_of[s][rank]])
        name = f"a2a.{dtype}.{asynchronous}"
        handle = commsched.alltoall_async(as_input(sent[rank], dtype), splits_of[rank], name=name)
        pending.append(
            (handle, (np.concatenate(pieces), [splits_of[s][rank] for s in range(size)]), name, 0.0)
        )
        if not asynchronous:
            for handle, expected, name, rtol in pending:
                _check_result(handle.wait(60), expected, name, rtol)
                checked += 1
            pending.clear()
    for handle, expected, name, rtol in pending:
        _check_result(handle.wait(60), expected, name, rtol)
        checked += 1
    # equal splits without `splits`: rank s sends row block t to rank t
    equal = np.arange(size * 2, dtype=np.int32).reshape(size * 2, 1) + 100 * rank
    output, received = commsched.alltoall(equal, name=f"a2a.equal.{asynchronous}")
    assert received == [2] * size, received
    expected = np.concatenate(
        [np.arange(size * 2).reshape(-1, 1)[2 * rank : 2 * rank + 2] + 100 * s for s in range(size)]
    )
    check(output, expected, "alltoall with equal splits")
    return checked + 1


def _check_result(result, expected, name: str, rtol: float) -> None:
    if isinstance(expected, tuple):
        output, splits = result
        assert splits == expected[1], f"{name}: received splits {splits}, expected {expected[1]}"
        check(output, expected[0], name)
    else:
        check(result, expected, name, rtol)


def object_and_group_cases(rank: int, size: int) -> int:
    """broadcast_object, allgather_object, barrier, grouped_allreduce, and refusals on every rank."""
    got = commsched.broadcast_object({"from": rank, "data": list(range(rank + 3))}, root_rank=size - 1)
    assert got == {"from": size - 1, "data": list(range(size + 2))}, got
    gathered = commsched.allgather_object(("rank", rank, "x" * rank))
    assert gathered == [("rank", r, "x" * r) for r in range(size)], gathered
    commsched.barrier()
    arrays = [
        np.full(4, rank + 1, np.float32),
        np.full(3, rank + 1, np.int64),
        np.full(2, rank + 2, np.float64),
    ]
    results = commsched.grouped_allreduce(arrays, name="group", op="max")
    for result, base in zip(results, (1, 1, 2)):
        assert np.all(result == size - 1 + base), results
    handle = commsched.grouped_allreduce_async([np.full(3, rank, np.float64) for _ in range(4)], op="sum")
    for result in handle.wait(60):
        assert np.all(result == size * (size - 1) / 2), result
    # A refusal on one rank fails the collective on every rank, naming the rank.
    bad = np.ones((size + 1, 2), np.float32) if rank == 0 else np.ones((size + 1, 3), np.float32)
    try:
        commsched.allgather(bad, name="mismatch", timeout=60)
    except commsched.CollectiveError as error:
        assert "'mismatch' does not match" in str(error) and "row shape" in str(error), error
    else:
        raise AssertionError("an allgather with different row shapes must fail on every rank")
    return 6


def gloo_path() -> str:
    """Which Gloo transport carried the collectives: " (native, N launches)" or " (python (why))"."""
    from commsched.transports import gloo

    if gloo.last_seed is None:
        return f" ({gloo.last_path})"
    return f" ({gloo.last_path}, {gloo.last_seed.counters()['launches']} launches)"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    settings = {"transport": args.transport} if args.transport else {}
    dtypes = [d for d in args.dtypes.split(",") if d != "bfloat16" or torch_or_none() is not None]
    checked = 0
    # Synchronous with small tensors inline in the agreement reports, then asynchronous with every
    # tensor on the wire: both roads of the core, and a restart between them.
    for asynchronous in (False, True):
        commsched.init(**settings, inline_bytes=0 if asynchronous else 4096)
        commsched.init()  # a second init() while running changes nothing
        rank, size = commsched.rank(), commsched.size()
        checked += allreduce_cases(rank, size, dtypes, asynchronous)
        checked += shaped_cases(rank, size, dtypes, asynchronous)
        if asynchronous:
            checked += object_and_group_cases(rank, size)
        transport = commsched.config()["transport"]
        path = gloo_path() if transport == "gloo" else ""
        commsched.shutdown()
    print(f"rank {rank}: COLLECTIVES OK {checked} checks over {transport}{path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
