"""Elastic training: recovery from a SIGKILL against torchrun's restart, and the cost of commit().

    python benchmarks/elastic_recovery.py [--trials 5] [--ranks 4] [--transport gloo] [--json F]
        [--only recovery,torchrun,commit,torchrun-elastic] [--rounds 5] [--steps 60] [--every 10]
        [--shard [--wire]]

recovery: seconds from the SIGKILL of one of 4 ranks to the next completed step at 3 ranks, under
`commsched-run -n 4 --min-np 3` (the survivors re-form without restarting). Each trial runs
tests/elastic_ranks/train.py; the rank launched as the last one SIGKILLs itself after step() of
step 3 and writes the time just before; the survivors write the time of every completed step.

torchrun-elastic: the same kill under torchrun's elastic rendezvous, one single-process agent per
rank (`--nnodes N-1:N --rdzv-backend c10d --max-restarts 0`, tests/elastic_ranks/torchrun_agents.py):
the survivors re-form through torchrun's store without restarting, over --transport (gRPC: at new
addresses exchanged through the store).

torchrun: the same kill under `torchrun --nnodes 1:1 --nproc-per-node 4 --max-restarts 1` (c10d
rendezvous, plain DDP over Gloo, a torch.save checkpoint every 5 steps): seconds from the kill to the
first step a restarted worker completes (benchmarks/elastic_workers.py).

commit: ms per step of the same training (2 ranks; --commit-ranks to change) without commits and with commit() every 10 steps,
alternating in one run (benchmarks/elastic_workers.py); the target is at most 1% more. Also printed:
the median and range of each round's own ratio (its two variants ran back to back, so a host that
other jobs load unevenly moves both alike), rank 0's CPU time per step (all its threads), the CPU
time of its commit thread per commit (the capture's own cost, as a share of a step) and of its
training thread per step with and without commits, and the cost read from steps of the same rounds: the steps from the one ending in commit() to two after it
against the median of the later steps of the interval. --shard: the
same with DistributedOptimizer(shard=True), whose commits also hand every rank's shard to the others
(on one host in shared memory); --wire: by one broadcast from each rank, as ranks on several hosts do.

Prints medians with the range and writes every trial to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "elastic_ranks"))
from torchrun_agents import run_agents

SCRIPT = ROOT / "tests" / "elastic_ranks" / "train.py"
WORKERS = ROOT / "benchmarks" / "elastic_workers.py"
CHECKPOINT_EVERY = 5  # steps between torchrun's disk checkpoints


def trial(ranks: int, transport: str, timeout_s: float) -> float:
    """One elastic run with one SIGKILL; returns seconds from the kill to the next step at ranks - 1."""
    with tempfile.TemporaryDirectory(prefix="elastic-recovery-") as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        env.update(
            ELASTIC_OUT=out,
            ELASTIC_TIMES="1",
            ELASTIC_KILL=f"{ranks - 1}:0:3",
            COMMSCHED_TRANSPORT=transport,
        )
        command = [sys.executable, "-m", "commsched.run", "-n", str(ranks), "--min-np", str(ranks - 1)]
        done = subprocess.run(
            [*command, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the elastic run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return _recovery_s(Path(out), ranks)


def torchrun_elastic_trial(ranks: int, transport: str, timeout_s: float) -> float:
    """One run under torchrun's elastic rendezvous with one SIGKILL; returns seconds from the kill to
    the next step at ranks - 1."""
    with tempfile.TemporaryDirectory(prefix="torchrun-elastic-") as out:
        output = run_agents(
            Path(out),
            SCRIPT,
            ranks,
            ranks - 1,
            ranks - 1,
            timeout_s,
            ELASTIC_TIMES="1",
            ELASTIC_KILL=f"{ranks - 1}:0:3",
            COMMSCHED_TRANSPORT=transport,
        )
        if output.count(f" of {ranks - 1} done") < ranks - 1:
            raise RuntimeError(f"the torchrun elastic run failed:\n{output[-3000:]}")
        return _recovery_s(Path(out), ranks)


def _recovery_s(out: Path, ranks: int) -> float:
    """Seconds from the last rank's kill to the first step a survivor completed at ranks - 1."""
    killed = _times(out / f"times.{ranks - 1}", "fault")[0]
    after = [
        when
        for member in range(ranks - 1)
        for when in _times(out / f"times.{member}", f"step {ranks - 1}")
        if when > killed
    ]
    return min(after) - killed


def _times(path: Path, what: str) -> list[float]:
    lines = path.read_text().splitlines()
    return [float(line.split(" ", 1)[0]) for line in lines if line.split(" ", 1)[1] == what]


def torchrun_trial(ranks: int, timeout_s: float) -> float:
    """One torchrun run with one SIGKILL; returns seconds from the kill to the first step after the restart."""
    with tempfile.TemporaryDirectory(prefix="torchrun-restart-") as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        torchrun = Path(sys.executable).with_name("torchrun")
        command = [
            str(torchrun),
            "--nnodes",
            "1:1",
            "--nproc-per-node",
            str(ranks),
            "--max-restarts",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{_free_port()}",
            str(WORKERS),
            "torchrun",
            out,
            str(CHECKPOINT_EVERY),
        ]
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the torchrun run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        killed = _times(Path(out) / f"times.0.{ranks - 1}", "fault")[0]
        after = [
            float(line.split(" ", 1)[0])
            for rank in range(ranks)
            for line in (Path(out) / f"times.1.{rank}").read_text().splitlines()
        ]
        return min(after) - killed


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def commit_cost(
    rounds: int,
    steps: int,
    every: int,
    timeout_s: float,
    shard: bool = False,
    wire: bool = False,
    ranks: int = 2,
) -> dict[str, object]:
    """ms per step without and with commits at `ranks` ranks, from one run (elastic_workers.py commit)."""
    with tempfile.TemporaryDirectory(prefix="commit-cost-") as out:
        result = Path(out) / "commit.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        command = [
            sys.executable,
            "-m",
            "commsched.run",
            "-n",
            str(ranks),
            str(WORKERS),
            "commit",
            str(result),
        ]
        done = subprocess.run(
            [
                *command,
                str(rounds),
                str(steps),
                str(every),
                *(["shard"] if shard else []),
                *(["wire"] if wire else []),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the commit-cost run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(result.read_text())


def _by_position(times: list[list[float]], every: int) -> dict[str, float]:
    """The cost of a commit from steps of the same rounds: the first steps from the one that ends in
    commit() (where its capture runs) against the median step of the rest of the interval."""
    near = min(3, every - 1)
    medians = [statistics.median(t) if t else 0.0 for t in times]
    far = statistics.median([t for p in range(near, every) for t in times[p]])
    extra = sum(medians[p] - far for p in range(near))
    return {"near": near, "far_ms": far, "extra_ms": extra, "percent": 100 * extra / (every * far)}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    """Runs the measurements, prints a table and writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="kills per launcher (default 5)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks at the start (default 4)")
    parser.add_argument(
        "--transport",
        default="gloo",
        choices=("gloo", "grpc"),
        help="recovery and torchrun-elastic (default gloo)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per run before it counts as hung"
    )
    parser.add_argument("--only", default="recovery,torchrun,commit", help="measurements to run")
    parser.add_argument("--rounds", type=int, default=5, help="commit: rounds of each variant (default 5)")
    parser.add_argument("--steps", type=int, default=60, help="commit: steps per round (default 60)")
    parser.add_argument("--every", type=int, default=10, help="commit: steps between commits (default 10)")
    parser.add_argument(
        "--commit-ranks",
        type=int,
        default=2,
        help="commit: ranks of the measurement (default 2; 1 leaves this 2-core host a core for the capture)",
    )
    parser.add_argument(
        "--shard",
        action="store_true",
        help="commit: DistributedOptimizer(shard=True) (its commits hand every rank's shard over)",
    )
    parser.add_argument(
        "--wire",
        action="store_true",
        help="commit --shard: the shards go by broadcasts (as across hosts), not in shared memory",
    )
    parser.add_argument("--json", type=Path, help="write every trial here")
    args = parser.parse_args()
    chosen = set(args.only.split(","))
    if args.wire and not args.shard:
        parser.error("--wire applies to sharded commits: add --shard")
    if chosen - {"recovery", "torchrun", "commit", "torchrun-elastic"}:
        parser.error(f"--only {args.only!r}: choose from recovery, torchrun, commit, torchrun-elastic")
    report: dict[str, object] = {"ranks": args.ranks, "transport": args.transport}
    rows = []
    for name, run in (
        ("recovery", lambda: trial(args.ranks, args.transport, args.timeout)),
        ("torchrun-elastic", lambda: torchrun_elastic_trial(args.ranks, args.transport, args.timeout)),
        ("torchrun", lambda: torchrun_trial(args.ranks, args.timeout)),
    ):
        if name not in chosen:
            continue
        seconds = []
        for number in range(args.trials):
            seconds.append(run())
            print(f"{name} trial {number + 1}: {seconds[-1]:.2f} s", flush=True)
        report[name] = {"seconds": seconds, **_summary(seconds)}
        what = {
            "recovery": f"commsched-run --min-np {args.ranks - 1} ({args.transport})",
            "torchrun-elastic": f"torchrun --nnodes {args.ranks - 1}:{args.ranks}, commsched re-forms ({args.transport})",
            "torchrun": f"torchrun --max-restarts 1, checkpoint every {CHECKPOINT_EVERY} steps",
        }[name]
        rows.append((what, _summary(seconds), "s"))
    if "commit" in chosen:
        cost = commit_cost(
            args.rounds, args.steps, args.every, args.timeout * 4, args.shard, args.wire, args.commit_ranks
        )
        ms = cost["ms_per_step"]  # type: ignore[index]
        none, commit = _summary(ms["none"]), _summary(ms["commit"])
        cost["overhead_percent"] = 100 * (commit["median"] / none["median"] - 1)
        # Each round runs both variants back to back: its ratio is the least touched by the host's drift.
        paired = [100 * (c / n - 1) for n, c in zip(ms["none"], ms["commit"], strict=True)]
        cost["paired_percent"] = _summary(paired)
        used = cost["cpu_ms_per_step"]  # type: ignore[index]
        cpu_none, cpu_commit = statistics.median(used["none"]), statistics.median(used["commit"])
        cost["cpu_overhead_percent"] = 100 * (cpu_commit / cpu_none - 1)
        cost["by_position"] = _by_position(cost["ms_by_position"], args.every)  # type: ignore[index]
        training = cost["training_cpu_ms_per_step"]  # type: ignore[index]
        committer = cost["commit_thread_cpu_ms_per_step"]  # type: ignore[index]
        cost["commit_thread_percent"] = (
            100 * statistics.median(committer) / none["median"] if committer else None
        )
        cost["training_cpu_overhead_percent"] = 100 * (
            statistics.median(training["commit"]) / statistics.median(training["none"]) - 1
        )
        report["commit"] = cost
        sharded = (", shard=True" if args.shard else "") + (", broadcasts" if args.wire else "")
        at = f"{args.commit_ranks} rank{'s' if args.commit_ranks > 1 else ''}{sharded}"
        rows.append((f"{at}, no commits", none, "ms/step"))
        rows.append((f"{at}, commit() every {args.every} steps", commit, "ms/step"))
    print(f"\n| {'measurement':<56} | median | range | unit |")
    for what, summary, unit in rows:
        spread = f"{summary['min']:.2f}-{summary['max']:.2f}"
        print(f"| {what:<56} | {summary['median']:.2f} | {spread} | {unit} |")
    if "commit" in report:
        inside = statistics.median(cost["ms_in_commit"])  # type: ignore[index]
        pair = cost["paired_percent"]  # type: ignore[index]
        near = cost["by_position"]  # type: ignore[index]
        print(
            f"commit() every {args.every} steps: {cost['overhead_percent']:+.2f}% per step "  # type: ignore[index]
            f"(per round {pair['median']:+.2f}%, {pair['min']:+.2f}% to {pair['max']:+.2f}%), "
            f"{inside:.2f} ms inside each commit() call (median), "
            f"{cost['cpu_overhead_percent']:+.2f}% CPU time of rank 0's process per step"  # type: ignore[index]
        )
        if cost["commit_thread_percent"] is not None:  # type: ignore[index]
            per_commit = statistics.median(cost["commit_thread_cpu_ms_per_step"]) * args.every  # type: ignore[index]
            print(
                f"the commit thread: {per_commit:.2f} ms of CPU per commit, "
                f"{cost['commit_thread_percent']:.2f}% of a step without commits; "  # type: ignore[index]
                f"the training thread's CPU per step {cost['training_cpu_overhead_percent']:+.2f}%"  # type: ignore[index]
            )
        print(
            f"by position after commit(): the {near['near']} steps from the one ending in commit() take "
            f"{near['extra_ms']:+.2f} ms more than the median of the later ones ({near['far_ms']:.2f} ms): "
            f"{near['percent']:+.2f}% per step"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
