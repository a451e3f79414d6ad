"""How long TorchState.commit() holds the training thread, by the number of parameters.

    python benchmarks/commit_call.py [--layers 4,80,200] [--ranks 1,2] [--runs 3] [--shard] [--json F]

Each run is its own `commsched-run -n RANKS` job: a stack of LAYERS `Linear(64, 64)` layers (2 x LAYERS
parameters) under DistributedOptimizer over Adam, one small step between commits, one commit() every 4
steps; rank 0 reports the median wall and CPU time (`time.thread_time()`) of its commit() calls after
the first five, and the CPU time of the commit thread's capture of each commit (the copies and
their bookkeeping, beside the training). The cost per step is elastic_recovery.py --only commit's.
Prints the median over the runs with the range, and writes every run to --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

COMMITS = 30  # commit() calls per run; the first five are left out (buffers allocated, plans made)


def worker(out: Path, layers: int, shard: bool) -> None:
    """One rank: trains and commits; rank 0 writes the medians of its commit() calls to `out`."""
    import commsched.torch as hvd
    import torch
    from commsched.torch import elastic_commit
    from commsched.torch.elastic import TorchState

    capture: list[float] = []  # CPU ms of the commit thread per commit (its copies and bookkeeping)
    run_capture = elastic_commit.BackgroundCommit._run

    def timed_capture(self: Any, *args: Any) -> None:
        used = time.thread_time()
        run_capture(self, *args)
        capture.append((time.thread_time() - used) * 1000)

    elastic_commit.BackgroundCommit._run = timed_capture  # type: ignore[method-assign]

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4), named_parameters=model.named_parameters(), shard=shard
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = TorchState(model, optimizer, epoch=0)
    data = torch.randn(16, 64)
    wall: list[float] = []
    cpu: list[float] = []
    for step in range(4 * COMMITS):
        optimizer.zero_grad()
        model(data).sum().backward()
        optimizer.step()
        if step % 4 == 3:
            started, used = time.perf_counter(), time.thread_time()
            state.commit()
            wall.append((time.perf_counter() - started) * 1000)
            cpu.append((time.thread_time() - used) * 1000)
    if hvd.rank() == 0:
        report = {
            "wall_ms": statistics.median(wall[5:]),
            "cpu_ms": statistics.median(cpu[5:]),
            "capture_cpu_ms": statistics.median(capture[5:]),
        }
        out.write_text(json.dumps(report))
    hvd.shutdown()


def run(ranks: int, layers: int, shard: bool) -> dict[str, float]:
    """One job; returns rank 0's medians."""
    with tempfile.TemporaryDirectory(prefix="commit-call-") as folder:
        out = Path(folder) / "out.json"
        command = [sys.executable, "-m", "commsched.run", "-n", str(ranks), sys.executable, __file__]
        command += ["--worker", str(out), "--layers", str(layers)] + (["--shard"] if shard else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", default="4,80,200", help="Linear(64, 64) layers per model, comma-separated"
    )
    parser.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shard", action="store_true", help="DistributedOptimizer(shard=True)")
    parser.add_argument("--json", default="out/commit_call.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), int(args.layers), args.shard)
        return
    rows = []
    print(f"{'ranks':>5} {'parameters':>10} {'commit() ms':>20} {'CPU ms':>20} {'capture CPU ms':>20}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        for layers in (int(n) for n in args.layers.split(",")):
            runs = [run(ranks, layers, args.shard) for _ in range(args.runs)]
            rows.append({"ranks": ranks, "parameters": 2 * layers, "shard": args.shard, "runs": runs})
            cells = []
            for key in ("wall_ms", "cpu_ms", "capture_cpu_ms"):
                values = [r[key] for r in runs]
                cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
            print(f"{ranks:>5} {2 * layers:>10} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
