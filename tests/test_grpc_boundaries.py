"""The gRPC ring at the edges of its pieces: allreduces whose ring segments end just before, at and
just after a piece boundary and the bulk socket threshold, a single element and an empty buffer,
for every reduce op and dtype at 2 and 3 ranks, equal numpy's reduction in the same dtype; the default
piece size is large on the bulk sockets and stays small on gRPC streams."""

from __future__ import annotations

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from test_grpc import wait_all  # tests/ is on sys.path (conftest.py)
from test_grpc_bulk import close_all, make_ring

from commsched.transports import grpc_bulk
from commsched.transports.grpc_ring import NUMPY_DTYPES, itemsize
from commsched.transports.grpc_transport import PIECE_BYTES

PIECE = 64 * 1024  # small pieces, so every boundary is cheap to reach
OPS = ("sum", "min", "max", "product")


def boundary_counts(dtype: str, size: int) -> list[int]:
    """Element counts whose ring segments straddle the bulk threshold and one and two piece lengths."""
    per_piece = PIECE // itemsize(dtype)
    per_threshold = grpc_bulk.BULK_BYTES // itemsize(dtype)
    counts = {0, 1, size - 1, size + 1}
    for segment in (per_threshold, per_piece, 2 * per_piece):
        counts.update({size * segment - 1, size * segment, size * segment + 1})
    counts.add(size * (3 * per_piece + 5) + size - 1)  # uneven segments of several pieces
    return sorted(counts)


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (as uint16) of small integers, which bfloat16 holds exactly."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def inputs_for(dtype: str, count: int, rank: int, rng: np.random.Generator) -> np.ndarray:
    """Small integers (a few zeros and negatives among them), so sums and products of 3 ranks stay
    exact in every dtype; uint8 wraps in numpy exactly as on the ring."""
    values = rng.integers(-3, 4, count) + (rank % 2)
    if dtype == "bfloat16":
        return bfloat16_bits(values)
    return values.astype(NUMPY_DTYPES[dtype])


def expected_of(dtype: str, op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """numpy's reduction over ranks in the dtype itself (bfloat16 through float32, where it is exact)."""
    stacked = np.stack(arrays)
    if dtype == "bfloat16":
        stacked = (stacked.astype(np.uint32) << 16).view(np.float32)
    reduce = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    result = reduce.reduce(stacked, axis=0, dtype=stacked.dtype)
    return bfloat16_bits(result) if dtype == "bfloat16" else result


@pytest.mark.parametrize("size", [2, 3])
def test_allreduce_at_piece_and_threshold_boundaries_matches_numpy(size: int) -> None:
    """Every op and dtype at every boundary count: the ring's result equals numpy's on every rank."""
    ring = make_ring(size, piece_bytes=PIECE)
    rng = np.random.default_rng(100 + size)
    try:
        for dtype in NUMPY_DTYPES:
            for count in boundary_counts(dtype, size):
                for op in OPS:
                    base = [inputs_for(dtype, count, r, rng) for r in range(size)]
                    arrays = [b.copy() for b in base]
                    ops = [
                        t.start(a.ctypes.data, count, dtype, "allreduce", 0, op) for t, a in zip(ring, arrays)
                    ]
                    assert wait_all(ops, 30) == [""] * size, (dtype, count, op)
                    expected = expected_of(dtype, op, base)
                    for rank, array in enumerate(arrays):
                        np.testing.assert_array_equal(
                            array, expected, err_msg=f"{op} of {count} {dtype}, rank {rank}"
                        )
        # The threshold cases really took the sockets on the global ring.
        assert all(t.bulk_stats()["sent_bytes"] > 0 for t in ring)
    finally:
        close_all(ring)


@pytest.mark.parametrize("size", [2, 3])
def test_default_pieces_fill_the_bulk_sockets_and_stay_small_on_grpc(size: int) -> None:
    """Unset, the global ring's pieces take BULK_PIECE_BYTES once its sockets are up and a set's
    gRPC ring keeps PIECE_BYTES; allreduces whose segments end around one bulk piece equal numpy's."""
    ring = make_ring(size)
    try:
        assert {t._node._global.piece_bytes for t in ring} == {grpc_bulk.BULK_PIECE_BYTES}
        for t in ring:
            t.add_process_set(1, list(range(size)))
        assert {t._node._sets[1].piece_bytes for t in ring} == {PIECE_BYTES}
        per_piece = grpc_bulk.BULK_PIECE_BYTES // 4
        rng = np.random.default_rng(size)
        for count in (size * per_piece - 1, size * per_piece + 1):
            base = [rng.integers(-9, 9, count).astype(np.float32) for _ in range(size)]
            arrays = [b.copy() for b in base]
            ops = [t.start(a.ctypes.data, count, "float32", "allreduce", 0) for t, a in zip(ring, arrays)]
            assert wait_all(ops, 60) == [""] * size
            for array in arrays:
                np.testing.assert_array_equal(array, np.sum(np.stack(base), axis=0))
    finally:
        close_all(ring)


def test_a_set_piece_size_holds_on_the_bulk_sockets_too() -> None:
    """piece_bytes given: the global ring's pieces keep it with the sockets up."""
    pair = make_ring(2, piece_bytes=PIECE)
    try:
        assert [t._node._global.piece_bytes for t in pair] == [PIECE, PIECE]
        assert all(t._node.bulk is not None for t in pair)
    finally:
        close_all(pair)
