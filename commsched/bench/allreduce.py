"""`commsched-bench allreduce`: the nccl-tests table for commsched and, on the same sizes in the
same run, for the raw library underneath (mpi4py Allreduce or torch.distributed.all_reduce)."""

from __future__ import annotations

import argparse
import statistics
import sys
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

        if not dist.is_initialized():
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

    raw: Any = RawTorch() if args.transport == "gloo" else RawMPI()
    commsched.init(
        transport=args.transport,
        policy=args.policy,
        fusion_bytes=args.fusion_bytes,
        partition_bytes=args.partition_bytes,
        credit_bytes=args.credit_bytes,
        cycle_time=args.cycle_time,
    )
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
        buffer = np.ones(count, np.float32)
        # Correctness first: both paths must sum, so the timing compares like with like.
        commsched.allreduce(buffer, name="check")
        raw_buffer = np.ones(count, np.float32)
        raw.allreduce(raw_buffer)
        if count and not (np.all(buffer == ranks) and np.all(raw_buffer == ranks)):
            raise SystemExit(f"rank {rank}: allreduce of {size} bytes returned a wrong sum")
        buffer[:] = 0  # zeros stay finite however often they are summed
        iterations = iterations_for(size, args.iters, parse_size(args.budget_bytes))
        name = f"allreduce{size}"

        def through_commsched(buffer: np.ndarray = buffer, name: str = name) -> None:
            commsched.allreduce_async(buffer, name=name).wait()

        def through_raw(buffer: np.ndarray = buffer) -> None:
            raw.allreduce(buffer)

        for _ in range(args.warmup):
            raw.allreduce(buffer)
            through_commsched()
        # Alternating raw and commsched loops: drift of the machine hits both alike.
        raw_s = cs_s = float("inf")
        for _ in range(args.repeats):
            raw_s = min(raw_s, _time(raw, through_raw, iterations, 1))
            cs_s = min(cs_s, _time(raw, through_commsched, iterations, 1))
        algbw, raw_algbw = size / cs_s / 1e9, size / raw_s / 1e9
        rows.append(
            {
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
        )
        progress.step(report.human_size(size))
    settings = commsched.config()
    commsched.shutdown()
    if rank != 0:
        return 0
    print(
        f"# commsched allreduce on {ranks} ranks over {settings['transport']} (raw: "
        f"{'torch.distributed gloo' if args.transport == 'gloo' else 'mpi4py Allreduce'}); policy {args.policy}; "
        "time in us, algbw and busbw in GB/s, busbw = algbw * 2(n-1)/n; best of "
        f"{args.repeats} loops per size"
    )
    print(report.format_table(COLUMNS, rows))
    if args.json:
        report.dump_json(
            {"ranks": ranks, "transport": settings["transport"], "settings": settings, "results": rows},
            args.json,
        )
    if args.plot:
        report.plot_allreduce(rows, args.plot, f"allreduce on {ranks} ranks ({settings['transport']})")
    return 0


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
    parser.add_argument("--transport", choices=("mpi", "gloo"), default="mpi")
    parser.add_argument("--policy", choices=("priority", "fifo"), default="priority")
    parser.add_argument("--partition-bytes", default=None)
    parser.add_argument("--credit-bytes", default=None)
    parser.add_argument("--fusion-bytes", default=None)
    parser.add_argument("--cycle-time", default=None)
    parser.add_argument("--json", metavar="PATH", help="write results as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="PNG", help="write busbw against size")


if __name__ == "__main__":
    sys.exit("run it as: mpiexec -n 2 commsched-bench allreduce")
