#!/usr/bin/env python3
"""Faults from outside at random times: SIGKILL and SIGSTOP of random ranks of elastic jobs.

    python benchmarks/elastic_chaos.py --trials 20 [--seed 1] [--json results.json]

Each trial launches `commsched-run -n N --min-np 2 --elastic-timeout 3` (N 3 or 4) over
tests/elastic_ranks/train.py (10 epochs, 50 ms of sleep per step so a run lasts about 15 s), over Gloo
or gRPC, with DistributedOptimizer plain, `overlap_forward=True` or `shard=True`, all drawn from the
seed. One or (at 4 ranks) two faults go to random ranks at random times from 0.3 s to 6 s apart,
from this process: whatever the rank was doing (importing, starting commsched, backward, step(),
commit(), re-forming), with the stall limits at 1 s / 3 s. A trial passes when the job exits 0
within 120 s, ends at the size its faults left, and saw every sample once per epoch (more only as
the sampler's padding of an uneven rest after a resize, fewer than the ranks left); with
one fault its final weights must equal those of a run started at the smaller size from the commit
the survivors restored (or from scratch, when the rank was lost before training began). Prints a
table of the trials and the failures with their stderr's end; writes every trial to --json.

With `--launcher torchrun` each trial starts one single-worker torchrun agent per rank under one c10d
rendezvous (`--nnodes 2:N --max-restarts 0`, tests/elastic_ranks/torchrun_agents.py) and faults the
workers launched as 1 to N-1, the first 3-12 s after the launch, the next 0.3-6 s later (the agent
of worker 0 hosts torchrun's stores, whose loss ends such a job by design). The same verdict, with
one more ending that passes: a worker lost before its transport met the others' cannot be told
from a slow one under torchrun, so the others may instead end within the stall limit naming it
(Gloo: never arrived; gRPC: did not join). Every agent must end within 120 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "elastic_ranks" / "train.py"
SAMPLES = 48  # as in the rank script
EPOCHS = 10
HANG_S = 120.0


def _environment(out: Path, transport: str, variant: str, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")
    }
    env.update(
        ELASTIC_OUT=str(out),
        ELASTIC_EPOCHS=str(EPOCHS),
        ELASTIC_STEP_SLEEP="0.05",
        COMMSCHED_TRANSPORT=transport,
        COMMSCHED_STALL_TIMEOUT="1",
        COMMSCHED_STALL_SHUTDOWN="3",
        **extra,
    )
    if variant == "overlap":
        env["ELASTIC_OVERLAP"] = "1"
    elif variant == "shard":
        env["ELASTIC_SHARD"] = "1"
    return env


def _children(pid: int, count: int, process: subprocess.Popen[str]) -> list[int]:
    """The launcher's rank processes in launch order (their pids grow with it)."""
    found: list[int] = []
    while len(found) < count and process.poll() is None:
        try:
            found = sorted(int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
        except OSError:
            pass
        time.sleep(0.01)
    return found


def trial(number: int, rng: random.Random, work: Path) -> dict[str, Any]:
    """One job with its faults; the verdict and what was sent when."""
    transport = rng.choice(["gloo", "grpc"])
    ranks = rng.choice([3, 4])
    variant = rng.choice(["plain", "plain", "overlap", "shard"])
    plan, at = [], 0.0
    for _ in range(rng.choice([1, 1, 2]) if ranks == 4 else 1):
        at += rng.uniform(0.3, 6.0)
        plan.append((at, rng.choice(["SIGKILL", "SIGKILL", "SIGSTOP"]), rng.randrange(ranks)))
    out = work / f"trial{number}"
    out.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "commsched.run",
        "-n",
        str(ranks),
        "--min-np",
        "2",
        "--elastic-timeout",
        "3",
    ]
    started = time.monotonic()
    process = subprocess.Popen(
        [*command, str(SCRIPT)],
        env=_environment(out, transport, variant),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = _children(process.pid, ranks, process)
    sent: list[dict[str, Any]] = []
    for when, name, victim in plan:
        while time.monotonic() - started < when and process.poll() is None:
            time.sleep(0.005)
        if process.poll() is not None or victim >= len(pids):
            break
        try:
            os.kill(pids[victim], getattr(signal, name))
        except ProcessLookupError:
            continue  # that rank is gone already
        sent.append({"s": round(time.monotonic() - started, 2), "signal": name, "rank": victim})
    result: dict[str, Any] = {"transport": transport, "ranks": ranks, "variant": variant, "faults": sent}
    try:
        _, stderr = process.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        process.kill()
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _, stderr = process.communicate()
        return dict(result, verdict=f"hang (> {HANG_S:g} s)", seconds=HANG_S, stderr=stderr[-4000:])
    result.update(seconds=round(time.monotonic() - started, 1), stderr=stderr[-4000:])
    result["verdict"] = _verdict(process.returncode, out, ranks - len({f["rank"] for f in sent}), sent)
    if result["verdict"] == "ok" and len(sent) == 1:
        result["verdict"] = _same_as_restarted(out, transport, variant)
    return result


def torchrun_trial(number: int, rng: random.Random, work: Path) -> dict[str, Any]:
    """One job under torchrun's agents with its faults; the verdict and what was sent when."""
    sys.path.insert(0, str(ROOT / "tests" / "elastic_ranks"))
    from torchrun_agents import run_agents

    transport = rng.choice(["gloo", "grpc"])
    ranks = rng.choice([3, 4])
    variant = rng.choice(["plain", "plain", "overlap", "shard"])
    plan, at = [], rng.uniform(2.7, 6.0)  # the workers' imports take the first 4-5 s here
    for _ in range(rng.choice([1, 1, 2]) if ranks == 4 else 1):
        at += rng.uniform(0.3, 6.0)
        plan.append((at, rng.choice(["SIGKILL", "SIGKILL", "SIGSTOP"]), rng.randrange(1, ranks)))
    out = work / f"trial{number}"
    environment = _environment(out, transport, variant, COMMSCHED_ELASTIC_TIMEOUT="3")
    extra = {k: v for k, v in environment.items() if k.startswith(("ELASTIC_", "COMMSCHED_"))}
    extra.pop("ELASTIC_OUT")
    output: list[str] = []
    started = time.monotonic()
    runner = threading.Thread(
        target=lambda: output.append(
            run_agents(out, SCRIPT, ranks, 2, ranks, HANG_S, wait_agents=True, **extra)
        )
    )
    runner.start()
    sent: list[dict[str, Any]] = []
    for when, name, victim in plan:
        while time.monotonic() - started < when and runner.is_alive():
            time.sleep(0.005)
        pid_file = out / f"pid.{victim}"
        while not pid_file.exists() and runner.is_alive():  # still importing: faulted once it is not
            time.sleep(0.005)
        try:
            os.kill(int(pid_file.read_text()), getattr(signal, name))
        except (OSError, ValueError):
            continue  # the job ended, or that worker is gone already
        sent.append({"s": round(time.monotonic() - started, 2), "signal": name, "rank": victim})
    runner.join()
    text = output[0] if output else ""
    result: dict[str, Any] = {"transport": transport, "ranks": ranks, "variant": variant, "faults": sent}
    result.update(seconds=round(time.monotonic() - started, 1), stderr=text[-4000:])
    if "--- agents ended at " not in text:
        return dict(result, verdict=f"hang (> {HANG_S:g} s)")
    lost = sorted({f["rank"] for f in sent})
    survivors = [node for node in range(ranks) if node not in lost]
    # A worker lost before its transport met the others': Gloo's rendezvous names it as never
    # arrived, gRPC's first meeting as not joined; the others end within the stall limit.
    listed = re.findall(r"ranks? ([\d, ]+) never arrived", text) + re.findall(
        r"ranks \[([\d, ]+)\] did not join", text
    )
    if listed:
        named = {int(rank) for names in listed for rank in names.split(",")}
        result["verdict"] = "ok (named lost before start)" if named <= set(lost) else f"named {sorted(named)}"
        return result
    logs = {
        int(node): log
        for node, log in re.findall(r"--- agent (\d+)\n(.*?)(?=--- agent |\Z)", text, re.DOTALL)
    }
    starting = [
        node
        for node in survivors
        if "in _init_here" in logs.get(node, "")
        or "so commsched.elastic.run() is refused" in logs.get(node, "")
    ]
    if starting and not any(" done\n" in logs.get(node, "") for node in survivors):
        # Lost while init() started the transport or before the worker group was recorded: the
        # survivors' init() or run fails naming it (torchrun's agents then end the other workers).
        named = any(f"rank {victim}" in logs[node] for node in starting for victim in lost)
        result["verdict"] = "ok (ended while starting)" + ("" if named else ", rank not named")
        return result
    exits = {int(node): int(code) for node, code in re.findall(r"--- agent (\d+) exit (-?\d+)", text)}
    if any(exits.get(node) != 0 for node in survivors):
        return dict(result, verdict=f"agent exit statuses {exits}")
    result["verdict"] = _verdict(0, out, ranks - len(lost), sent)
    if result["verdict"] == "ok" and len(sent) == 1:
        result["verdict"] = _same_as_restarted(out, transport, variant)
    return result


def _verdict(code: int, out: Path, expected_size: int, sent: list[dict[str, Any]]) -> str:
    import torch

    if code != 0:
        return f"exit status {code}"
    final = torch.load(out / "final.pt", weights_only=False)
    if sent and final["size"] != expected_size:
        return f"ended at {final['size']} ranks, not {expected_size}"
    for epoch, seen in enumerate(final["seen"]):
        # 48 samples split evenly over 2, 3 and 4 ranks: a repeat is the sampler's padding of an
        # epoch's uneven rest after a resize, fewer than the ranks it ended at.
        if set(seen) != set(range(SAMPLES)):
            return f"epoch {epoch}: samples dropped"
        if not 0 <= len(seen) - SAMPLES < final["size"]:
            return f"epoch {epoch}: {len(seen) - SAMPLES} samples repeated"
    return "ok"


def _same_as_restarted(out: Path, transport: str, variant: str) -> str:
    """With one fault: the final weights equal a run at the final size from the restored commit."""
    import torch

    final = torch.load(out / "final.pt", weights_only=False)
    restored = out / "restored.pt"
    start = {"ELASTIC_START": str(restored)} if restored.exists() else {}
    reference = out / "reference"
    reference.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "commsched.run", "-n", str(final["size"]), str(SCRIPT)],
        env=_environment(reference, transport, variant, **start),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    if done.returncode != 0:
        return f"the reference run failed ({done.returncode})"
    expected = torch.load(reference / "final.pt", weights_only=False)
    if not torch.equal(final["weight"], expected["weight"]):
        return "final weights differ from a run started at the smaller size"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write every trial here")
    parser.add_argument("--launcher", choices=["commsched-run", "torchrun"], default="commsched-run")
    parser.add_argument("--work", type=Path, help="keep each trial's files (logs, results) here")
    args = parser.parse_args()
    run_trial = torchrun_trial if args.launcher == "torchrun" else trial
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="elastic-chaos-") as scratch:
        work = args.work or Path(scratch)
        for number in range(args.trials):
            result = run_trial(number, rng, work)
            results.append(result)
            faults = (
                ", ".join(f"{f['signal']} rank {f['rank']} at {f['s']} s" for f in result["faults"])
                or "none sent"
            )
            print(
                f"| {number:>3} | {result['transport']:<4} | {result['ranks']} | {result['variant']:<7} | "
                f"{faults:<48} | {result['seconds']:>6} s | {result['verdict']} |",
                flush=True,
            )
    failed = [r for r in results if not r["verdict"].startswith("ok")]
    print(f"\n{len(results) - len(failed)} of {len(results)} trials passed")
    for result in failed:
        print(
            f"\n--- {result['verdict']}: {result['transport']}, {result['ranks']} ranks, {result['faults']}"
        )
        print(result["stderr"][-2000:])
    if args.json:
        args.json.write_text(
            json.dumps({"seed": args.seed, "launcher": args.launcher, "trials": results}, indent=1)
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
