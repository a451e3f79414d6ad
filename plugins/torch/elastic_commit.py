"""TorchState's commits of a model and its optimizer through the Checkpointer's background capture.

commit() copies nothing of the parameters up front: it hands every parameter and its optimizer
state to a Capture (checkpoint_capture), whose background thread copies them into a reused host
buffer while training goes on; an update that comes before the thread reached a parameter copies
that parameter first, on the training thread. Model buffers (batch-norm statistics, which the next
forward changes) and the optimizer's non-tensor state are copied inside commit().

Two buffers alternate: the last complete commit stays untouched while the next one is captured,
so a capture that fails leaves it in place and restore() rolls back to it. restore() first lets a
capture still under way finish: every parameter it has not copied yet was not updated since the
commit. Changes made outside optimizer.step() (load_state_dict, edits of parameters) must come
after wait(); TorchState.sync() and restore() wait themselves.

An unsharded commit's copies into a version's buffers are planned once, and again only when the
model's or the optimizer's tensors change (elastic_plan): commit() then does little per parameter.

With DistributedOptimizer(shard=True) a rank holds only its shard of the optimizer state, and a
rank that is lost takes its shard with it: the capture copies this rank's shard into shared memory
that every rank on the host maps (elastic_shm), so a commit moves no shard bytes between ranks on one
host. There each rank also copies only its shard of the parameters, not all of them: after a step's
all-gather every rank holds the same parameters, so restore() rebuilds them from all ranks' shards
(a lost rank's too), and a commit copies 1/N of the parameters where it copied all of them. Ranks on
several hosts gather every rank's copied shard of the optimizer state instead (a broadcast from each
rank, lowest priority) and copy the parameters whole, which costs no traffic. Either way each rank's commit holds the whole optimizer state, as an unsharded
optimizer's commit does. A commit counts once every rank finished its capture (in shared memory:
once every rank marked its part copied there, which a rank does before its next update, so a rank
killed then leaves the commit restorable; across hosts: once the gather is done); restore() joins the
shards into the plain per-parameter form and the optimizer cuts it again at the rank count it
re-formed at (elastic_shard).

With a directory (TorchState(..., checkpoint_dir=...)) every commit is also saved to disk by a
commsched.torch.Checkpointer, loadable with Checkpointer(model, optimizer, directory).load().
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from commsched.torch import checkpoint_shards as sharded
from commsched.torch import elastic_plan, elastic_shard, elastic_shm, elastic_split
from commsched.torch.checkpoint_capture import Capture, Copy, Unit
from commsched.torch.checkpoint_worker import lower_priority
from commsched.torch.elastic_version import Version, complete_everywhere
from commsched.torch.optimizer import DistributedOptimizer

import commsched
import torch
from commsched import _core

_LAST = 2**31 - 1  # priority of a commit's gather: after every gradient
# Ranks on one host hand a sharded commit's shards over in shared memory (elastic_shm); False sends
# them by broadcasts as ranks on several hosts do (benchmarks/elastic_recovery.py --wire measures it).
SHARED_MEMORY = True


def supported(model: Any, optimizer: Any) -> bool:
    """True when the pair can be committed in the background (a sharded one: over every rank)."""
    return (
        isinstance(model, torch.nn.Module)
        and isinstance(optimizer, torch.optim.Optimizer)
        and (not sharded.is_sharded(optimizer) or elastic_shard.usable(optimizer))
    )


class _Pending(threading.Event):
    """Set once a commit's capture in the background ended; is_alive() until then, as its thread's was."""

    def is_alive(self) -> bool:
        """True while the capture runs."""
        return not self.is_set()


class BackgroundCommit:
    """Commits, restores and (optionally) saves to disk one model and its optimizer."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | None
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
        self.sharded = sharded.is_sharded(optimizer)
        self._gathers = 0  # this generation's gathers: their names must be the same on every rank
        self._region: elastic_shm.Region | None = None  # this layout's shared memory (elastic_shm)
        self._hosts: dict[torch.dtype, int] | None = None  # the totals self._region was decided for
        # The last cut over the ranks (elastic_split.plan) and what it depends on, and per slot the
        # copies into that slot: planned again only when parameters, state or ranks change (at 160
        # parameters planning and building the copies took about 6 ms of each commit() call).
        # The tensors the last commit found (elastic_plan.Layout), numbered: plans made for one number stay valid.
        self._layout: elastic_plan.Layout | None = None
        self._layouts = 0
        self._cut_plan: tuple[int, list[elastic_split.Split], dict[torch.dtype, int]] | None = None
        self._cut_copies: dict[int, tuple[Any, list[tuple[torch.Tensor, list[Copy]]], dict[int, str]]] = {}
        self._directory = directory
        self._disk: Any = None  # the Checkpointer, built at the first commit with commsched running
        self.commits = 0  # commits started; each version has its number
        self._lock = threading.Lock()
        self._committed: Version | None = None
        self._spare = Version()  # the buffers the next capture writes into
        self._capture: Capture | None = None
        self._running: tuple[_Pending, Capture] | None = None
        # One long-lived thread: starting one per commit cost the training thread about 1 ms, the
        # time the new thread took to be scheduled on a busy host.
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        weakref.finalize(self, self._jobs.put, None)
        self._hooks = self._register_hooks()
        # A capture still running at exit would be stopped inside commsched's wait (a gather) and abort.
        atexit.register(_finish_at_exit, weakref.ref(self))

    def _register_hooks(self) -> list[Any]:
        if isinstance(self._optimizer, DistributedOptimizer):
            return [self._optimizer.register_param_update_pre_hook(self._before_update)]

        def everything() -> list[torch.Tensor]:
            return [p for group in self._inner.param_groups for p in group["params"]]

        return [
            self._inner.register_step_pre_hook(
                lambda opt, args, kwargs: self._before_update(opt, everything())
            )
        ]

    def _before_update(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        capture = self._capture
        if capture is not None:
            capture.before_update(params)

    # -- commit --------------------------------------------------------------------------------
    def commit(self, background: bool = True) -> None:
        """Starts capturing the current state; returns once only the parameters are left to copy."""
        self.wait()
        layout = None
        if self.sharded:
            layout = self._optimizer.checkpoint_layout()  # applies the gathers waiting for the next forward
            # Before the first forward the state is per parameter, and that forward re-keys it: copy it now.
            background = background and layout is not None
        elif isinstance(self._optimizer, DistributedOptimizer) and self._optimizer.pending_updates():
            # Overlap mode: the last step's updates wait for the next forward; the commit holds them.
            self._optimizer.apply_pending_updates()
        version = self._spare
        version.splits = []
        units: dict[int, Unit] = {}
        loose: list[Unit] = []
        sliced = {} if layout is None else self._shard_state(version, layout, units)
        model_state = self._model.state_dict(keep_vars=True)
        if layout is None:  # nothing in shared memory unless this commit is cut over the ranks
            version.flats, version.region, version.shared, version.params = {}, None, False, []
            plan = self._plain_plan(version, model_state, units, background)
        else:
            plan = elastic_plan.plan_model(version, model_state, sliced, {})
        plan.fill(version, model_state, units, loose)
        if layout is None:
            self._plain_values(version, plan)
        capture = Capture(loose + list(units.values()))
        self.commits += 1
        version.number = self.commits
        if version.shared and version.region is not None:
            # Marked by whichever thread copies the last part (here, at once, when this rank's parts
            # are empty): a rank killed right after its next update has marked it, so the survivors
            # can restore this commit.
            capture.when_done(lambda region=version.region, number=version.number: region.finished(number))
        for unit in loose:
            capture.copy_now(unit)
        if not background:
            capture.run()
            self._gather(version)
            self._publish(version)
        else:
            self._capture = capture
            done = _Pending()
            self._running = (done, capture)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=_serve, args=(self._jobs,), name="commsched-commit", daemon=True
                )
                self._worker.start()
            self._jobs.put(lambda: self._run(capture, version, done))
        self._save_to_disk()

    def _plain_plan(
        self, version: Version, model_state: dict[str, Any], units: dict[int, Unit], background: bool
    ) -> elastic_plan.Plan:
        """An unsharded commit's copies into `version`, planned again only when the tensors changed
        (elastic_plan.Layout): building them at each commit() took about 30 us per parameter with Adam
        on the training thread."""
        params = [p for group in self._inner.param_groups for p in group["params"]]
        ranks = commsched.size() if commsched.is_initialized() else 1
        me = commsched.rank() if ranks > 1 else 0
        if self._layout is None or not self._layout.holds(ranks, me, model_state, params, self._inner.state):
            self._layout = elastic_plan.Layout(ranks, me, model_state, params, self._inner.state)
            self._layouts += 1
        key = self._layouts
        cut: dict[int, str] = {}  # parameter id -> its name, for those each rank copies a part of
        if background and not self.sharded:  # the first, blocking commit: a joining worker's, copied whole
            cut = self._split_state(version, units, model_state, params, key)
        plan = version.plan
        if plan is None or plan.key != key or plan.cut != cut:
            plan = version.plan = elastic_plan.plan_model(version, model_state, {}, cut)
            plan.key = key
            self._plan_state(version, plan, params)
        return plan

    def _plan_state(self, version: Version, plan: elastic_plan.Plan, params: list[torch.Tensor]) -> None:
        """Adds the per-parameter optimizer state to `plan`: tensors to their parameters' copies, the
        names of the rest (copied at each commit)."""
        cut = {(split.index, split.name) for split in version.splits if not split.model}
        for i, param in enumerate(params):
            for name, value in self._inner.state.get(param, {}).items():
                if (i, name) in cut:  # each rank copies its part: joined at restore()
                    continue
                if isinstance(value, torch.Tensor):
                    key = f"optimizer.{i}.{name}"
                    plan.state.setdefault(i, {})[name] = destination = version.tensor(key, value)
                    source = lambda p=param, n=name: self._inner.state[p][n]  # looked up when copied
                    plan.by_param.setdefault(id(param), (param, []))[1].append(
                        elastic_plan.copy_into(key, source, destination)
                    )
                else:
                    plan.state.setdefault(i, {})[name] = None
                    plan.state_objects.append((i, param, name))

    def _plain_values(self, version: Version, plan: elastic_plan.Plan) -> None:
        """The optimizer's state as `plan` places it, with its non-tensor values and param_groups copied now."""
        state = plan.state  # this version's own: only the commits into it write it
        for i, param, name in plan.state_objects:
            state[i][name] = copy.deepcopy(self._inner.state[param][name])
        groups = [
            {**copy.deepcopy({k: v for k, v in group.items() if k != "params"}), "params": []}
            for group in self._inner.param_groups
        ]
        index = 0
        for group, original in zip(groups, self._inner.param_groups, strict=True):
            group["params"] = list(range(index, index + len(original["params"])))
            index += len(original["params"])
        version.optimizer = {"state": state, "param_groups": groups}
        version.layout = None

    def _split_state(
        self,
        version: Version,
        units: dict[int, Unit],
        model_state: dict[str, Any],
        params: list[torch.Tensor],
        key: int,
    ) -> dict[int, str]:
        """Unsharded, with every rank on this host: this rank's 1/N of each parameter and of its optimizer
        state into shared memory (elastic_split). Returns the parameters so cut (id -> model name).
        `key` numbers the layout of tensors the cut is planned for (elastic_plan.Layout)."""
        ranks = commsched.size() if commsched.is_initialized() else 1
        if not SHARED_MEMORY or ranks < 2 or not _replicated(self._optimizer):
            return {}
        me = commsched.rank()
        if self._cut_plan is None or self._cut_plan[0] != key:
            self._cut_plan = (key, *elastic_split.plan(model_state, params, self._inner.state, ranks))
            self._cut_copies = {}
        _, splits, totals = self._cut_plan
        if not splits:
            return {}
        version.gather_name = f"commsched.commit.{self._gathers}"
        self._gathers += 1
        region = self._shared_region(totals, version.gather_name)
        if region is None:
            return {}
        version.region, version.shared, version.received = region, True, {}
        version.flats = region.slot(self.commits + 1)
        version.splits, version.split_ranks = splits, ranks
        index = (self.commits + 1) % elastic_shm.SLOTS
        held = self._cut_copies.get(index)
        if held is None or held[0] is not region:
            held = self._cut_copies[index] = (
                region,
                *self._cut_into(version.flats, splits, params, ranks, me),
            )
        _, copies, cut = held
        for param, pieces in copies:
            units.setdefault(id(param), Unit(param)).copies.extend(pieces)
        return dict(cut)

    def _cut_into(
        self,
        flats: dict[torch.dtype, torch.Tensor],
        splits: list[elastic_split.Split],
        params: list[torch.Tensor],
        ranks: int,
        me: int,
    ) -> tuple[list[tuple[torch.Tensor, list[Copy]]], dict[int, str]]:
        """This rank's copies of its part of every cut tensor into one slot's `flats`, by parameter, and
        the parameters so cut (id -> model name)."""
        by_param: dict[int, tuple[torch.Tensor, list[Copy]]] = {}
        cut: dict[int, str] = {}
        for split in splits:
            param = params[split.index]
            start, length = elastic_split.part(split.numel, ranks, me)
            if split.model:
                cut[id(param)] = split.model
                source = lambda p=param: p
                key = f"split.{split.model}"
            else:  # looked up when copied: the optimizer may replace its state tensors
                source = lambda p=param, k=split.name: self._inner.state[p][k]
                key = f"split.optimizer.{split.index}.{split.name}"
            if length:
                destination = flats[split.dtype][split.offset : split.offset + length]
                by_param.setdefault(id(param), (param, []))[1].append(
                    elastic_plan.copy_into(key, source, destination, flat=(start, length))
                )
        return list(by_param.values()), cut

    def _shard_state(
        self, version: Version, layout: dict[str, Any], units: dict[int, Unit]
    ) -> dict[int, int]:
        """Adds this rank's shards (copied before their bucket's next update, into one flat host tensor
        per dtype, which the background thread gathers) and the per-parameter values (copied now).

        Ranks that share a host's memory also put their shard of the parameters there: the ranks hold
        the same parameters, so every rank's 1/N rebuilds them all. Returns the parameters so covered
        (id -> index), which then need no copy of their own."""
        own = sharded.own_shards(self._optimizer, layout)
        totals: dict[torch.dtype, int] = {}
        version.places = []
        for k, key, _, value in own:
            offset = totals.get(value.dtype, 0)
            version.places.append((value.dtype, k, key, offset, value.numel()))
            totals[value.dtype] = offset + value.numel()
        state_totals = dict(totals)
        slices = elastic_shard.parameter_slices(self._optimizer, layout)
        version.params = []
        for k, (param, length, _) in enumerate(slices):
            offset = totals.get(param.dtype, 0)
            version.params.append((param.dtype, k, offset, length))
            totals[param.dtype] = offset + length
        version.gather_name = f"commsched.commit.{self._gathers}"
        self._gathers += 1
        shm = SHARED_MEMORY and bool(totals)
        version.region = self._shared_region(totals, version.gather_name) if shm else None
        version.shared, version.received = version.region is not None, {}
        covered: dict[int, int] = {}
        if version.region is not None:
            version.flats = version.region.slot(self.commits + 1)
            for (dtype, _, offset, _), (owner, _, parts) in zip(version.params, slices, strict=True):
                flat = version.flats[dtype]
                for param, at, frm, length in parts:
                    piece = elastic_plan.copy_into(
                        "param.shard",
                        lambda p=param: p,
                        flat[offset + at : offset + at + length],
                        flat=(frm, length),
                    )
                    units.setdefault(id(owner), Unit(owner)).copies.append(piece)
            params = self._optimizer.plain_parameters()
            covered = {id(params[i]): i for i in elastic_shard.covered(layout)}
        else:  # the flats are sent to every rank: the parameters, the same everywhere, stay out
            version.params = []
            version.flats = {
                dtype: version.tensor(f"flat.{dtype}", torch.empty(numel, dtype=dtype))
                for dtype, numel in state_totals.items()
            }
        for (k, key, owner, value), (dtype, _, _, offset, numel) in zip(own, version.places, strict=True):
            destination = version.flats[dtype][offset : offset + numel]
            piece = elastic_plan.copy_into(f"optimizer.shard.{k}.{key}", lambda v=value: v, destination)
            units.setdefault(id(owner), Unit(owner)).copies.append(piece)
        values = {
            index: {
                k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in record.items()
            }
            for index, record in self._optimizer.member_values().items()
        }
        version.optimizer = {"state": values, "param_groups": copy.deepcopy(self._optimizer.plain_groups())}
        version.layout = layout
        return covered

    def _shared_region(self, totals: dict[torch.dtype, int], name: str) -> elastic_shm.Region | None:
        """This layout's shared memory when every rank runs on this host (decided once per layout, by a
        small allgather); None: the shards go by broadcasts."""
        if self._hosts is None or self._hosts != totals:
            self._hosts = dict(totals)  # the same commit on every rank: the same totals
            region = elastic_shm.Region(totals)
            self._region = region if region.share(f"{name}.hosts", self.commits + 1) else None
            if self._region is not None:
                # Numbered alike on every rank from here: each rank's file is read by the others.
                self.commits = region.first - 1
        return self._region

    def _gather(self, version: Version) -> None:
        """A sharded commit, or one cut over the ranks: every rank's copied parts, so any ranks left after
        a failure have them all.

        On one host they are in shared memory already: every rank's mark in its own file says it copied
        its part (elastic_shm.Region.await_every_part). Across hosts, one broadcast per rank into reused
        host buffers: on this project's 2-core host that cost less step time than one allgather of the
        same bytes.
        """
        if not version.flats or (version.layout is None and version.region is None):
            return
        region = version.region
        if region is not None:
            region.finished(version.number)
            region.await_every_part(version.number, _core.running)
            region.release()  # every rank mapped every file before it marked its part
            return
        ranks, me = version.layout["ranks"], commsched.rank()
        received: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        handles = []
        for dtype, flat in version.flats.items():
            for r in range(ranks):
                buffer = flat if r == me else version.tensor(f"rank{r}.{dtype}", flat)
                received[(r, dtype)] = buffer
                name = f"{version.gather_name}.{str(dtype).removeprefix('torch.')}.{r}"
                handles.append(commsched.broadcast_async(buffer, root=r, name=name, priority=_LAST))
        for handle in handles:
            handle.wait()
        version.received = received

    def _run(self, capture: Capture, version: Version, done: _Pending) -> None:
        """The background thread: copies what is left, then makes the version the committed one."""
        try:
            try:
                capture.run()
                self._gather(version)
            except BaseException as error:  # noqa: BLE001 - reported by wait(); the last commit stays
                if capture.error is not None or not complete_everywhere(version):
                    capture.error = capture.error or error
                    return
            finally:
                if self._capture is capture:
                    self._capture = None
            self._publish(version)
        finally:
            done.set()

    def _publish(self, version: Version) -> None:
        with self._lock:
            self._spare = self._committed if self._committed is not None else Version()
            self._committed = version

    def wait(self) -> None:
        """Blocks until the last commit is captured; a failed capture is warned of (the one before stays)."""
        if self._running is None:
            return
        done, capture = self._running
        done.wait()
        self._running = None
        if capture.error is not None:
            warnings.warn(
                f"commit {self.commits} was not captured ({capture.error}); a restore goes back to the commit before it",
                RuntimeWarning,
                stacklevel=3,
            )

    def _save_to_disk(self) -> None:
        if self._directory is None or not commsched.is_initialized():
            return
        if self._disk is None:
            from commsched.torch.checkpoint import Checkpointer

            self._disk = Checkpointer(self._model, self._optimizer, self._directory)
        self._disk.save(self.commits)

    # -- restore -------------------------------------------------------------------------------
    def restore(self, discard_in_flight: Callable[[Any], None]) -> int:
        """Loads the last complete commit into the model and the optimizer; returns its number.

        A sharded optimizer is taken back to before its layout and given the plain form: its next
        forward lays it out at the ranks of that moment and cuts the state into shards again.
        """
        self.wait()
        self.close_disk()  # its save in progress may belong to the failed generation
        committed = self._committed
        if committed is None:
            raise RuntimeError("TorchState.restore(): nothing was committed yet; call commit() first")
        self._model.load_state_dict(committed.model_state())
        if self.sharded:
            elastic_shard.unbuild(self._optimizer)
        else:
            discard_in_flight(self._optimizer)
        self._optimizer.load_state_dict(committed.optimizer_state())
        if committed.region is not None:
            committed.region.release_all()  # a lost rank's file too: read now, mapped while needed
        return committed.number

    def reformed(self) -> None:
        """After a re-forming: the disk Checkpointer and the gathers' names start afresh at the new ranks;
        a sharded optimizer takes them too (rebuilt from the commit if no restore() took it apart)."""
        self.close_disk()  # its collectives belong to the ranks that were
        self._gathers = 0
        self._region = self._hosts = None  # shared by the ranks that were; the commits keep theirs mapped
        self._cut_plan, self._cut_copies = None, {}
        if not self.sharded:
            return
        if elastic_shard.built(self._optimizer):  # hosts changed: the state is the commit just taken
            self.restore(lambda optimizer: None)
        elastic_shard.adopt_ranks(self._optimizer)

    def committed_number(self) -> int | None:
        """The number of the last complete commit (None before any)."""
        self.wait()
        return None if self._committed is None else self._committed.number

    def close_disk(self) -> None:
        """Stops the disk Checkpointer (a new one starts at the next commit, at the current ranks)."""
        disk, self._disk = self._disk, None
        if disk is None:
            return
        try:
            disk.close()
        except Exception as error:  # noqa: BLE001 - the version was lost with the ranks; the next commit saves
            warnings.warn(f"the disk commit in progress was not saved: {error}", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Waits for the capture and removes the update hooks."""
        self.wait()
        self.close_disk()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.stop_worker()

    def stop_worker(self) -> None:
        """Ends the commit thread (a later commit starts it again); none is left running at exit."""
        worker, self._worker = self._worker, None
        if worker is not None:
            self._jobs.put(None)
            worker.join()


def _serve(jobs: queue.Queue[Callable[[], None] | None]) -> None:
    """The commit thread: runs each commit's capture in turn until it gets None."""
    lower_priority()
    while (job := jobs.get()) is not None:
        job()


def _finish_at_exit(owner: weakref.ref[BackgroundCommit]) -> None:
    """At exit: lets the capture in progress end, warning of a failure instead of raising."""
    commit = owner()
    if commit is not None:
        commit.wait()
        commit.stop_worker()  # a thread still waiting for work at exit made C++ teardown abort


def _replicated(optimizer: Any) -> bool:
    """True for a DistributedOptimizer that reduces over every rank (the global process set): the ranks
    then hold the same parameters and optimizer state, so each may copy only its part of them."""
    options = getattr(optimizer, "_options", None)
    return isinstance(optimizer, DistributedOptimizer) and options is not None and not options.core


def directory_setting(directory: str | os.PathLike[str] | None) -> str | None:
    """TorchState(checkpoint_dir=...) as a path, or None (memory only)."""
    if directory is None:
        return None
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"TorchState(checkpoint_dir=...) takes a directory path, not {type(directory).__name__}"
        )
    return os.fspath(directory)
