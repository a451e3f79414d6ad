"""`commsched-bench allreduce`: the nccl-tests table for commsched and, on the same sizes in the
same run, for the raw library underneath (mpi4py Allreduce, torch.distributed.all_reduce, or for
gRPC, which has no allreduce of its own, commsched's gRPC ring transport driven without the core)."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from commsched.bench import report
from commsched.config import parse_size

COLUMNS: list[report.Column] = [
    ("size", "size", "d"),
    ("count", "count", "d"),
    ("type", "type", ""),
    ("redop", "redop", ""),
    ("raw_time_us", "raw us", ".1f"),
    ("raw_algbw", "raw algbw", ".3f"),
    ("raw_busbw", "raw busbw", ".3f"),
    ("time_us", "time us", ".1f"),
    ("algbw", "algbw", ".3f"),
    ("busbw", "busbw", ".3f"),
    ("busbw_ratio", "busbw/raw", ".3f"),
    ("time_ratio", "time/raw", ".3f"),
]
# With the TCP baseline (on by default for gRPC): the same allreduce over plain sockets between the
# same processes, and how the raw library and commsched compare with it.
TCP_COLUMNS: list[report.Column] = [
    ("tcp_time_us", "tcp us", ".1f"),
    ("tcp_busbw", "tcp busbw", ".3f"),
    ("raw_tcp_ratio", "raw/tcp", ".3f"),
    ("tcp_ratio", "busbw/tcp", ".3f"),
]


def sizes(min_bytes: int, max_bytes: int, factor: float, step: int) -> list[int]:
    """Message sizes from min to max, multiplied by `factor` (or increased by `step` bytes when factor is 1)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError("need 4 <= min <= max bytes")
    if factor <= 1 and step <= 0:
        raise ValueError("give a step factor above 1 or a positive step")
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size - size % 4)
        size = int(size * factor) if factor > 1 else size + step
    return out


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """nccl-tests' busbw for allreduce: algbw * 2(n-1)/n."""
    return algbw * 2.0 * (ranks - 1) / ranks


def iterations_for(size: int, iters: int, budget_bytes: int) -> int:
    """Fewer repetitions for big messages, so a size costs about `budget_bytes` of traffic at most."""
    return max(2, min(iters, budget_bytes // max(size, 1)))


class RawMPI:
    """mpi4py's in-place Allreduce, the library commsched's MPI transport calls."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.mpi, self.comm = MPI, MPI.COMM_WORLD

    def allreduce(self, buffer: np.ndarray) -> None:
        """One blocking raw allreduce."""
        self.comm.Allreduce(self.mpi.IN_PLACE, buffer)

    def barrier(self) -> None:
        """Lines the ranks up before a timing."""
        self.comm.Barrier()

    def slowest(self, value: float) -> float:
        """The largest value over ranks."""
        return float(self.comm.allreduce(value, op=self.mpi.MAX))


class RawTorch:
    """torch.distributed.all_reduce on the process group commsched's Gloo transport uses."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist

    def allreduce(self, buffer: np.ndarray) -> None:
        """One blocking raw allreduce."""
        self.dist.all_reduce(self.torch.from_numpy(buffer))

    def barrier(self) -> None:
        """Lines the ranks up before a timing."""
        self.dist.barrier()

    def slowest(self, value: float) -> float:
        """The largest value over ranks."""
        cell = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(cell, op=self.dist.ReduceOp.MAX)
        return float(cell.item())

    def release(self) -> None:
        """Destroys the process group the bench made, once commsched is shut down. Torch's Gloo worker
        threads drop a finished allreduce's tensors after the caller has its result; one still doing
        so while the interpreter exited could not take the GIL and aborted the rank."""
        if self.owns_group and self.dist.is_initialized():
            self.dist.destroy_process_group()


class RawGrpc:
    """commsched's gRPC ring transport driven directly: no agreement, no scheduling, no core thread.

    A second GrpcTransport, built after commsched.init(transport="grpc") in the same processes, on
    a port rank 0 finds free and tells the others through commsched itself, so it never meets the
    transport the core uses (whose rank 0 listens on MASTER_PORT, or MASTER_PORT + 1 under
    torchrun's agent store, or on the ports COMMSCHED_GRPC_PEERS lists).
    """

    label = "commsched gRPC ring without the core"
    poll_s = 0.1  # between test() calls, should a wake-up be missed

    def __init__(self, settings: dict[str, Any]) -> None:
        import commsched
        from commsched.config import job_token
        from commsched.launch import detect
        from commsched.run import free_port
        from commsched.transports.grpc_net import (
            endpoint_from,
            fallback_token,
            parse_peers,
            resolve_bind,
            split_host_port,
        )
        from commsched.transports.grpc_transport import GrpcTransport

        launch = detect()
        rank, size = commsched.rank(), commsched.size()
        peers = parse_peers(os.environ.get("COMMSCHED_GRPC_PEERS", ""))
        bind_setting = settings.get("grpc_bind") or ""
        if peers:  # rendezvous at rank 0's host, each rank listening where its listed address is
            host = split_host_port(peers[0], "COMMSCHED_GRPC_PEERS")[0]
            bind_setting = bind_setting or split_host_port(peers[rank], "COMMSCHED_GRPC_PEERS")[0]
        else:
            host = launch.master_addr or os.environ.get("MASTER_ADDR", "") or "127.0.0.1"
        cell = np.zeros(1, np.int64)
        if rank == 0 and size > 1:
            cell[0] = free_port(resolve_bind(bind_setting, host, 1)[0])
        commsched.broadcast(cell, root=0, name="bench.raw_grpc_port")
        # A single rank gets port 0 here, which plans a lone local endpoint.
        endpoint = endpoint_from(rank, size, host, int(cell[0]), [], bind_setting, False)
        secret = job_token() or fallback_token(host, size, os.environ.get("TORCHELASTIC_RUN_ID", ""))
        # Its own token: should a raw rank ever reach the core's server, it is refused by name.
        token = hashlib.sha256(f"{secret}|raw allreduce bench".encode()).hexdigest()
        self.timeout_s = float(settings["stall_timeout"])
        self.transport = GrpcTransport(endpoint, token, timeout_s=self.timeout_s)

    def allreduce(self, buffer: np.ndarray) -> None:
        """One raw allreduce: start() on the buffer's memory, then test() until it is done."""
        op = self.transport.start(buffer.ctypes.data, buffer.size, "float32", "allreduce", 0)
        finished = threading.Event()
        op.on_done(finished.set)  # as the core's doorbell: woken at completion, not at the next poll
        while not op.test():
            finished.wait(self.poll_s)

    def barrier(self) -> None:
        """Lines the ranks up before a timing (an empty exchange)."""
        self.transport.exchange(b"", self.timeout_s)

    def slowest(self, value: float) -> float:
        """The largest value over ranks, gathered with exchange()."""
        reports = self.transport.exchange(struct.pack("<d", value), self.timeout_s)
        return max(struct.unpack("<d", report)[0] for report in reports)

    def close(self) -> None:
        """Closes the raw transport's streams, server and engine thread."""
        self.transport.close()


RAW_LABELS = {"mpi": "mpi4py Allreduce", "gloo": "torch.distributed gloo", "grpc": RawGrpc.label}
LAUNCH_HINTS = {
    "mpi": "mpiexec -n 2 python -m mpi4py -m commsched.bench.cli allreduce",
    "gloo": "torchrun --nproc-per-node 2 -m commsched.bench.cli allreduce --transport gloo",
    "grpc": "python -m commsched.run -n 2 -m commsched.bench.cli allreduce --transport grpc",
}


# transport -> (the library its raw column needs, how to install it)
RAW_LIBRARIES = {
    "mpi": ("mpi4py", "pip install mpi4py mpich (or an mpi4py built against your MPI)"),
    "gloo": ("torch", "pip install torch"),
    "grpc": ("grpc", "pip install grpcio"),
}


def check_libraries(transport: str) -> None:
    """Stops with what to install, or which --transport to use, when `transport` lacks its library."""
    module, install = RAW_LIBRARIES[transport]
    try:
        importlib.import_module(module)
    except ImportError:
        others = ", ".join(
            f"--transport {name} ({LAUNCH_HINTS[name]})" for name in RAW_LIBRARIES if name != transport
        )
        raise SystemExit(
            f"allreduce --transport {transport} needs {module}, which this Python cannot import: {install}; "
            f"or measure another transport: {others}"
        ) from None


def check_launch(transport: str, environ: dict[str, str] | None = None) -> None:
    """Stops with the command to use when the launcher cannot start `transport`'s ranks."""
    from commsched.launch import detect

    environ = dict(os.environ) if environ is None else environ
    launcher = detect(environ).launcher
    if transport == "mpi" and launcher == "torchrun":
        problem = "was started with torchrun-style variables (RANK/WORLD_SIZE), not by mpiexec"
    elif transport == "gloo" and launcher == "mpiexec" and not environ.get("MASTER_ADDR"):
        problem = "was started by mpiexec, which sets no MASTER_ADDR/MASTER_PORT for torch.distributed"
    elif (
        transport == "grpc"
        and launcher == "mpiexec"
        and not environ.get("COMMSCHED_GRPC_PEERS")
        and not environ.get("MASTER_ADDR")
    ):
        problem = (
            "was started by mpiexec, which sets neither MASTER_ADDR/MASTER_PORT nor COMMSCHED_GRPC_PEERS"
        )
    else:
        return
    raise SystemExit(
        f"allreduce --transport {transport}: this process {problem}; run: {LAUNCH_HINTS[transport]}"
    )


def fill(buffer: np.ndarray, rank: int) -> None:
    """Rank- and position-dependent values, so a sum that skips a rank or a segment shows."""
    buffer[:] = (rank + 1) + np.arange(buffer.size) % 7


def check_sum(buffer: np.ndarray, ranks: int) -> bool:
    """True if `buffer` holds the sum over ranks of what fill() put there."""
    expected = ranks * (ranks + 1) // 2 + ranks * (np.arange(buffer.size) % 7)
    return bool(np.array_equal(buffer, expected.astype(buffer.dtype)))


def _time(raw: Any, operation: Callable[[], None], iterations: int, repeats: int) -> float:
    """Seconds per operation on the slowest rank, best of `repeats` back-to-back loops."""
    samples = []
    for _ in range(repeats):
        raw.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            operation()
        samples.append(raw.slowest((time.perf_counter() - start) / iterations))
    return min(samples) if repeats > 1 else statistics.fmean(samples)


def run(args: argparse.Namespace) -> int:
    """Times every size through commsched and the raw library; rank 0 prints the table."""
    import commsched

    check_libraries(args.transport)
    check_launch(args.transport)
    # The raw MPI and Gloo libraries come up first (commsched's transports use what they set up);
    # the raw gRPC transport comes up after commsched's, which tells it where to meet.
    raw: Any = {"gloo": RawTorch, "mpi": RawMPI}.get(args.transport, lambda: None)()
    commsched.init(
        transport=args.transport,
        policy=args.policy,
        fusion_bytes=args.fusion_bytes,
        partition_bytes=args.partition_bytes,
        credit_bytes=args.credit_bytes,
        cycle_time=args.cycle_time,
    )
    if raw is None:
        raw = RawGrpc(commsched.config())
    tcp = None
    if args.tcp if args.tcp is not None else args.transport == "grpc":
        from commsched.bench.tcp_baseline import TcpRing, baseline_host

        tcp = TcpRing.connect(baseline_host(commsched.config()), float(commsched.config()["stall_timeout"]))
    try:
        rows, settings = _measure(args, raw, tcp)
        if hasattr(raw, "close"):
            # No rank closes the raw transport before every rank is past its last raw exchange:
            # a closing peer's goodbye on the data stream can overtake its last report on the
            # control stream, and the rank still waiting for that report would fail.
            commsched.allreduce(np.zeros(1, np.float32), name="bench.raw_done")
    finally:
        if hasattr(raw, "close"):
            raw.close()
        if tcp is not None:
            tcp.close()
        commsched.shutdown()
        if hasattr(raw, "release"):
            raw.release()
    ranks = settings["size"]
    if settings["rank"] != 0:
        return 0
    print_table(args, settings, rows, tcp.label if tcp else None, report.text_stream(args.json))
    if args.json:
        report.dump_json(
            {
                "ranks": ranks,
                "transport": settings["transport"],
                "raw": RAW_LABELS[args.transport],
                "tcp": tcp.label if tcp else None,
                "settings": settings,
                "results": rows,
            },
            args.json,
        )
    if args.plot:
        report.plot_allreduce(rows, args.plot, f"allreduce on {ranks} ranks ({settings['transport']})")
    return 0


def print_table(
    args: argparse.Namespace, settings: dict[str, Any], rows: list[dict[str, Any]], tcp: str | None, out: Any
) -> None:
    """The header line and the table, to `out` (stderr when --json - takes stdout)."""
    print(
        f"# commsched allreduce on {settings['size']} ranks over {settings['transport']} (raw: "
        f"{RAW_LABELS[args.transport]}){'; tcp: ' + tcp if tcp else ''}; policy {args.policy}; "
        "time in us, algbw and busbw in GB/s, busbw = algbw * 2(n-1)/n; best of "
        f"{args.repeats} loops per size",
        file=out,
    )
    print(report.format_table(COLUMNS + (TCP_COLUMNS if tcp else []), rows), file=out)


def _measure(
    args: argparse.Namespace, raw: Any, tcp: Any = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Checks and times every size through commsched, `raw` and the TCP baseline; returns the rows and
    the settings."""
    import commsched

    ranks, rank = commsched.size(), commsched.rank()
    rows = []
    plan = sizes(
        parse_size(args.min_bytes),
        parse_size(args.max_bytes),
        args.step_factor,
        parse_size(args.step_bytes) if args.step_bytes else 0,
    )
    progress = report.Progress(len(plan), "allreduce", enabled=None if rank == 0 else False)
    for size in plan:
        count = size // 4
        buffer, raw_buffer = np.empty(count, np.float32), np.empty(count, np.float32)
        fill(buffer, rank)
        fill(raw_buffer, rank)
        # Correctness first: both paths must sum, so the timing compares like with like.
        commsched.allreduce(buffer, name="check")
        raw.allreduce(raw_buffer)
        checked = [("commsched", buffer), (RAW_LABELS[args.transport], raw_buffer)]
        if tcp is not None:
            tcp_buffer = np.empty(count, np.float32)
            fill(tcp_buffer, rank)
            tcp.allreduce(tcp_buffer)
            checked.append((tcp.label, tcp_buffer))
        for what, result in checked:
            if not check_sum(result, ranks):
                raise SystemExit(
                    f"rank {rank}: allreduce of {size} bytes through {what} returned a wrong sum"
                )
        buffer[:] = 0  # zeros stay finite however often they are summed
        iterations = iterations_for(size, args.iters, parse_size(args.budget_bytes))
        name = f"allreduce{size}"

        def through_commsched(buffer: np.ndarray = buffer, name: str = name) -> None:
            commsched.allreduce(buffer, name=name)

        def through_raw(buffer: np.ndarray = buffer) -> None:
            raw.allreduce(buffer)

        def through_tcp(buffer: np.ndarray = buffer) -> None:
            tcp.allreduce(buffer)

        for _ in range(args.warmup):
            raw.allreduce(buffer)
            through_commsched()
            if tcp is not None:
                through_tcp()
        # Alternating raw, commsched and TCP loops: drift of the machine hits all alike.
        raw_s = cs_s = tcp_s = float("inf")
        for _ in range(args.repeats):
            raw_s = min(raw_s, _time(raw, through_raw, iterations, 1))
            cs_s = min(cs_s, _time(raw, through_commsched, iterations, 1))
            if tcp is not None:
                tcp_s = min(tcp_s, _time(raw, through_tcp, iterations, 1))
        algbw, raw_algbw = size / cs_s / 1e9, size / raw_s / 1e9
        row: dict[str, Any] = {
            "size": size,
            "count": count,
            "type": "float",
            "redop": "sum",
            "iterations": iterations,
            "raw_time_us": raw_s * 1e6,
            "raw_algbw": raw_algbw,
            "raw_busbw": bus_bandwidth(raw_algbw, ranks),
            "time_us": cs_s * 1e6,
            "algbw": algbw,
            "busbw": bus_bandwidth(algbw, ranks),
            "busbw_ratio": algbw / raw_algbw,
            "time_ratio": cs_s / raw_s,
        }
        if tcp is not None:
            tcp_algbw = size / tcp_s / 1e9
            row.update(
                tcp_time_us=tcp_s * 1e6,
                tcp_algbw=tcp_algbw,
                tcp_busbw=bus_bandwidth(tcp_algbw, ranks),
                raw_tcp_ratio=raw_algbw / tcp_algbw,
                tcp_ratio=algbw / tcp_algbw,
            )
        rows.append(row)
        progress.step(report.human_size(size))
    return rows, commsched.config()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `allreduce` subcommand's flags."""
    parser.add_argument("-b", "--min-bytes", default="4", help="smallest size (default 4)")
    parser.add_argument("-e", "--max-bytes", default="256MiB", help="largest size (default 256MiB)")
    parser.add_argument(
        "-f", "--step-factor", type=float, default=2.0, help="multiply the size by this each step"
    )
    parser.add_argument("-i", "--step-bytes", default=None, help="add this many bytes each step (with -f 1)")
    parser.add_argument(
        "-n", "--iters", type=int, default=20, help="operations per timed loop (fewer when big)"
    )
    parser.add_argument("-w", "--warmup", type=int, default=3, help="untimed operations per size")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per size; the best counts")
    parser.add_argument("--budget-bytes", default="1GiB", help="cap on bytes moved per timed loop")
    parser.add_argument(
        "--transport",
        choices=("mpi", "gloo", "grpc"),
        default="mpi",
        help="mpi (raw: mpi4py Allreduce; launch with mpiexec), gloo (raw: torch.distributed.all_reduce; "
        "torchrun) or grpc (raw: commsched's gRPC ring without the core; python -m commsched.run)",
    )
    parser.add_argument(
        "--tcp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time a ring allreduce over plain TCP sockets between the same processes "
        "(default: on for --transport grpc)",
    )
    parser.add_argument(
        "--policy",
        choices=("priority", "fifo"),
        default="priority",
        help="commsched's scheduling policy (COMMSCHED_POLICY; default priority)",
    )
    unset = "unset: COMMSCHED_{} or commsched's default"
    parser.add_argument(
        "--partition-bytes", default=None, help=f"e.g. 4MiB or 0 ({unset.format('PARTITION_BYTES')})"
    )
    parser.add_argument("--credit-bytes", default=None, help=f"e.g. 8MiB ({unset.format('CREDIT_BYTES')})")
    parser.add_argument(
        "--fusion-bytes", default=None, help=f"e.g. 1MiB or 0 ({unset.format('FUSION_BYTES')})"
    )
    parser.add_argument(
        "--cycle-time", default=None, help=f"the core's cycle time, e.g. 1ms ({unset.format('CYCLE_TIME')})"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write results as JSON ('-': to stdout, and the table to stderr)"
    )
    parser.add_argument("--plot", metavar="PNG", help="write busbw against size")


if __name__ == "__main__":
    sys.exit("run it as: mpiexec -n 2 commsched-bench allreduce (see --transport for gloo and grpc)")
