"""Rank script for the Checkpointer tests: a reference run, a checkpointed run (that may be killed), a resume.

    reference  trains without checkpoints; rank 0 keeps every iteration's state and losses
    train      trains with a Checkpointer saving every --save-every iterations; its losses must equal
               the reference's; --kill POINT --kill-step S SIGKILLs rank(s) at that point of save(S)
               (--kill disk-full: their shard write of save(S) fails midway, as on a full disk)
    resume     loads the newest intact version, which must equal the reference state at its step
               exactly, then trains on; at the reference's rank count the losses must match too

Prints "PASS <phase> <combo> ..." per combination; any mismatch raises (mpi4py aborts the job).
"""

from __future__ import annotations

import argparse
import copy
import errno
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import commsched.torch as ct
import commsched.torch.checkpoint_format as fmt
import torch
import torch.nn.functional as F

import commsched

FEATURES, CLASSES, PER_RANK = 8, 3, 4


class HistorySGD(torch.optim.Optimizer):
    """Momentum SGD that keeps its state inside containers, as LBFGS and Shampoo-style optimizers do:
    the buffer in a list that grows to hold the last gradient too, and a scale tensor, replaced at
    every step, in a dict beside a step count."""

    def __init__(self, params: Any, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One update of every parameter with a gradient."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["history"] = [torch.zeros_like(param)]
                    state["counts"] = {"steps": 0, "scale": torch.ones(())}
                buffer = state["history"][0].mul_(group["momentum"]).add_(param.grad)
                state["history"] = [buffer, param.grad.clone()]
                state["counts"]["steps"] += 1
                state["counts"]["scale"] = state["counts"]["scale"] * 0.99
                param.add_(buffer, alpha=-group["lr"] * float(state["counts"]["scale"]))


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-2),
    "history": HistorySGD,
}


def build(combo: str) -> tuple[torch.nn.Module, ct.DistributedOptimizer, Any]:
    """The model (with batch-norm buffers), wrapped optimizer and LR scheduler of a combination."""
    name, mode = combo.split("-")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, CLASSES),
    )
    optimizer = ct.DistributedOptimizer(
        OPTIMIZERS[name](model.parameters()), model=model, overlap_forward=mode == "overlap"
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    return model, optimizer, scheduler


def batch(iteration: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of iteration's global batch (which depends on the iteration only)."""
    generator = torch.Generator().manual_seed(1000 + iteration)
    x = torch.randn(8 * PER_RANK, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (8 * PER_RANK,), generator=generator)
    per = len(x) // size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def iterate(model: torch.nn.Module, optimizer: Any, scheduler: Any, iteration: int) -> float:
    """One training iteration; returns this rank's loss."""
    x, y = batch(iteration, commsched.rank(), commsched.size())
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss.item())


def snapshot(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """The state, the way torch sees it (state_dict() finishes pending overlap updates first)."""
    return {
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "model": copy.deepcopy(model.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
    }


def assert_equal_state(got: dict[str, Any], want: dict[str, Any], what: str, buffers: bool = True) -> None:
    """Bit-for-bit equality of two snapshots (batch-norm buffers differ between ranks: buffers=False skips them)."""
    for key, value in want["model"].items():
        if not buffers and "running_" in key:
            continue
        assert torch.equal(got["model"][key], value), f"{what}: model {key} differs"
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], (
        f"{what}: param_groups differ"
    )
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys(), f"{what}: state keys differ"
    for index, state in want["optimizer"]["state"].items():
        for key, value in state.items():
            assert same(got["optimizer"]["state"][index][key], value), (
                f"{what}: optimizer state {index}.{key} differs"
            )
    assert got["scheduler"] == want["scheduler"], f"{what}: LR scheduler state differs"


def same(mine: Any, value: Any) -> bool:
    """Equality of state values, tensors bit for bit, inside lists, tuples and dicts too."""
    if isinstance(value, torch.Tensor):
        return isinstance(mine, torch.Tensor) and torch.equal(mine, value)
    if isinstance(value, (list, tuple)):
        return type(mine) is type(value) and len(mine) == len(value) and all(map(same, mine, value))
    if isinstance(value, dict):
        return (
            isinstance(mine, dict)
            and mine.keys() == value.keys()
            and all(same(mine[k], value[k]) for k in value)
        )
    return bool(mine == value)


# -- fault injection: SIGKILL at a chosen point of one save ------------------------------------
def die() -> None:
    """Ends this rank the hard way, as a machine failure would."""
    os.kill(os.getpid(), signal.SIGKILL)


def inject(point: str, step: int) -> None:
    """Makes this rank die at `point` of save(step)."""
    real_write, real_remove = fmt.write_durable, fmt.remove_version
    marker = f"step-{step:010d}-"

    def write(path: Path, chunks: Any) -> tuple[int, int]:
        ours = path.parent.name.startswith(marker)
        shard = path.suffix == ".safetensors"
        if ours and point in ("shard-middle", "manifest-middle") and shard == (point == "shard-middle"):
            return real_write(path, half_then_die(list(chunks)))
        if ours and point == "disk-full" and shard:
            return real_write(path, half_then_full(list(chunks)))
        result = real_write(path, chunks)
        if ours and ((point == "shard-renamed" and shard) or (point == "after-manifest" and not shard)):
            die()
        return result

    def remove(version: fmt.Version) -> None:
        if point == "removing":
            (version.path / fmt.MANIFEST).unlink()
            die()
        real_remove(version)

    fmt.write_durable = write  # type: ignore[assignment]
    fmt.remove_version = remove  # type: ignore[assignment]


def half_then_die(chunks: list[Any]) -> Iterator[Any]:
    """Yields the first half of the bytes, then kills the process (a torn temporary file)."""
    data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    yield data[: len(data) // 2]
    die()


def half_then_full(chunks: list[Any]) -> Iterator[Any]:
    """Yields the first half of the bytes, then fails as a full disk does."""
    data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    yield data[: len(data) // 2]
    raise OSError(errno.ENOSPC, "No space left on device")


def expect_failed_save(checkpointer: ct.Checkpointer, directory: Path, step: int) -> None:
    """Every rank hears that save(step) failed, and nothing of it is left: no folder, no temporary file."""
    try:
        checkpointer.wait()
    except RuntimeError as error:
        assert f"checkpoint step {step} was not saved" in str(error), error
    else:
        raise AssertionError(f"save({step}) with a full disk on one rank reported success")
    marker = f"step-{step:010d}-"
    left = [str(p) for p in directory.rglob("*") if p.name.endswith(".tmp") or marker in str(p)]
    assert not left, f"a failed save left {left}"


# -- phases ---------------------------------------------------------------------------------
def reference(args: argparse.Namespace, combo: str) -> None:
    """Trains without checkpoints; rank 0 stores every iteration's state and the losses."""
    model, optimizer, scheduler = build(combo)
    states, losses = {}, []
    for iteration in range(args.iterations):
        losses.append(iterate(model, optimizer, scheduler, iteration))
        states[iteration] = snapshot(model, optimizer, scheduler)
    if commsched.rank() == 0:
        torch.save({"states": states, "losses": losses, "size": commsched.size()}, args.dir / f"{combo}.ref")
    print(f"PASS reference {combo}", flush=True)


def train(args: argparse.Namespace, combo: str) -> None:
    """Trains with a Checkpointer; the losses must be the reference's (saving changes nothing)."""
    model, optimizer, scheduler = build(combo)
    checkpointer = ct.Checkpointer(model, optimizer, args.dir / combo, keep=args.keep, lr_scheduler=scheduler)
    ref = torch.load(args.dir / f"{combo}.ref", weights_only=False)
    kill_here = args.kill and (args.kill_ranks == "all" or int(args.kill_ranks) == commsched.rank())
    if kill_here and args.kill != "timer":
        inject(args.kill, args.kill_step)
    for iteration in range(args.train_iterations):
        loss = iterate(model, optimizer, scheduler, iteration)
        if commsched.rank() == 0:
            assert loss == ref["losses"][iteration], (
                f"{combo}: loss {iteration} {loss} != {ref['losses'][iteration]}"
            )
        if (iteration + 1) % args.save_every == 0:
            checkpointer.save(iteration, extra={"iteration": iteration, "tag": ("t", iteration)})
            if args.kill == "disk-full" and iteration == args.kill_step:
                expect_failed_save(checkpointer, args.dir / combo, iteration)
            if kill_here and args.kill == "timer" and iteration == args.kill_step:
                # A random moment within about as long as the previous save took to become durable.
                window = 1.5 * (checkpointer.last_durable_seconds or args.kill_window)
                threading.Timer(random.uniform(0.0, window), die).start()
    if kill_here and args.kill == "timer":
        time.sleep(5)  # the timer fires before this rank could finish
    checkpointer.close()
    print(f"PASS train {combo} durable_s={checkpointer.last_durable_seconds:.4f}", flush=True)


def resume(args: argparse.Namespace, combo: str, directory: Path) -> None:
    """Loads the newest intact version, checks it against the reference, trains on (and saves again)."""
    model, optimizer, scheduler = build(combo)
    for parameter in model.parameters():  # nothing of the fresh model may survive the load
        parameter.data.fill_(7.0)
    checkpointer = ct.Checkpointer(model, optimizer, directory, keep=args.keep, lr_scheduler=scheduler)
    restored = checkpointer.load()
    assert restored is not None, f"{directory}: nothing loaded"
    ref = torch.load(args.dir / f"{combo}.ref", weights_only=False)
    assert_equal_state(
        snapshot(model, optimizer, scheduler), ref["states"][restored.step], f"{combo}@{restored.step}"
    )
    assert restored.extra == {"iteration": restored.step, "tag": ("t", restored.step)}, restored.extra
    for iteration in range(restored.step + 1, args.iterations):
        loss = iterate(model, optimizer, scheduler, iteration)
        if commsched.rank() == 0 and ref["size"] == commsched.size():
            assert loss == ref["losses"][iteration], f"{combo}: resumed loss {iteration} differs"
    # A version saved at this rank count loads back into fresh objects.
    final = args.iterations + 100
    checkpointer.save(final, extra={"iteration": final, "tag": ("t", final)})
    checkpointer.wait()
    expected = snapshot(model, optimizer, scheduler)
    model2, optimizer2, scheduler2 = build(combo)
    again = ct.Checkpointer(model2, optimizer2, directory, lr_scheduler=scheduler2).load()
    assert again is not None and again.step == final, again
    # Batch-norm buffers are each rank's own; a version keeps rank 0's, like torch.save on rank 0.
    assert_equal_state(
        snapshot(model2, optimizer2, scheduler2), expected, f"{combo} re-saved", buffers=commsched.rank() == 0
    )
    checkpointer.close()
    print(f"PASS resume {combo} {directory.relative_to(args.dir)} step={restored.step}", flush=True)


PHASES = ("reference", "train", "resume")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", help=f"{', '.join(PHASES)}; several comma-separated run in turn")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument(
        "--combos", default="sgd-barrier,sgd-overlap,adamw-barrier,adamw-overlap,history-overlap"
    )
    parser.add_argument("--resume-dirs", default="", help="resume: comma-separated folders under --dir")
    parser.add_argument("--iterations", type=int, default=16, help="reference and resume train this far")
    parser.add_argument("--train-iterations", type=int, default=12, help="the checkpointed run stops here")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--kill", default="")
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--kill-ranks", default="all")
    parser.add_argument("--kill-window", type=float, default=0.05)
    parser.add_argument("--timeline", default="", help="COMMSCHED_TIMELINE for this job")
    args = parser.parse_args()
    phases = args.phase.split(",")
    unknown = [phase for phase in phases if phase not in PHASES]
    if unknown:
        parser.error(f"phase {unknown[0]!r}: choose one of {', '.join(PHASES)}")
    commsched.init(timeline=args.timeline or None)
    for phase in phases:
        for combo in args.combos.split(","):
            if phase == "reference":
                reference(args, combo)
            elif phase == "train":
                train(args, combo)
            else:
                for folder in args.resume_dirs.split(",") if args.resume_dirs else [combo]:
                    resume(args, combo, args.dir / folder)


if __name__ == "__main__":
    main()
