"""gRPC transport without sockets: ring logic against numpy, the wire format against protoc,
refusal of frames that do not fit, and the bind and peer settings."""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from commsched.run import free_port
from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_net import endpoint_from, parse_peers, resolve_bind
from commsched.transports.grpc_ring import FrameError, RingOp, segments

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ ring logic, in memory


def ring_run(
    size: int, arrays: list[np.ndarray], dtype: str, kind: str, root: int, piece: int
) -> list[RingOp]:
    """Runs one collective over `size` in-memory ranks, delivering frames in a shuffled order."""
    inboxes: list[deque[Any]] = [deque() for _ in range(size)]
    ops = [
        RingOp(
            3, arrays[r], dtype, kind, root, r, size, piece, lambda f, r=r: inboxes[(r + 1) % size].append(f)
        )
        for r in range(size)
    ]
    for op in ops:
        op.begin()
    rng = np.random.default_rng(size)
    while any(inboxes):
        busy = [r for r in range(size) if inboxes[r]]
        rank = busy[int(rng.integers(len(busy)))]
        ops[rank].receive(inboxes[rank].popleft())
    assert all(op.done for op in ops)
    return ops


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 4, 999])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16", "uint8", "int8"])
def test_ring_allreduce_and_broadcast_match_numpy(size: int, count: int, dtype: str) -> None:
    """Every rank ends with numpy's sum (allreduce) or the root's data (broadcast)."""
    rng = np.random.default_rng([size, count])
    base = [rng.integers(-4, 5, count).astype(dtype) for _ in range(size)]
    arrays = [b.copy() for b in base]
    ring_run(size, arrays, dtype, "allreduce", 0, piece=64)
    reference = np.sum(np.stack(base).astype(np.int64), axis=0).astype(dtype) if count else np.empty(0, dtype)
    for array in arrays:
        assert np.array_equal(array, reference)
    arrays = [b.copy() for b in base]
    ring_run(size, arrays, dtype, "broadcast", size - 1, piece=64)
    for array in arrays:
        assert np.array_equal(array, base[size - 1])


def test_ring_bfloat16_rounds_like_torch() -> None:
    """bfloat16 sums (as raw uint16) equal PyTorch's bfloat16 addition bit for bit."""
    torch = pytest.importorskip("torch")
    values = [torch.randn(3000, dtype=torch.float32).to(torch.bfloat16) for _ in range(2)]
    arrays = [v.view(torch.int16).numpy().view(np.uint16).copy() for v in values]
    ring_run(2, arrays, "bfloat16", "allreduce", 0, piece=256)
    expected = (values[0] + values[1]).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(arrays[0], expected) and np.array_equal(arrays[1], expected)


def test_ring_moves_two_n_minus_one_over_n() -> None:
    """Allreduce sends 2(n-1)/n of the buffer per rank, in pieces no bigger than asked."""
    size, count = 4, 40_000
    arrays = [np.ones(count, np.float32) for _ in range(size)]
    ops = ring_run(size, arrays, "float32", "allreduce", 0, piece=4096)
    for op in ops:
        assert op.sent_bytes == count * 4 * 2 * (size - 1) // size
    assert segments(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_small_two_rank_allreduce_takes_one_hop() -> None:
    """Up to direct_bytes, two ranks swap whole buffers once (step 0 only) and agree bit for bit."""
    rng = np.random.default_rng(7)
    for count, direct in ((1000, True), (100_000, False)):
        base = [rng.standard_normal(count).astype(np.float32) for _ in range(2)]
        arrays = [b.copy() for b in base]
        sent: list[list[Any]] = [[], []]
        inboxes: list[deque[Any]] = [deque(), deque()]

        def send(
            frame: Any, r: int, sent: list[list[Any]] = sent, inboxes: list[deque[Any]] = inboxes
        ) -> None:
            sent[r].append(frame)
            inboxes[1 - r].append(frame)

        ops = [
            RingOp(
                0,
                arrays[r],
                "float32",
                "allreduce",
                0,
                r,
                2,
                4096,
                lambda f, r=r: send(f, r),
                direct_bytes=8000,
            )
            for r in range(2)
        ]
        for op in ops:
            op.begin()
        while any(inboxes):
            for r in range(2):
                if inboxes[r]:
                    ops[r].receive(inboxes[r].popleft())
        assert all(op.done for op in ops)
        assert np.array_equal(arrays[0], arrays[1]) and np.array_equal(arrays[0], base[0] + base[1])
        steps = {frame.step for frames in sent for frame in frames}
        assert steps == ({0} if direct else {0, 1}), steps
        assert ops[0].sent_bytes == count * 4


def make_frame(**fields: Any) -> Any:
    """A data frame with sensible defaults, overridden by `fields`."""
    values = {
        "channel": wire.DATA,
        "src": 0,
        "seq": 3,
        "step": 0,
        "piece": 0,
        "dtype": "float32",
        "offset": 0,
    }
    values.update(count=4, payload=b"\0" * 16)
    values.update(fields)
    return wire.Frame(**values)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"payload": b"\0" * 10}, "truncated payload of 10 bytes, expected 16"),
        ({"payload": b"\0" * 20}, "oversized payload of 20 bytes"),
        ({"dtype": "float64"}, "dtype 'float64', expected 'float32'"),
        ({"step": 9}, "no such step"),
        ({"offset": 2}, "elements 2\\+4, expected 0\\+4"),
        ({"src": 1}, "data comes from rank 0"),
    ],
)
def test_ring_rejects_frames_that_do_not_fit(fields: dict[str, Any], message: str) -> None:
    """Size, dtype, step, offset and sender are all checked against the receiver's expectation."""
    op = RingOp(3, np.zeros(8, np.float32), "float32", "allreduce", 0, 1, 2, 1024, lambda f: None)
    with pytest.raises(FrameError, match=message):
        op.receive(make_frame(**fields))
    assert not op.done


def test_ring_rejects_a_piece_twice() -> None:
    """A replayed piece is refused rather than summed twice."""
    op = RingOp(3, np.zeros(8, np.float32), "float32", "allreduce", 0, 1, 2, 16, lambda f: None)
    op.receive(make_frame())
    with pytest.raises(FrameError, match="received twice"):
        op.receive(make_frame())


def test_frames_encode_and_decode_as_protobuf_does() -> None:
    """grpc_frames' bytes are wire.Frame's protobuf encoding, both ways, payload included."""
    from commsched.transports.grpc_frames import DataFrame, MalformedFrame, deserialize, encode_frame

    values = np.arange(1000, dtype=np.float32)
    frame = DataFrame(1, 2**40, 3, 70000, "float32", 300, 500, values[300:800])
    parsed = wire.Frame.FromString(frame.encode())
    assert (parsed.channel, parsed.src, parsed.seq, parsed.step, parsed.piece) == (
        wire.DATA,
        1,
        2**40,
        3,
        70000,
    )
    assert (parsed.dtype, parsed.offset, parsed.count) == ("float32", 300, 500)
    assert parsed.payload == values[300:800].tobytes()
    sent = wire.Frame(channel=wire.CONTROL, src=5, seq=9, dtype="int8", count=3, payload=b"abc")
    view = deserialize(sent.SerializeToString())
    assert (view.channel, view.src, view.seq, view.dtype, view.count, bytes(view.payload)) == (
        wire.CONTROL,
        5,
        9,
        "int8",
        3,
        b"abc",
    )
    empty = deserialize(encode_frame(wire.CLOSE, 0))
    assert (empty.channel, empty.src, bytes(empty.payload)) == (wire.CLOSE, 0, b"")
    for garbage in (b"\x0a", b"\x4a\x05ab", b"\x08\xff"):  # wrong wire type, short payload, cut varint
        with pytest.raises(MalformedFrame):
            deserialize(garbage)


def test_wire_descriptor_matches_the_proto_file(tmp_path: Path) -> None:
    """grpc_wire.py's hand-built descriptor is exactly what protoc compiles from grpc_wire.proto."""
    pytest.importorskip("grpc_tools.protoc")
    from google.protobuf import descriptor_pb2

    out = tmp_path / "wire.pb"
    # In a process of its own: protoc in-process beside TensorFlow's and torch's libraries has crashed.
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--descriptor_set_out={out}",
        wire.FILE_NAME,
    ]
    subprocess.run(command, check=True, timeout=120)
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    assert compiled == wire.file_descriptor()


# ------------------------------------------------------------------ addresses


def test_bind_and_peer_settings() -> None:
    """The loopback interface, an explicit IP and the route to MASTER_ADDR resolve; nonsense is named."""
    assert resolve_bind("lo", "127.0.0.1", 29500) == ("127.0.0.1", "127.0.0.1")
    assert resolve_bind("", "127.0.0.1", 29500) == ("127.0.0.1", "127.0.0.1")
    assert resolve_bind("0.0.0.0", "127.0.0.1", 29500) == ("0.0.0.0", "127.0.0.1")
    with pytest.raises(ValueError, match="COMMSCHED_GRPC_BIND='no-such-thing.invalid'"):
        resolve_bind("no-such-thing.invalid", "127.0.0.1", 29500)
    with pytest.raises(ValueError, match="COMMSCHED_GRPC_PEERS"):
        parse_peers("127.0.0.1:1,nonsense")
    with pytest.raises(ValueError, match="lists 1 addresses for WORLD_SIZE=2"):
        endpoint_from(0, 2, "", 0, ["127.0.0.1:5000"], "", False)
    # torchrun's agent store holds MASTER_PORT, so the rendezvous moves one port up.
    assert endpoint_from(0, 2, "127.0.0.1", 29500, [], "", True).port == 29501
    assert endpoint_from(1, 2, "127.0.0.1", 29500, [], "", False).master == "127.0.0.1:29500"


def test_free_port_stays_out_of_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's rendezvous port is one no rank's own port-0 server can be given."""
    from commsched import run

    low, high = run._ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high and port >= 1024, (port, low, high)
    # Where the ephemeral range covers every port, any free one is still found.
    monkeypatch.setattr(run, "_ephemeral_ports", lambda: (1024, 65535))
    assert 1024 <= free_port() <= 65535
