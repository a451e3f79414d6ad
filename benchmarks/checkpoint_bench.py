#!/usr/bin/env python3
"""What a checkpoint every N iterations costs: VGG-style training on 2 ranks over a shaped link.

All variants train with commsched (priority, overlap_forward by default) in one invocation on
the same rig (benchmarks/netrig.py: network namespaces and tc, needs root):

    none         no checkpoints
    checkpointer commsched.torch.Checkpointer.save() every N iterations
    torch_save   rank 0 torch.save()s model and optimizer state (flushed, fsynced), then a barrier
    dcp_async    torch.distributed.checkpoint.async_save on its own Gloo group

    python benchmarks/checkpoint_bench.py                        # table, JSON to checkpoint_bench.json
    python benchmarks/checkpoint_bench.py --iterations 40 --every 10 --mode barrier

Reports seconds per iteration (every iteration counted, checkpoints included), the slowdown
against no checkpoints, the longest step, and the time from the save call to a durable version.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from torch_vgg import _batch, calibrate, vgg

RESULT_TAG = "CHECKPOINT_BENCH_RESULT "
VARIANTS = {
    "none": "no checkpoints",
    "checkpointer": "commsched Checkpointer (background)",
    "torch_save": "torch.save on rank 0 + barrier",
    "dcp_async": "torch.distributed.checkpoint.async_save",
}


class _Saver:
    """One way of saving; save() is called at the iteration boundary, finish() after the last step."""

    def __init__(self, variant: str, model: Any, optimizer: Any, directory: Path) -> None:
        import commsched.torch as ct

        import commsched

        self.variant, self.model, self.optimizer, self.directory = variant, model, optimizer, directory
        self.durable: list[float] = []
        self._pending: tuple[float, Any] | None = None
        self._rank = commsched.rank()
        if variant == "checkpointer":
            self._checkpointer = ct.Checkpointer(model, optimizer, directory / "ckpt", keep=2)
        if variant == "dcp_async":
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")

    def save(self, step: int) -> None:
        """Starts (or does) one checkpoint."""
        import commsched.torch as ct

        started = time.perf_counter()
        if self.variant == "checkpointer":
            if self._checkpointer.last_durable_seconds is not None:
                self.durable.append(self._checkpointer.last_durable_seconds)
            self._checkpointer.save(step)
        elif self.variant == "torch_save":
            if self._rank == 0:
                state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
                path = self.directory / f"step-{step}.pt"
                with open(path, "wb") as file:
                    torch.save(state, file)
                    file.flush()
                    os.fsync(file.fileno())
            ct.allreduce(torch.zeros(1), name=f"bench.barrier.{step}")
            self.durable.append(time.perf_counter() - started)
        elif self.variant == "dcp_async":
            import torch.distributed.checkpoint as dcp

            self._collect()
            if self._pending is not None:
                self._pending[1].result()  # one save at a time, as the Checkpointer does
                self._collect()
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            future = dcp.async_save(
                state, checkpoint_id=str(self.directory / f"dcp-{step}"), process_group=self._group
            )
            future.add_done_callback(lambda _f, s=started: setattr(self, "_done_at", time.perf_counter() - s))
            self._pending = (started, future)

    def _collect(self) -> None:
        if self._pending is not None and self._pending[1].done():
            self._pending[1].result()
            self.durable.append(getattr(self, "_done_at", time.perf_counter() - self._pending[0]))
            self._pending = None

    def finish(self) -> None:
        """Waits for the last checkpoint."""
        if self.variant == "checkpointer":
            self._checkpointer.wait()
            if self._checkpointer.last_durable_seconds is not None:
                self.durable.append(self._checkpointer.last_durable_seconds)
        elif self.variant == "dcp_async" and self._pending is not None:
            self._pending[1].result()
            self._collect()


def worker(variant: str, args: argparse.Namespace) -> None:
    """Runs inside a rank: trains and (rank 0) prints the timing as JSON."""
    torch.set_num_threads(1)
    import commsched.torch as ct

    import commsched

    torch.manual_seed(0)
    model = vgg()
    commsched.init(transport="gloo", policy="priority")
    optimizer = ct.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, overlap_forward=args.mode == "overlap"
    )
    directory = Path(args.directory)
    saver = _Saver(variant, model, optimizer, directory) if variant != "none" else None
    x, y = _batch(args.batch)
    times = []
    for it in range(args.warmup + args.iterations):
        if it == args.warmup:
            optimizer.synchronize()
            started = time.perf_counter()
        step_started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if saver is not None and it >= args.warmup and (it - args.warmup + 1) % args.every == 0:
            saver.save(it)
        times.append(time.perf_counter() - step_started)
    optimizer.synchronize()
    if saver is not None:
        saver.finish()
    elapsed = time.perf_counter() - started
    if commsched.rank() == 0:
        result = {
            "variant": variant,
            "seconds_per_iteration": elapsed / args.iterations,
            "median_step": statistics.median(times[args.warmup :]),
            "max_step": max(times[args.warmup :]),
            "save_to_durable_seconds": saver.durable if saver else [],
        }
        print(RESULT_TAG + json.dumps(result), flush=True)
    commsched.shutdown()


def _run_variant(rig: Any, variant: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix=f"ckbench-{variant}-", dir=args.scratch))
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--directory", str(directory)]
    argv += ["--batch", str(args.batch), "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
    argv += ["--every", str(args.every), "--mode", args.mode]
    env = {
        "OMP_NUM_THREADS": "1",
        "COMMSCHED_PARTITION_BYTES": args.partition,
        "COMMSCHED_CREDIT_BYTES": args.credit,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    from local_ranks import run_on_rig

    try:
        return run_on_rig(rig, argv, env, port, args.timeout, RESULT_TAG, variant)
    except RuntimeError as error:  # a failed variant is a row of the table, not the end of the run
        return {"variant": variant, "error": str(error)[-1500:]}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Runs every variant on one rig, prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per iteration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many iterations")
    parser.add_argument("--mode", choices=["overlap", "barrier"], default="overlap")
    parser.add_argument(
        "--rate", default="auto", help='link rate ("1gbit"), or "auto": communication = compute'
    )
    parser.add_argument("--partition", default="2MiB")
    parser.add_argument("--credit", default="4MiB")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--scratch", default=None, help="where checkpoints are written (default: the temp dir)"
    )
    parser.add_argument("--json", default="checkpoint_bench.json", help="where the results go")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args)
        return 0

    from netrig import NetRig, available, expected_allreduce_seconds, parse_rate

    ok, why = available()
    if not ok:
        print(f"checkpoint_bench needs the shaped-network rig: {why}", file=sys.stderr)
        return 2
    compute_s, nbytes = calibrate(args.batch)
    if args.rate == "auto":
        probe = 1e9
        rate = f"{probe * expected_allreduce_seconds(nbytes, 2, probe) / compute_s / 1e6:.0f}mbit"
    else:
        rate = args.rate
    comm_s = expected_allreduce_seconds(nbytes, 2, parse_rate(rate))
    print(
        f"VGG-style model, {nbytes / 2**20:.1f} MiB of parameters (AdamW: {3 * nbytes / 2**20:.0f} MiB of state), "
        f"batch {args.batch}/rank, {args.mode} mode; compute {1e3 * compute_s:.0f} ms, link {rate}: allreduce "
        f"{1e3 * comm_s:.0f} ms; a checkpoint every {args.every} of {args.iterations} iterations"
    )
    results = []
    with NetRig(n_ranks=2, rate=rate) as rig:
        for k, variant in enumerate(args.variants.split(",")):
            result = _run_variant(rig, variant, args, 29600 + k)
            results.append(result)
            status = (
                "failed"
                if "error" in result
                else f"{1e3 * result['seconds_per_iteration']:8.1f} ms/iteration"
            )
            print(f"  {variant:13s} {status}", flush=True)
    baseline = next(
        (r["seconds_per_iteration"] for r in results if r["variant"] == "none" and "error" not in r), None
    )
    print(f"\n{'variant':<42s} {'ms/iter':>8s} {'vs none':>8s} {'max step':>9s} {'to durable (ms)':>16s}")
    for result in results:
        if "error" in result:
            print(
                f"{VARIANTS[result['variant']]:<42s} failed: {result['error'].strip().splitlines()[-1][:80]}"
            )
            continue
        ms = 1e3 * result["seconds_per_iteration"]
        slower = f"{100 * (result['seconds_per_iteration'] / baseline - 1):+.1f}%" if baseline else "-"
        durable = result["save_to_durable_seconds"]
        durable_text = f"{1e3 * statistics.median(durable):.0f}" if durable else "-"
        print(
            f"{VARIANTS[result['variant']]:<42s} {ms:8.1f} {slower:>8s} {1e3 * result['max_step']:9.1f} {durable_text:>16s}"
        )
    report = {
        "model": "vgg-style (3 conv, 3 fc), AdamW",
        "parameter_bytes": nbytes,
        "batch_per_rank": args.batch,
        "mode": args.mode,
        "rate": rate,
        "every": args.every,
        "iterations": args.iterations,
        "compute_seconds": compute_s,
        "allreduce_seconds_expected": comm_s,
        "results": results,
    }
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
