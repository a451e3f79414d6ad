"""The gRPC transport's bulk path (grpc_bulk): large pieces of every collective over the ring's
sockets, checked against numpy at 2 and 3 ranks; small pieces stay on gRPC; a peer that closes its
socket, a bad frame, an intruder and an unreachable address each give an error naming the rank or
address; every socket is closed at shutdown."""

from __future__ import annotations

import re
import socket
import threading
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from test_grpc import TOKEN, make_pair, wait_all  # tests/ is on sys.path (conftest.py)

from commsched.run import free_port
from commsched.transports import grpc_bulk
from commsched.transports.grpc_net import endpoint_from
from commsched.transports.grpc_transport import GrpcError, GrpcTransport

PIECE = 256 * 1024  # several pieces per segment, each above the bulk threshold


def make_ring(size: int, timeout_s: float = 10.0, **options: Any) -> list[GrpcTransport]:
    """`size` connected transports built concurrently, as `size` processes would."""
    port = free_port()
    made: list[Any] = [None] * size
    errors: list[Any] = [None] * size

    def build(rank: int) -> None:
        endpoint = endpoint_from(rank, size, "127.0.0.1", port, [], "", False)
        try:
            made[rank] = GrpcTransport(endpoint, TOKEN, timeout_s=timeout_s, **options)
        except GrpcError as error:
            errors[rank] = error

    threads = [threading.Thread(target=build, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if not all(made):
        for transport in made:
            if transport is not None:
                transport.close()
        raise AssertionError(f"rendezvous failed: {errors}")
    return made


def close_all(transports: list[GrpcTransport]) -> None:
    """Closes every transport."""
    for transport in transports:
        transport.close()


def run_collective(
    ring: list[GrpcTransport], kind: str, dtype: str, inputs: list[np.ndarray], **how: Any
) -> list[np.ndarray]:
    """One allgather, reducescatter or alltoall on every rank; returns each rank's output (of
    how["outputs"][rank] elements, by default all it receives)."""
    size = len(ring)
    recv_counts = how["recv_counts"]
    produced = how.get("outputs", [sum(counts) for counts in recv_counts])
    outputs = [np.zeros(produced[r], dtype=inputs[r].dtype) for r in range(size)]
    ops = [
        t.start_collective(
            kind,
            dtype,
            "sum",
            x.ctypes.data,
            x.size,
            out.ctypes.data,
            recv_counts[r],
            [],
            how.get("layout", []),
        )
        for r, (t, x, out) in enumerate(zip(ring, inputs, outputs))
    ]
    assert wait_all(ops, 30) == [""] * size
    return outputs


@pytest.mark.parametrize("size", [2, 3])
def test_large_collectives_over_the_bulk_sockets_match_numpy(size: int) -> None:
    """Allreduce (sum, max; float32, float64, int32, float16), broadcast, allgather, reducescatter and
    alltoall of megabytes over the bulk path equal numpy's results, and the sockets carried them."""
    ring = make_ring(size, piece_bytes=PIECE)
    rng = np.random.default_rng(size)
    try:
        for dtype, op, count in (
            ("float32", "sum", 1_000_003),
            ("float64", "max", 300_001),
            ("int32", "sum", 700_000),
            ("float16", "sum", 400_000),
        ):
            base = [rng.integers(-50, 50, count).astype(dtype) for _ in range(size)]
            arrays = [b.copy() for b in base]
            ops = [t.start(a.ctypes.data, count, dtype, "allreduce", 0, op) for t, a in zip(ring, arrays)]
            assert wait_all(ops, 30) == [""] * size
            reduce = np.sum if op == "sum" else np.max
            expected = reduce(np.stack(base).astype(np.float64), axis=0).astype(dtype)
            for array in arrays:
                np.testing.assert_array_equal(array, expected)
        values = [rng.standard_normal(500_000) for _ in range(size)]
        ops = [t.start(v.ctypes.data, v.size, "float64", "broadcast", size - 1) for t, v in zip(ring, values)]
        assert wait_all(ops, 30) == [""] * size
        root = values[size - 1].copy()
        for value in values:
            np.testing.assert_array_equal(value, root)

        parts = [200_000 + 7 * r for r in range(size)]  # uneven, as a real allgather may be
        inputs = [rng.standard_normal(parts[r]).astype(np.float32) for r in range(size)]
        gathered = run_collective(ring, "allgather", "float32", inputs, recv_counts=[parts] * size)
        for output in gathered:
            np.testing.assert_array_equal(output, np.concatenate(inputs))

        inputs = [rng.integers(-9, 9, sum(parts)).astype(np.int64) for _ in range(size)]
        scattered = run_collective(
            ring, "reducescatter", "int64", inputs, recv_counts=[parts] * size, outputs=parts
        )
        total = np.sum(np.stack(inputs), axis=0)
        starts = np.cumsum([0, *parts])
        for r, output in enumerate(scattered):
            np.testing.assert_array_equal(output, total[starts[r] : starts[r + 1]])

        # alltoall: rank s sends layout[s * size + d] elements to rank d
        layout = [100_000 + 1000 * s + 10 * d for s in range(size) for d in range(size)]
        inputs = [
            rng.standard_normal(sum(layout[s * size : (s + 1) * size])).astype(np.float32)
            for s in range(size)
        ]
        received = [[layout[s * size + d] for s in range(size)] for d in range(size)]
        outputs = run_collective(ring, "alltoall", "float32", inputs, recv_counts=received, layout=layout)
        for d, output in enumerate(outputs):
            pieces = []
            for s in range(size):
                begin = sum(layout[s * size : s * size + d])
                pieces.append(inputs[s][begin : begin + layout[s * size + d]])
            np.testing.assert_array_equal(output, np.concatenate(pieces))
        stats = [t.bulk_stats() for t in ring]
        for rank, stat in enumerate(stats):
            assert stat["sent_bytes"] > 10 * 1024**2 and stat["received_bytes"] > 10 * 1024**2, (rank, stats)
            assert stat["tls"] is False
        # Every byte a rank sent over its socket arrived at its right-hand neighbour.
        assert [s["sent_bytes"] for s in stats] == [
            stats[(r + 1) % size]["received_bytes"] for r in range(size)
        ]
    finally:
        close_all(ring)


def test_small_pieces_stay_on_grpc_and_the_bulk_path_can_be_off() -> None:
    """Pieces under the threshold never touch the sockets; with bulk_bytes=0 there are none, and
    large collectives still sum over gRPC."""
    pair = make_pair(piece_bytes=PIECE)
    try:
        arrays = [np.full(2000, r + 1, np.float32) for r in range(2)]  # 8 KB: below the threshold
        assert wait_all(
            [t.start(a.ctypes.data, a.size, "float32", "allreduce", 0) for t, a in zip(pair, arrays)]
        ) == [
            "",
            "",
        ]
        assert all((a == 3).all() for a in arrays)
        assert [t.bulk_stats()["sent_bytes"] for t in pair] == [0, 0]
    finally:
        close_all(pair)
    pair = make_pair(piece_bytes=PIECE, bulk_bytes=0)
    try:
        arrays = [np.full(600_000, r + 1, np.float32) for r in range(2)]
        assert wait_all(
            [t.start(a.ctypes.data, a.size, "float32", "allreduce", 0) for t, a in zip(pair, arrays)]
        ) == [
            "",
            "",
        ]
        assert all((a == 3).all() for a in arrays)
        assert pair[0]._node.bulk is None and pair[0].bulk_stats()["sent_bytes"] == 0
    finally:
        close_all(pair)


def test_a_peer_that_closes_its_bulk_socket_fails_the_collective_naming_it() -> None:
    """Rank 1's socket to rank 0 ends without a goodbye: the next large collective fails on both
    ranks (none hangs), rank 0's error naming rank 1 and the bulk connection."""
    pair = make_pair(piece_bytes=PIECE)
    try:
        pair[1]._node.bulk._outgoing.shutdown(socket.SHUT_RDWR)  # as if rank 1's end were cut
        arrays = [np.ones(1_000_000, np.float32) for _ in range(2)]
        errors = wait_all(
            [t.start(a.ctypes.data, a.size, "float32", "allreduce", 0) for t, a in zip(pair, arrays)]
        )
        assert all(errors), errors
        assert "rank 1" in errors[0] and "bulk data connection" in errors[0], errors
        with pytest.raises(GrpcError):
            pair[0].exchange(b"", 2)
    finally:
        close_all(pair)


@pytest.mark.parametrize(
    ("dtype", "count", "message"),
    [
        (
            "float64",
            20_000,
            "rank 1 rejected (data|a frame) from rank 0.*dtype 'float64', expected 'float32'",
        ),
        (
            "float32",
            100_000,
            "rank 1 rejected a frame from rank 0 .*400000 bytes, above the 262144-byte piece",
        ),
    ],
)
def test_a_bad_bulk_frame_is_rejected_naming_the_sender(dtype: str, count: int, message: str) -> None:
    """A socket frame of the wrong dtype, or larger than a piece, fails the job with the reason."""
    pair = make_pair(piece_bytes=PIECE)
    try:
        header = grpc_bulk._HEADER.pack(0, grpc_bulk._DTYPES.index(dtype), 0, 0, 0, 0, count)
        garbage = header + bytes(count * np.dtype(dtype).itemsize)
        pair[0]._node.bulk._outgoing.sendall(garbage)  # as if rank 0 sent it
        arrays = [np.ones(40_000, np.float32) for _ in range(2)]
        errors = wait_all(
            [t.start(a.ctypes.data, a.size, "float32", "allreduce", 0) for t, a in zip(pair, arrays)]
        )
        # Rank 1 refuses the frame and fails the job. The collective itself may still finish on
        # either rank, with a whole result, when the right frame lands first; the next call fails.
        assert all(not e or re.search(message, e) for e in errors), errors
        with pytest.raises(GrpcError, match=message):
            pair[1].exchange(b"", 5)
        with pytest.raises(GrpcError, match="rank 1 failed"):
            pair[0].exchange(b"", 5)
    finally:
        close_all(pair)


def test_a_hello_without_the_job_token_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """The listener closes a connection whose hello lacks the token's proof and takes the real one."""
    listener = grpc_bulk.listen("127.0.0.1")
    accepted: list[Any] = []
    address = ("127.0.0.1", listener.getsockname()[1])
    digest = grpc_bulk._hello_digest(TOKEN, 0, 1)
    deadline = grpc_bulk.time.monotonic() + 10
    with listener, caplog.at_level("WARNING", logger="commsched"):
        acceptor = threading.Thread(
            target=grpc_bulk._accept,
            args=(listener, None, digest, 0, 1, deadline, accepted, lambda: False),
        )
        acceptor.start()
        with socket.create_connection(address) as intruder:
            intruder.sendall(grpc_bulk._HELLO.pack(b"CSB1", 0, 1, grpc_bulk._hello_digest("wrong", 0, 1)))
            assert intruder.recv(1) == b""  # closed on it
        with socket.create_connection(address) as rightful:
            rightful.sendall(grpc_bulk._HELLO.pack(b"CSB1", 0, 1, digest))
            acceptor.join(10)
            assert len(accepted) == 1
            accepted[0][0].close()
    assert "refused a bulk data connection" in caplog.text and "token" in caplog.text, caplog.text


def test_an_unreachable_bulk_address_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a rank's advertised bulk address takes no connection, init fails naming the address
    and COMMSCHED_GRPC_BIND instead of waiting."""
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(grpc_bulk, "advertised", lambda listener, host: dead)
    with pytest.raises(AssertionError) as failed:
        make_ring(2, timeout_s=3.0)
    text = str(failed.value)
    assert "cannot open the bulk data connection to rank" in text and dead in text, text
    assert "COMMSCHED_GRPC_BIND" in text, text


def test_every_bulk_socket_is_closed_at_shutdown() -> None:
    """close() ends both threads of every link and closes both sockets."""
    ring = make_ring(3, piece_bytes=PIECE)
    links = [t._node.bulk for t in ring]
    arrays = [np.ones(400_000, np.float32) for _ in range(3)]
    assert (
        wait_all([t.start(a.ctypes.data, a.size, "float32", "allreduce", 0) for t, a in zip(ring, arrays)])
        == [""] * 3
    )
    close_all(ring)
    for link in links:
        assert link is not None
        assert link._outgoing.fileno() == -1 and link._incoming.fileno() == -1
        assert not link._sender.is_alive() and not link._receiver.is_alive()


def test_a_collective_on_a_closed_link_fails_instead_of_hanging() -> None:
    """Frames handed to a link already closed are dropped with their op given back, so the
    watchdog's stall error reaches the caller (no op stays borrowed, none hangs)."""
    pair = make_pair(timeout_s=1.0, piece_bytes=PIECE)
    try:
        pair[0]._node.bulk.close()
        arrays = [np.ones(400_000, np.float32) for _ in range(2)]
        errors = wait_all(
            [t.start(a.ctypes.data, a.size, "float32", "allreduce", 0) for t, a in zip(pair, arrays)]
        )
        assert all(errors), errors
        assert any("rank 0" in e or "rank 1" in e for e in errors), errors
    finally:
        close_all(pair)


def test_ranks_that_disagree_on_the_bulk_threshold_fail_at_init_naming_the_variable() -> None:
    """One rank with the bulk path off and one with it on would wait for each other's pieces on
    different roads: both refuse at init instead, each rank's value named."""
    port = free_port()
    errors: list[Any] = [None, None]
    made: list[Any] = [None, None]

    def build(rank: int) -> None:
        endpoint = endpoint_from(rank, 2, "127.0.0.1", port, [], "", False)
        try:
            made[rank] = GrpcTransport(endpoint, TOKEN, timeout_s=10.0, bulk_bytes=[0, 65536][rank])
        except GrpcError as error:
            errors[rank] = error

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for transport in made:
        if transport is not None:
            transport.close()
    assert all(error is not None for error in errors), (errors, made)
    for error in errors:
        assert "COMMSCHED_GRPC_BULK_BYTES" in str(error) and "rank 0: 0, rank 1: 65536" in str(error)


def test_the_bulk_threshold_setting_is_read_and_checked() -> None:
    """COMMSCHED_GRPC_BULK_BYTES takes a size; a bad one names the variable."""
    from commsched.config import SettingError, resolve

    assert resolve({}, environ={"COMMSCHED_GRPC_BULK_BYTES": "64KiB"}).grpc_bulk_bytes == 65536
    assert resolve({}, environ={"COMMSCHED_GRPC_BULK_BYTES": "0"}).grpc_bulk_bytes == 0
    with pytest.raises(SettingError, match="COMMSCHED_GRPC_BULK_BYTES"):
        resolve({}, environ={"COMMSCHED_GRPC_BULK_BYTES": "lots"})
