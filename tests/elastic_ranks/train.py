"""An elastic training rank for tests/test_elastic.py, run under `commsched-run --min-np`.

A linear model over integer data, summed gradients and SGD with momentum 1 keep every value an
exact multiple of 1/8, so results do not depend on the order of additions and runs compare exactly.
Environment: ELASTIC_OUT (a directory for the results), ELASTIC_KILL ("ID:EPOCH:STEP[:WHERE]": the
rank launched as ID SIGKILLs itself in that step, WHERE being `step` (after step(), the default),
`backward` (in the gradient hook, so its gradient never leaves) or `commit` (in commit(), once its
capture started); "ID:-1:-1": in the first reset callback, while the others re-form; "ID:-1:-1:sync":
as the state sync after a re-forming starts; "ID:-2:-2:init": just before hvd.init();
"ID:-2:-2:run": after the optimizer and the state are made, before the training function; several
specs separated by commas), ELASTIC_STOP (SIGSTOP, the same specs), ELASTIC_EXIT ("ID,ID": those
ranks exit with status 1 just before hvd.init()),
ELASTIC_START (a commit saved by an earlier run: start from it), ELASTIC_TIMES=1 (log step times),
ELASTIC_GROW ("EPOCH:STEP:SLOTS": in that step the rank launched as 0 writes `localhost:SLOTS` to
the discovery script ELASTIC_SCRIPT and, while the job is smaller, waits for the launcher's
host-update notice, so the job grows at that very commit; while it is larger, it waits until the
launcher stopped the ranks launched as SLOTS and above, so the job shrinks at that commit),
ELASTIC_SHARD=1 (DistributedOptimizer(shard=True)), ELASTIC_SHARD=model (shard=True with model=),
ELASTIC_OVERLAP=1 (DistributedOptimizer(model=model, overlap_forward=True)),
ELASTIC_SLOW_COMMIT ("ID:SECONDS": the rank launched as ID starts each commit's background capture
that late, as a commit thread starved on a loaded host does), ELASTIC_EPOCHS (default 2) and
ELASTIC_STEP_SLEEP (seconds after each step; default 0): a longer run, for benchmarks/elastic_chaos.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import commsched.torch as hvd
import torch
from commsched.torch import elastic

SAMPLES = 48
FEATURES = 4
BATCH = 2
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "2"))
STEP_SLEEP_S = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))

OUT = Path(os.environ["ELASTIC_OUT"])
LAUNCH_ID = int(os.environ.get("COMMSCHED_ELASTIC_ID", os.environ.get("RANK", "0")))


def fault(epoch: int, step: int, where: str = "step") -> int | None:
    """The signal to send this rank now, per ELASTIC_KILL / ELASTIC_STOP."""
    for name, number in (("ELASTIC_KILL", signal.SIGKILL), ("ELASTIC_STOP", signal.SIGSTOP)):
        for spec in filter(None, os.environ.get(name, "").split(",")):
            if spec in (
                f"{LAUNCH_ID}:{epoch}:{step}:{where}",
                f"{LAUNCH_ID}:{epoch}:{step}" * (where == "step"),
            ):
                return number
    return None


def strike(epoch: int, step: int, where: str) -> None:
    """Sends this rank its fault signal, if one is due here."""
    number = fault(epoch, step, where)
    if number is not None:
        note_time("fault")
        os.kill(os.getpid(), number)


class FaultPoints:
    """Injects the faults inside backward, commit() and the re-forming's sync, where the loop cannot."""

    def __init__(self, state: elastic.TorchState, model: torch.nn.Module) -> None:
        self.epoch_step = (-2, -2)  # set by the training loop
        self.reformed = False
        self.save, self.sync = state.save, state.sync
        model.weight.register_hook(self.in_backward)
        object.__setattr__(state, "save", self.in_commit)
        object.__setattr__(state, "sync", self.in_sync)

    def in_backward(self, gradient: torch.Tensor) -> torch.Tensor:
        """Before this rank's gradient reaches the optimizer's hooks."""
        strike(*self.epoch_step, "backward")
        return gradient

    def in_commit(self) -> None:
        """Once the commit's capture has started."""
        self.save()
        strike(*self.epoch_step, "commit")

    def in_sync(self) -> None:
        """As the state sync after a re-forming starts."""
        if self.reformed:
            strike(-1, -1, "sync")
        self.sync()


def note_time(what: str) -> None:
    """With ELASTIC_TIMES=1: appends the wall-clock time of `what` to OUT/times.ID (for the benchmark)."""
    if os.environ.get("ELASTIC_TIMES") == "1":
        with open(OUT / f"times.{LAUNCH_ID}", "a") as handle:
            handle.write(f"{time.time():.6f} {what}\n")


def grow_here(state: elastic.TorchState, epoch: int, step: int) -> None:
    """Per ELASTIC_GROW: edits the discovery script and waits until the launcher has noticed."""
    spec = os.environ.get("ELASTIC_GROW", "").split(":")
    if LAUNCH_ID != 0 or spec[:2] != [str(epoch), str(step)]:
        return
    script = Path(os.environ["ELASTIC_SCRIPT"])
    script.with_suffix(".new").write_text(f"#!/bin/sh\necho localhost:{spec[2]}\n")
    script.with_suffix(".new").chmod(0o755)
    script.with_suffix(".new").replace(script)
    note_time("script changed")
    notices = Path(os.environ["COMMSCHED_ELASTIC_NOTICES"])

    def noticed() -> bool:  # a notice this rank has not acted on yet: the next commit grows the job
        text = notices.read_text() if notices.exists() else ""
        return bool(text) and float(text.split()[0]) > state._last_updated_timestamp

    def stopped(member: int) -> bool:
        try:
            os.kill(int((OUT / f"pid.{member}").read_text()), 0)
        except (OSError, ValueError):
            return True
        return False

    slots = int(spec[2])
    deadline = time.monotonic() + 20.0
    while hvd.size() < slots and not noticed() and time.monotonic() < deadline:
        time.sleep(0.01)
    while not all(stopped(member) for member in range(slots, hvd.size())) and time.monotonic() < deadline:
        time.sleep(0.01)


def slow_commits() -> None:
    """Per ELASTIC_SLOW_COMMIT: delays this rank's background captures."""
    spec = os.environ.get("ELASTIC_SLOW_COMMIT", "").split(":")
    if spec[0] != str(LAUNCH_ID):
        return
    from commsched.torch import elastic_commit

    capture = elastic_commit.BackgroundCommit._run

    def late(self: elastic_commit.BackgroundCommit, *args: object) -> None:
        time.sleep(float(spec[1]))
        capture(self, *args)

    elastic_commit.BackgroundCommit._run = late  # type: ignore[method-assign]


def main() -> None:
    slow_commits()
    (OUT / f"pid.{LAUNCH_ID}").write_text(str(os.getpid()))
    strike(-2, -2, "init")
    if str(LAUNCH_ID) in os.environ.get("ELASTIC_EXIT", "").split(","):
        sys.exit(1)
    hvd.init()
    generator = torch.Generator().manual_seed(7)
    data = torch.randint(-3, 4, (SAMPLES, FEATURES), generator=generator).double()
    target = torch.randint(-3, 4, (SAMPLES,), generator=generator).double()
    model = torch.nn.Linear(FEATURES, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    overlap = os.environ.get("ELASTIC_OVERLAP") == "1"
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.125, momentum=1.0),
        named_parameters=model.named_parameters(),
        op=hvd.Sum,
        shard=os.environ.get("ELASTIC_SHARD") in ("1", "model"),
        model=model if os.environ.get("ELASTIC_SHARD") == "model" or overlap else None,
        overlap_forward=overlap,
    )
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, seen=[[] for _ in range(EPOCHS)])
    start = os.environ.get("ELASTIC_START")
    if start:
        saved = torch.load(start, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        sampler.load_state_dict(saved["sampler"])
        state.epoch, state.seen = saved["epoch"], saved["seen"]
        state.commit()

    points = FaultPoints(state, model)

    def on_reset() -> None:
        points.reformed = True
        strike(-1, -1, "step")  # "ID:-1:-1": die while the others re-form
        # The commit every survivor restored and synchronised: a run started from it at the new size
        # must end with the same parameters.
        if hvd.rank() == 0 and not (OUT / "restored.pt").exists():
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "sampler": sampler.state_dict(),
                    "epoch": state.epoch,
                    "seen": state.seen,
                },
                OUT / "restored.pt",
            )

    state.register_reset_callbacks([on_reset])
    strike(-2, -2, "run")
    train(state, data, target, points)
    if hvd.rank() == 0:
        torch.save(
            {"weight": model.weight.detach().clone(), "seen": state.seen, "size": hvd.size()},
            OUT / "final.pt",
        )
    print(f"rank {hvd.rank()} of {hvd.size()} done", flush=True)


@elastic.run
def train(state: elastic.TorchState, data: torch.Tensor, target: torch.Tensor, points: FaultPoints) -> None:
    """Epochs over the elastic sampler, committing after every step."""
    while state.epoch < EPOCHS:
        indices = list(state.sampler)
        for step, first in enumerate(range(0, len(indices), BATCH)):
            batch = indices[first : first + BATCH]
            points.epoch_step = (state.epoch, step)
            state.optimizer.zero_grad()
            loss = (state.model(data[batch]).squeeze(1) * target[batch]).sum()
            loss.backward()
            state.optimizer.step()
            # After step(): the survivors have updated past the last commit and must roll back.
            strike(state.epoch, step, "step")
            for gathered in hvd.allgather_object(batch, name="seen"):
                state.seen[state.epoch].extend(gathered)
            state.sampler.record_batch(step, BATCH)
            grow_here(state, state.epoch, step)
            state.commit()
            note_time(f"step {hvd.size()}")
            time.sleep(STEP_SLEEP_S)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


if __name__ == "__main__":
    main()
    sys.exit(0)
