"""The ranks of benchmarks/elastic_recovery.py: the cost of commit() and torchrun's restart from disk.

    commsched-run -n 2 benchmarks/elastic_workers.py commit OUT.json ROUNDS STEPS EVERY [shard [wire]]
    torchrun --nnodes 1:1 --nproc-per-node 4 --max-restarts 1 ... benchmarks/elastic_workers.py torchrun OUT K

commit: each round trains STEPS steps without commits and STEPS steps with TorchState.commit() every
EVERY steps (the two alternate, which goes first too, so drift of the host falls on both), a 6 MiB
MLP over DistributedOptimizer with Adam (`shard`: DistributedOptimizer(shard=True), whose commits
hand every rank's shard over in the background: in shared memory, or with `wire` by broadcasts, as
across hosts); rank 0 writes the ms per step of every round to OUT.json.

torchrun: plain DDP over Gloo; rank 0 torch.saves model and optimizer every K steps (under a temporary
name, then renamed); every rank loads the newest checkpoint at start. In the first attempt the last
rank SIGKILLs itself after step 2K + 1 and notes the time; every rank notes when each step completes,
so the driver reads the time from the kill to the first step completed after the restart.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

WIDTH = 768  # 3 layers of 768x768: 1.8 M parameters, 6.8 MiB (plus Adam's 13.5 MiB)
BATCH = 64


def mlp() -> torch.nn.Module:
    """The model of both measurements."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _commit_thread_cpu_ns() -> int | None:
    """CPU ns the commit thread ("commsched-commit") has used, from Linux's schedstat; None without it."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "commsched-commit" and thread.native_id is not None:
            try:
                return int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return None
    return None


def commit_cost(out: Path, rounds: int, steps: int, every: int, shard: bool = False) -> None:
    """Rounds of the same training without and with commits; rank 0 writes ms per step."""
    import commsched.torch as hvd
    from commsched.torch.elastic import TorchState

    torch.set_num_threads(1)  # one core per rank, as torchrun sets OMP_NUM_THREADS=1
    hvd.init()
    model = mlp()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4), named_parameters=model.named_parameters(), shard=shard
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = TorchState(model, optimizer, epoch=0)
    data = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(hvd.rank()))
    target = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(1))

    in_commit: list[float] = []  # ms inside commit() on the training thread, per commit
    cpu: dict[str, list[float]] = {"none": [], "commit": []}  # this process's CPU ms per step (all threads)
    # The training thread's CPU ms per step, and (commit rounds) the commit thread's: the cost of the
    # capture itself, which the spread of the training's own time between rounds does not blur.
    training_cpu: dict[str, list[float]] = {"none": [], "commit": []}
    commit_thread_cpu: list[float] = []
    # With commits: ms of each step by its position after the last commit (0: the step that ends in
    # commit(), 1: the next); steps before a round's first commit are left out.
    by_position: list[list[float]] = [[] for _ in range(every)]
    # Commits fall mid-interval (steps 5, 15, ... of a round of 60): each capture then runs beside
    # measured steps, as in a long job, instead of the round's last one running alone in its end.
    phase = every // 2

    def train(count: int, commit_every: int) -> float:
        hvd.barrier()
        committer = _commit_thread_cpu_ns()
        training = time.thread_time()
        start, used = time.perf_counter(), time.process_time()
        for step in range(count):
            began = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(data), target).backward()
            optimizer.step()
            position = (step + 1 + phase) % commit_every if commit_every else -1
            if position == 0:
                called = time.perf_counter()
                state.commit()
                in_commit.append((time.perf_counter() - called) * 1000)
            if commit_every and step + 1 + phase >= commit_every:
                by_position[position].append((time.perf_counter() - began) * 1000)
        state.wait()  # a capture still running counts against the commits
        variant = "commit" if commit_every else "none"
        cpu[variant].append((time.process_time() - used) * 1000 / count)
        training_cpu[variant].append((time.thread_time() - training) * 1000 / count)
        after = _commit_thread_cpu_ns()
        if commit_every and committer is not None and after is not None:
            commit_thread_cpu.append((after - committer) / 1e6 / count)
        hvd.barrier()
        return (time.perf_counter() - start) * 1000 / count

    train(steps // 2, every)  # warm-up of both paths, not measured
    in_commit.clear()
    for times in by_position:
        times.clear()
    for kept in (cpu, training_cpu):
        kept["none"].clear()
        kept["commit"].clear()
    commit_thread_cpu.clear()
    results: dict[str, list[float]] = {"none": [], "commit": []}
    for number in range(rounds):
        order = ("none", "commit") if number % 2 == 0 else ("commit", "none")
        for variant in order:
            results[variant].append(train(steps, every if variant == "commit" else 0))
    if hvd.rank() == 0:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        report = {
            "ms_per_step": results,
            "ms_in_commit": in_commit,
            "cpu_ms_per_step": cpu,
            "training_cpu_ms_per_step": training_cpu,
            "commit_thread_cpu_ms_per_step": commit_thread_cpu,
            "ms_by_position": by_position,
            "parameter_bytes": size,
            "ranks": hvd.size(),
            "shard": shard,
        }
        out.write_text(json.dumps(report))
    hvd.shutdown()


def torchrun_worker(out: Path, every: int) -> None:
    """One DDP rank that resumes from the newest checkpoint; see the module's docstring."""
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's store outlives a restart: Gloo would read the addresses the killed attempt's ranks
    # published and fail to connect, so each attempt keeps its keys under its own prefix.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        size,
        is_master=rank == 0 and not agent_store,
        multi_tenant=not agent_store,
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank, world_size=size
    )
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    checkpoint = out / "checkpoint.pt"
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"] + 1
    data = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    target = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(1))
    kill_at = 2 * every + 1
    log = open(out / f"times.{attempt}.{rank}", "a")  # noqa: SIM115 - open for the whole run
    for step in range(start, kill_at + every + 2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        optimizer.step()
        log.write(f"{time.time():.6f} step {step}\n")
        log.flush()
        if rank == 0 and (step + 1) % every == 0:
            partial = checkpoint.with_suffix(".tmp")
            torch.save(
                {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                partial,
            )
            partial.replace(checkpoint)
        if attempt == 0 and step == kill_at and rank == size - 1:
            log.write(f"{time.time():.6f} fault\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    dist.destroy_process_group()


def main() -> None:
    """Dispatches to the measurement named by the first argument."""
    kind, out = sys.argv[1], Path(sys.argv[2])
    if kind == "commit":
        shard = "shard" in sys.argv[6:]
        if "wire" in sys.argv[6:]:
            from commsched.torch import elastic_commit

            elastic_commit.SHARED_MEMORY = False
        commit_cost(out, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), shard)
    elif kind == "torchrun":
        torchrun_worker(out, int(sys.argv[3]))
    else:
        raise SystemExit(f"elastic_workers.py: unknown measurement {kind!r}; use commit or torchrun")


if __name__ == "__main__":
    main()
