#!/usr/bin/env python3
"""A long randomized soak: rounds of random collectives, each checked against numpy, until time is up.

Every round, every rank submits the same random set of tensors (sizes from empty to ~1 MB, every
dtype, allreduce sum/average and broadcast, random priorities) in its own random order, with random
pauses, then checks each result. A collective that does not finish within --hang-after seconds is a
hang; the soak stops there (the ranks no longer agree on what runs). At the end it prints the
collectives checked by kind, the wrong results and the hangs, and exits non-zero if there was either.

Three more kinds join the mix, each chosen from the round's shared seed so every rank agrees:

* process sets (``--no-process-sets`` turns them off): the sets of even ranks, odd ranks and every
  rank but the last are added at the start; each round their members also run up to
  ``--set-tensors`` allreduces, allgathers (member r gives r % 3 extra rows) and broadcasts on each
  set, in the same random order as the rest, checked against numpy over the members' inputs;
* join rounds (``--join-chance``, 0 turns them off): a seeded rank joins while the others allreduce,
  globally and on their sets (the joined rank adds zeros, an average still divides by every member),
  and an allgather is refused naming it; then every rank joins, a seeded rank last, after an
  allreduce of its own, and ``join()`` must return that rank on every rank;
* checkpoints (``--checkpoint-chance``, 0 turns them off; needs torch): a small model with AdamW and
  an LR scheduler, the same on every rank, takes a step, ``Checkpointer.save(step)`` starts, another
  step runs while the round's collectives go on, then ``wait()``. At the end a fresh Checkpointer
  loads each kept version (``--checkpoint-keep``), which must equal the saved state bit for bit.
  The versions go to ``--checkpoint-dir``, by default a temporary folder removed afterwards.

Usage::

    python benchmarks/soak.py --ranks 3 --transport mpi --minutes 10
    python benchmarks/soak.py --ranks 4 --transport gloo --minutes 30 --settings partition_bytes=64KiB

(CI runs the short version: tests/ranks/random_collectives.py through tests/test_multirank.py and
tests/test_transports.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "float64", "int32", "int64", "float16")
RESULT = "SOAK-RESULT "


def plan(rng: object, count: int) -> list[dict]:
    """One round's tensors, the same on every rank (the round's seed is shared)."""
    import numpy as np

    assert isinstance(rng, np.random.Generator)
    tensors = []
    for i in range(count):
        dtype = DTYPES[int(rng.choice(len(DTYPES), p=[0.35, 0.2, 0.2, 0.2, 0.05]))]
        size = (
            int(rng.choice([0, 1, 3, 17]))
            if rng.random() < 0.05
            else int(np.exp(rng.uniform(0, np.log(250_000))))
        )
        kind = "broadcast" if rng.random() < 0.1 else "allreduce"
        op = "average" if dtype.startswith("float") and kind == "allreduce" and rng.random() < 0.5 else "sum"
        tensors.append(
            {
                "index": i,
                "dtype": dtype,
                "size": size,
                "kind": kind,
                "op": op,
                "priority": int(rng.integers(-50, 50)),
            }
        )
    return tensors


def member_values(seed: int, round_number: int, key: tuple[int, ...], spec: dict) -> object:
    """The seeded values behind a tensor, the same on every rank; rank r submits values * (r + 1) + r."""
    import numpy as np

    base = np.random.default_rng([seed, round_number, *key])
    if spec["dtype"] == "float16" or spec["dtype"].startswith("int"):
        return base.integers(-8, 8, spec["size"])  # exact in every dtype at any rank count
    return base.uniform(-1, 1, spec["size"])


def set_plan(rng: object, sets: list[list[int]], count: int) -> list[dict]:
    """One round's collectives on the process sets (allreduce, allgather, broadcast), the same on every rank."""
    import numpy as np

    assert isinstance(rng, np.random.Generator)
    specs = []
    for number, members in enumerate(sets):
        for i in range(int(rng.integers(0, count + 1))):
            dtype = DTYPES[int(rng.choice(len(DTYPES), p=[0.35, 0.2, 0.2, 0.2, 0.05]))]
            kind = str(rng.choice(["allreduce", "allgather", "broadcast"], p=[0.6, 0.2, 0.2]))
            op = (
                "average"
                if dtype.startswith("float") and kind == "allreduce" and rng.random() < 0.5
                else "sum"
            )
            specs.append(
                {
                    "set": number,
                    "index": i,
                    "dtype": dtype,
                    "size": int(np.exp(rng.uniform(0, np.log(30_000)))),
                    "kind": kind,
                    "op": op,
                    "root": int(members[int(rng.integers(len(members)))]),
                    "priority": int(rng.integers(-50, 50)),
                }
            )
    return specs


def soak_sets(size: int) -> list[list[int]]:
    """The process sets the soak adds: even ranks, odd ranks, and every rank but the last (when distinct)."""
    candidates = [list(range(0, size, 2)), list(range(1, size, 2)), list(range(size - 1))]
    sets: list[list[int]] = []
    for ranks in candidates:
        if ranks and ranks not in sets and len(ranks) < size:
            sets.append(ranks)
    return sets


class Tally:
    """What one rank checked, by kind, and the first thing that went wrong."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(("global", "set", "join", "refused", "join_rounds", "saves", "loaded"), 0)
        self.wrong = self.hangs = 0
        self.first_problem = ""

    def problem(self, text: str, hang: bool = False) -> None:
        if hang:
            self.hangs += 1
        else:
            self.wrong += 1
        self.first_problem = self.first_problem or text


def check(tally: Tally, kind: str, result: object, reference: object, dtype: str, what: str) -> None:
    """Counts one collective of `kind`; a result that differs from numpy's is a wrong one."""
    import numpy as np

    result = np.asarray(result).astype(np.float64)
    reference = np.asarray(reference, np.float64)
    tolerance = 2e-3 if dtype == "float16" else 1e-5
    tally.counts[kind] += 1
    if result.shape != reference.shape or not np.allclose(result, reference, rtol=tolerance, atol=tolerance):
        tally.problem(f"{what} differs from numpy")


def join_round(arguments: argparse.Namespace, round_number: int, sets: list, tally: Tally) -> None:
    """One seeded rank joins while the others allreduce (its zeros; average over every rank), globally and on
    the sets; an allgather meanwhile is refused naming it; then every rank but one seeded last rank joins,
    the last one allreduces alone (every other rank joined) and joins: join() must return it everywhere."""
    import numpy as np

    import commsched

    rank, size = commsched.rank(), commsched.size()
    rng = np.random.default_rng([arguments.seed, round_number, 10**6, 2])
    joiner = int(rng.integers(size))
    others = [r for r in range(size) if r != joiner]
    last = int(others[int(rng.integers(len(others)))]) if others else joiner
    specs = []
    for i in range(int(rng.integers(1, 4))):
        dtype = ("float32", "float64", "int32")[int(rng.integers(3))]
        op = "average" if dtype.startswith("float") and rng.random() < 0.5 else "sum"
        specs.append(
            {"index": i, "dtype": dtype, "size": int(np.exp(rng.uniform(0, np.log(50_000)))), "op": op}
        )
    timeout = arguments.hang_after
    tally.counts["join_rounds"] += 1
    where = f"round {round_number} (rank {joiner} joined)"

    def values(key: tuple[int, ...], spec: dict, r: int) -> object:
        return member_values(arguments.seed, round_number, (3 * 10**6, *key), spec) * (r + 1) + r

    if rank != joiner:
        pending = []
        for spec in specs:
            name = f"soak.{round_number}.join.{spec['index']}"
            array = np.asarray(values((spec["index"],), spec, rank)).astype(spec["dtype"])
            handle = commsched.allreduce_async(array, name, op=spec["op"])
            reference = sum(values((spec["index"],), spec, r) for r in others)  # the joined rank adds zeros
            pending.append((handle, spec, reference / size if spec["op"] == "average" else reference, name))
        for number, process_set in enumerate(sets):
            members = process_set.ranks
            if rank not in members:
                continue
            spec = specs[number % len(specs)]
            key = (100 + number, spec["index"])
            name = f"soak.{round_number}.join.set{number}"
            array = np.asarray(values(key, spec, rank)).astype(spec["dtype"])
            handle = commsched.allreduce_async(array, name, op=spec["op"], process_set=process_set)
            reference = sum(values(key, spec, r) for r in members if r != joiner)
            pending.append(
                (handle, spec, reference / len(members) if spec["op"] == "average" else reference, name)
            )
        for handle, spec, reference, name in pending:
            check(tally, "join", handle.wait(timeout=timeout), reference, spec["dtype"], f"{where}: {name}")
        try:
            commsched.allgather(np.full(rank + 1, rank, np.int32), name=f"soak.{round_number}.join.gather")
        except commsched.CollectiveError as error:
            tally.counts["refused"] += 1
            if f"rank {joiner}" not in str(error) or "joined" not in str(error):
                tally.problem(f"{where}: the allgather's refusal does not name rank {joiner}: {error}")
        else:
            tally.problem(f"{where}: an allgather ran although rank {joiner} had joined")
        if rank == last:
            spec = specs[0]
            array = np.asarray(values((99,), spec, rank)).astype(spec["dtype"])
            name = f"soak.{round_number}.join.alone"
            result = commsched.allreduce(array, name, op=spec["op"], timeout=timeout)
            reference = values((99,), spec, rank)
            check(
                tally,
                "join",
                result,
                reference / size if spec["op"] == "average" else reference,
                spec["dtype"],
                f"{where}: {name}",
            )
    returned = commsched.join(timeout=timeout)
    if returned != last:
        tally.problem(f"{where}: join() returned {returned}, the last rank to join was {last}")


class CheckpointSoak:
    """A small model, AdamW and an LR scheduler, the same on every rank, saved by a Checkpointer now and then;
    at the end a fresh Checkpointer loads every kept version, which must equal what was saved bit for bit."""

    def __init__(self, directory: str, seed: int, keep: int) -> None:
        import commsched.torch
        import torch

        self.torch, self.seed, self.keep, self.directory = torch, seed, keep, directory
        self.model, self.optimizer, self.scheduler = self._fresh(seed)
        self.checkpointer = commsched.torch.Checkpointer(
            self.model, self.optimizer, directory, keep=keep, lr_scheduler=self.scheduler
        )
        self.saved: dict[int, dict] = {}

    def _fresh(self, seed: int) -> tuple:
        torch = self.torch
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return model, optimizer, scheduler

    def _train(self, step: int, phase: int) -> None:
        torch = self.torch
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 2 * step + phase)
        inputs = torch.randn(16, 8, generator=generator)
        targets = torch.randn(16, 4, generator=generator)
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(inputs), targets).backward()
        self.optimizer.step()
        self.scheduler.step()

    def _state(self, model: object, optimizer: object, scheduler: object) -> dict:
        import copy

        return copy.deepcopy(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }
        )

    def save(self, step: int) -> None:
        """A step, save(step) (returns at once), then another step while the version is still being captured."""
        self._train(step, 0)
        self.checkpointer.save(step, extra={"round": step})
        self.saved[step] = self._state(self.model, self.optimizer, self.scheduler)
        for old in sorted(self.saved)[: -self.keep]:
            del self.saved[old]
        self._train(step, 1)

    def verify(self, tally: Tally) -> None:
        """Loads the newest version and every other kept one into a fresh model and compares."""
        import commsched.torch

        self.checkpointer.close()
        model, optimizer, scheduler = self._fresh(self.seed + 1)
        loader = commsched.torch.Checkpointer(
            model, optimizer, self.directory, keep=self.keep, lr_scheduler=scheduler
        )
        try:
            newest = loader.load()
            if newest is None or newest.step != max(self.saved):
                tally.problem(
                    f"checkpoints: load() gave {newest and newest.step}, the last save was {max(self.saved)}"
                )
                return
            steps = [newest.step, *sorted(self.saved)[:-1]]
            for step in steps:
                restored = newest if step == newest.step else loader.load(step)
                differences = _differences(self.saved[step], self._state(model, optimizer, scheduler), "")
                if restored.extra.get("round") != step:
                    differences.append(f"extra {restored.extra}")
                tally.counts["loaded"] += 1
                if differences:
                    tally.problem(f"checkpoint step {step} loads other than saved: {differences[:3]}")
        finally:
            loader.close()


def _differences(saved: object, loaded: object, path: str) -> list[str]:
    """Where two state dicts differ: tensors bit for bit (dtype, shape, bytes), other values by ==."""
    import torch

    if isinstance(saved, torch.Tensor) or isinstance(loaded, torch.Tensor):
        same = (
            isinstance(saved, torch.Tensor)
            and isinstance(loaded, torch.Tensor)
            and saved.dtype == loaded.dtype
            and saved.shape == loaded.shape
            and saved.detach().cpu().numpy().tobytes() == loaded.detach().cpu().numpy().tobytes()
        )
        return [] if same else [path or "tensor"]
    if isinstance(saved, dict) and isinstance(loaded, dict):
        if set(saved) != set(loaded):
            return [f"{path} keys {sorted(map(str, saved))} != {sorted(map(str, loaded))}"]
        return [d for key in saved for d in _differences(saved[key], loaded[key], f"{path}.{key}")]
    if isinstance(saved, (list, tuple)) and isinstance(loaded, (list, tuple)):  # JSON keeps no tuples
        if len(saved) != len(loaded):
            return [f"{path} length {len(saved)} != {len(loaded)}"]
        return [d for i, (a, b) in enumerate(zip(saved, loaded)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if saved == loaded else [f"{path}: {saved!r} != {loaded!r}"]


def run_rank(arguments: argparse.Namespace) -> int:
    """One rank's part: rounds until the deadline; prints one SOAK-RESULT JSON line."""
    import numpy as np

    import commsched

    settings = dict(item.split("=", 1) for item in arguments.settings)
    commsched.init(transport=arguments.transport, **settings)
    rank, size = commsched.rank(), commsched.size()
    tally = Tally()
    sets = [commsched.add_process_set(ranks) for ranks in soak_sets(size)] if arguments.process_sets else []
    checkpoints = None
    checkpoint_state = "off"
    if arguments.checkpoint_chance > 0:
        try:
            import torch  # noqa: F401
        except ImportError:
            checkpoint_state = "off (torch is not importable)"
        else:
            checkpoints = CheckpointSoak(arguments.checkpoint_dir, arguments.seed, arguments.checkpoint_keep)
            checkpoint_state = "on"
    # Every rank agrees on the deadline's round count through a tiny allreduce per round.
    deadline = time.monotonic() + arguments.minutes * 60
    for round_number in range(10**9):
        go_on = np.array([1 if time.monotonic() < deadline else 0], np.int32)
        commsched.allreduce(go_on, name=f"soak.go.{round_number}", timeout=arguments.hang_after)
        if go_on[0] < size:  # some rank's time is up: every rank stops at this same round
            break
        rng = np.random.default_rng([arguments.seed, round_number])
        tensors = [("global", spec) for spec in plan(rng, arguments.tensors)]
        shared = np.random.default_rng([arguments.seed, round_number, 10**6, 1])  # the new kinds' choices
        set_specs = set_plan(shared, [s.ranks for s in sets], arguments.set_tensors) if sets else []
        tensors += [("set", spec) for spec in set_specs if rank in sets[spec["set"]].ranks]
        join_now = shared.random() < arguments.join_chance
        checkpoint_now = checkpoints is not None and shared.random() < arguments.checkpoint_chance
        if checkpoint_now:
            checkpoints.save(round_number)
            tally.counts["saves"] += 1
        mine = np.random.default_rng([arguments.seed, round_number, rank])
        handles = []
        for index in mine.permutation(len(tensors)):
            kind, spec = tensors[int(index)]
            if kind == "global":
                values = member_values(arguments.seed, round_number, (spec["index"], 1), spec)
                name = f"soak.{round_number}.{spec['index']}"
                root, members, process_set = spec["index"] % size, list(range(size)), None
            else:
                values = member_values(
                    arguments.seed, round_number, (2 * 10**6, spec["set"], spec["index"]), spec
                )
                name = f"soak.{round_number}.set{spec['set']}.{spec['index']}"
                root, members, process_set = spec["root"], sets[spec["set"]].ranks, sets[spec["set"]]
            if mine.random() < 0.02:
                time.sleep(float(mine.uniform(0, 0.003)))
            if spec["kind"] == "allgather":  # member r gives size + r % 3 rows
                rows = {r: np.resize(values, spec["size"] + r % 3) * (r + 1) + r for r in members}
                array = rows[rank].astype(spec["dtype"])
                handle = commsched.allgather_async(
                    array, name, priority=spec["priority"], process_set=process_set
                )
                reference = np.concatenate([rows[r] for r in members])
            elif spec["kind"] == "broadcast":
                array = (values * (rank + 1) + rank).astype(spec["dtype"])
                handle = commsched.broadcast_async(
                    array, root=root, name=name, priority=spec["priority"], process_set=process_set
                )
                reference = values * (root + 1) + root
            else:
                array = (values * (rank + 1) + rank).astype(spec["dtype"])
                handle = commsched.allreduce_async(
                    array, name, priority=spec["priority"], op=spec["op"], process_set=process_set
                )
                reference = sum(values * (r + 1) + r for r in members)
                reference = reference / len(members) if spec["op"] == "average" else reference
            handles.append((handle, kind, spec, reference))
        for handle, kind, spec, reference in handles:
            try:
                result = handle.wait(timeout=arguments.hang_after)
            except TimeoutError as error:
                tally.problem(f"round {round_number}: {error}", hang=True)
                break
            check(tally, kind, result, reference, spec["dtype"], f"round {round_number}: {spec}")
        if tally.hangs:
            break
        try:
            if checkpoint_now:
                checkpoints.checkpointer.wait()
            if join_now:
                join_round(arguments, round_number, sets, tally)
        except TimeoutError as error:
            tally.problem(f"round {round_number}: {error}", hang=True)
            break
        except (RuntimeError, commsched.CollectiveError) as error:
            tally.problem(f"round {round_number}: {type(error).__name__}: {error}")
    if checkpoints is not None and not tally.hangs and checkpoints.saved:
        try:
            checkpoints.verify(tally)
        except Exception as error:  # noqa: BLE001 - reported as a wrong result, with its reason
            tally.problem(f"checkpoints: {type(error).__name__}: {error}")
    if not tally.hangs:
        for process_set in sets:
            commsched.remove_process_set(process_set)
    print(
        RESULT
        + json.dumps(
            {
                "rank": rank,
                "checked": sum(tally.counts[k] for k in ("global", "set", "join")),
                "wrong": tally.wrong,
                "hangs": tally.hangs,
                "first_problem": tally.first_problem,
                "counts": tally.counts,
                "sets": [s.ranks for s in sets],
                "checkpoints": checkpoint_state,
            }
        ),
        flush=True,
    )
    if not tally.hangs:
        commsched.shutdown()
    return 1 if tally.wrong or tally.hangs else 0


def read_results(output: str) -> list[dict]:
    """Each rank's SOAK-RESULT object, one per rank; the launcher may forward two ranks' lines as one."""
    decoder, found = json.JSONDecoder(), {}
    start = output.find(RESULT)
    while start >= 0:
        try:
            result, _ = decoder.raw_decode(output, start + len(RESULT))
            found.setdefault(result["rank"], result)
        except (ValueError, KeyError, TypeError):
            pass  # a line cut by another rank's output: that rank counts as silent
        start = output.find(RESULT, start + 1)
    return [found[rank] for rank in sorted(found)]


def launch(arguments: argparse.Namespace, passthrough: list[str]) -> int:
    """Starts the ranks (mpiexec for MPI, commsched-run otherwise) and sums up their results."""
    program = [str(Path(__file__).resolve()), "--rank-program", *passthrough]
    if arguments.transport == "mpi":
        mpiexec = Path(sys.executable).parent / "mpiexec"
        command = [
            str(mpiexec if mpiexec.exists() else shutil.which("mpiexec") or "mpiexec"),
            "-n",
            str(arguments.ranks),
            sys.executable,
            *program,
        ]
    else:
        command = [sys.executable, "-m", "commsched.run", "-n", str(arguments.ranks), *program]
    environment = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    )
    made_directory = None
    if arguments.checkpoint_chance > 0 and arguments.checkpoint_dir is None:  # one folder every rank sees
        made_directory = tempfile.mkdtemp(prefix="soak-checkpoints-")
        command += ["--checkpoint-dir", made_directory]
    started = time.monotonic()
    limit = arguments.minutes * 60 + 10 * arguments.hang_after + 120
    try:
        done = subprocess.run(
            command, env=environment, capture_output=True, text=True, timeout=limit, check=False
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = (
            (expired.stdout or b"").decode(errors="replace")
            if isinstance(expired.stdout, bytes)
            else (expired.stdout or ""),
            -1,
        )
    finally:
        if made_directory is not None:
            shutil.rmtree(made_directory, ignore_errors=True)
    results = read_results(output)
    checked = sum(r["checked"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    hangs = sum(r["hangs"] for r in results) + (arguments.ranks - len(results))  # a silent rank hung too
    counts = {k: sum(r["counts"][k] for r in results) for k in (results[0]["counts"] if results else {})}
    rounds = {
        k: max((r["counts"][k] for r in results), default=0) for k in ("join_rounds", "saves", "loaded")
    }
    print(f"soak: {arguments.ranks} ranks over {arguments.transport}, {time.monotonic() - started:.0f}s")
    print(f"collectives checked: {checked}")
    if results:
        print(f"  on every rank: {counts['global']}")
        sets = " ".join(str(s) for s in results[0]["sets"]) or "off"
        print(f"  on process sets ({sets}): {counts['set']}")
        print(f"  while a rank had joined: {counts['join']}")
        joins = "off" if arguments.join_chance <= 0 else str(rounds["join_rounds"])
        print(f"join rounds: {joins} (allgathers refused naming the joined rank: {counts['refused']})")
        state = results[0]["checkpoints"]
        saved = (
            f"{rounds['saves']} saved, {rounds['loaded']} versions loaded bit-exact on every rank"
            if state == "on"
            else state
        )
        print(f"checkpoints: {saved}")
    print(f"wrong results: {wrong}")
    print(f"hangs: {hangs}")
    for result in results:
        if result["first_problem"]:
            print(f"rank {result['rank']}: {result['first_problem']}")
    if code != 0 and (len(results) < arguments.ranks or not (wrong or hangs)):
        print(output[-4000:])
    return 0 if code == 0 and not wrong and not hangs else 1


def main(argv: list[str] | None = None) -> int:
    """Parses the arguments; runs the launcher side or, with --rank-program, one rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--transport", default="mpi", choices=("mpi", "gloo", "grpc"))
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep submitting rounds")
    parser.add_argument("--tensors", type=int, default=200, help="tensors per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--hang-after", type=float, default=60.0, help="seconds after which a collective counts as hung"
    )
    parser.add_argument(
        "--settings", nargs="*", default=[], help="commsched.init() settings, e.g. partition_bytes=64KiB"
    )
    parser.add_argument(
        "--process-sets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add process sets (even ranks, odd ranks, all but the last) and run collectives on them",
    )
    parser.add_argument(
        "--set-tensors", type=int, default=8, help="at most this many collectives per set per round"
    )
    parser.add_argument(
        "--join-chance", type=float, default=0.1, help="chance of a join round after a round (0: none)"
    )
    parser.add_argument(
        "--checkpoint-chance",
        type=float,
        default=0.1,
        help="chance that a round saves a checkpoint (0: none; needs torch)",
    )
    parser.add_argument(
        "--checkpoint-dir", default=None, help="a folder every rank sees (default: a new temporary one)"
    )
    parser.add_argument("--checkpoint-keep", type=int, default=2, help="versions the Checkpointer keeps")
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    arguments, _ = parser.parse_known_args(argv)
    if arguments.rank_program:
        return run_rank(arguments)
    passthrough = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--rank-program"]
    return launch(arguments, passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
