"""Checkpointer: saves model, optimizer and LR scheduler state in the background while training runs.

    checkpointer = commsched.torch.Checkpointer(model, optimizer, "ckpt/", keep=3, lr_scheduler=scheduler)
    restored = checkpointer.load()                  # None on a fresh start
    start = restored.step + 1 if restored else 0
    for step in range(start, steps):
        ...; optimizer.step()
        if step % 10 == 0:
            checkpointer.save(step, extra={"epoch": epoch})   # returns at once

A version is the state at the iteration boundary where save() is called, bit for bit. Nothing
is copied up front: each parameter and its optimizer state are copied into a reused host
buffer (pinned for GPU tensors) by a background thread while the next forward and backward
run, and only what that thread has not reached when the parameter's next update comes is
copied right then, on the training thread. In overlap mode (DistributedOptimizer(...,
overlap_forward=True)) the update that still belongs to the version is the one the next
forward applies, so a parameter becomes copyable right after it. Model buffers (batch-norm
statistics, which the next forward changes) and tensor extras are copied inside save().

Every rank holds the same state, so each rank writes its own share, balanced by bytes (a big
tensor is cut between rows), as a safetensors shard: a plain, widely read format that holds
tensors only, which is all a shard needs, and that can be written straight from the host
buffer with our own fsync. torch.distributed.checkpoint's format would tie readers to torch
and would pickle its metadata. Shards are written under a temporary name, fsynced, renamed,
and the folder fsynced; a small allreduce through commsched (lowest priority, after every
gradient) tells rank 0 that every shard is durable and its CRC-32, and rank 0 then writes the
JSON manifest the same way, its sha256 checksum last; a second one tells every rank the version
is complete. A crash at any moment leaves the previous version loadable: a version counts only
once its manifest exists, and load() verifies the manifest (checksum and schema) and every
shard's size and CRC-32, skipping a version it cannot trust with a warning. A save that fails
(a full disk) is reported by the next wait() or save() and leaves no files behind. save() calls
from several threads run one after another, never interleaved.

The directory must be shared by all ranks (or the same path on one host). Settings:
COMMSCHED_CHECKPOINT_DIR (directory when not passed), COMMSCHED_CHECKPOINT_KEEP (versions kept).
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import os
import queue
import random
import shutil
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from commsched.torch import checkpoint_format as fmt
from commsched.torch.checkpoint_capture import READY, WAITING, Capture, Copy, Unit
from commsched.torch.optimizer import DistributedOptimizer

import commsched
import torch

_config = importlib.import_module("commsched.config")  # commsched.config is also a function
_LAST = 2**31 - 1  # priority: after every gradient
_instances = itertools.count()


@dataclass
class Restored:
    """What load() restored: the step of the version and the extra dict given to save()."""

    step: int
    extra: dict[str, Any]
    path: Path


@dataclass(eq=False)
class _Job:
    """One save() in progress."""

    step: int
    path: Path
    capture: Capture
    pieces: list[list[fmt.Piece]]
    placed: list[tuple[fmt.Piece, int]]
    buffer: torch.Tensor
    manifest: dict[str, Any]
    state_values: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    durable_after: float | None = None  # seconds from save() to a complete version


def _now_us() -> int:
    return time.time_ns() // 1000  # wall clock, like the core's timeline


def _trace(name: str, start_us: int, args: str = "{}") -> None:
    """A span on the timeline's "checkpoint" track (COMMSCHED_TIMELINE), if tracing."""
    span = getattr(commsched._core, "timeline_span", None)
    if span is not None and commsched.is_initialized():
        span("checkpoint", name, start_us, max(_now_us() - start_us, 1), args)


def _lower_priority() -> None:
    try:  # Linux: a thread's nice value is its own; the core's thread and training go first
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class Checkpointer:
    """Saves versions of model, optimizer and LR scheduler state without stalling training."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None = None,
        keep: int | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        settings = _config.checkpoint_settings(
            {"directory": None if directory is None else os.fspath(directory), "keep": keep}
        )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Checkpointer(model=...) takes a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Checkpointer(optimizer=...) takes an optimizer, not {type(optimizer).__name__}")
        if getattr(optimizer, "sharded", False):
            raise NotImplementedError(
                "Checkpointer cannot save DistributedOptimizer(shard=True) yet: its state is cut across ranks. "
                "Save optimizer.full_state_dict() (call it on every rank) with torch.save on rank 0, and load it "
                "with optimizer.load_state_dict() at any number of ranks"
            )
        self.directory = Path(settings["directory"])
        self.keep: int = settings["keep"]
        self._model = model
        self._optimizer = optimizer
        self._inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
        self._scheduler = lr_scheduler
        self._rank, self._size = _ranks()
        self._run = self._agreed_run_id(next(_instances))
        self.directory.mkdir(parents=True, exist_ok=True)
        # save(), wait(), load() and close() run one at a time: saves from several threads are
        # serialized, so no version is overwritten, lost or blamed on another save's caller.
        self._lock = threading.RLock()
        self._job: _Job | None = None
        self._capture: Capture | None = None  # the capture the update hooks feed, while one runs
        self._stateless = False  # the optimizer updated a parameter and kept no state for it
        self._last_step: int | None = None
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._hooks = self._register_hooks()
        self.last_durable_seconds: float | None = None
        atexit.register(_finish_at_exit, weakref.ref(self))

    # -- setup -------------------------------------------------------------------------------
    def _agreed_run_id(self, instance: int) -> int:
        """A random id for this job's versions, rank 0's on every rank (a version of an abandoned run never mixes in)."""
        value = np.array([random.getrandbits(62) if self._rank == 0 else 0], dtype=np.int64)
        if self._size > 1:
            commsched.broadcast(value, root=0, name=f"commsched.checkpoint{instance}.run")
        return int(value[0])

    def _register_hooks(self) -> list[Any]:
        if isinstance(self._optimizer, DistributedOptimizer):
            return [
                self._optimizer.register_param_update_pre_hook(self._before_update),
                self._optimizer.register_param_update_post_hook(self._after_update),
            ]

        def everything() -> list[torch.Tensor]:
            return [p for group in self._inner.param_groups for p in group["params"]]

        return [
            self._inner.register_step_pre_hook(
                lambda opt, args, kwargs: self._before_update(opt, everything())
            ),
            self._inner.register_step_post_hook(
                lambda opt, args, kwargs: self._after_update(opt, everything())
            ),
        ]

    def _before_update(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        capture = self._capture
        if capture is not None:
            capture.before_update(params)

    def _after_update(self, optimizer: Any, params: list[torch.Tensor]) -> None:
        stepped = [p for p in params if p.grad is not None]
        if not self._stateless and stepped and all(not self._inner.state.get(p) for p in stepped):
            self._stateless = True
        capture = self._capture
        if capture is not None:
            capture.after_update(params)

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, extra: dict[str, Any] | None = None) -> None:
        """Starts saving the current state as version `step`; returns once the capture is under way.

        A save() while the previous version is still being written waits for it first, and raises
        (without starting) if that version failed. Calls from several threads run one at a time.
        `extra` (JSON values or tensors, the same on every rank) comes back from load().
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"save(step) takes a step number >= 0, not {step!r}")
        with self._lock:
            self._save(step, extra)

    def _save(self, step: int, extra: dict[str, Any] | None) -> None:
        try:
            self.wait()
        except RuntimeError as error:
            raise RuntimeError(
                f"save({step}) did not start, because the save before it failed: {error}; call "
                f"save({step}) again to save the current state"
            ) from error.__cause__
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"save({step}) after save({self._last_step}): steps must increase")
        started_us = _now_us()
        pending = self._pending_updates()
        params = [p for group in self._inner.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        entries: list[fmt.Entry] = []
        sources: dict[str, tuple[Any, Any]] = {}  # key -> (owner parameter or None, source)
        for name, tensor in self._model.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor):
                key = f"model.{name}"
                entries.append(fmt.Entry(key, tensor.dtype, tuple(tensor.shape)))
                owner = tensor if id(tensor) in index else None
                sources[key] = (owner, lambda t=tensor: t)
        for i, param in enumerate(params):
            for name, value in self._inner.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    key = f"optimizer.{i}.{name}"
                    entries.append(fmt.Entry(key, value.dtype, tuple(value.shape)))
                    sources[key] = (param, lambda p=param, n=name: self._inner.state[p][n])
        manifest = self._manifest_skeleton(step, params)
        for name, value in sorted((extra or {}).items()):
            if not isinstance(name, str):
                raise TypeError(f"save(extra=...) keys must be strings, not {name!r}")
            if isinstance(value, torch.Tensor):
                key = f"extra.{name}"
                entries.append(fmt.Entry(key, value.dtype, tuple(value.shape)))
                sources[key] = (None, lambda v=value: v)
            else:
                manifest["extra"][name] = fmt.to_json(value, f"save(extra={{{name!r}: ...}})")
        for entry in entries:
            fmt.dtype_name(entry.dtype)  # refuses what the format cannot hold, on the caller's thread
        rank_local = frozenset(key for key, (owner, _) in sources.items() if owner is None)
        pieces = fmt.plan(entries, self._size, rank_local)
        placed = fmt.arrange(pieces[self._rank])
        buffer = self._host_buffer(sum(p.nbytes for p, _ in placed), params)
        path = self.directory / fmt.version_name(step, self._run)
        job = _Job(step, path, Capture([]), pieces, placed, buffer, manifest)
        units = self._units(job, sources, params, pending)
        job.capture = Capture(units)
        for unit in units:
            if unit.param is None:
                job.capture.copy_now(unit)
        self._last_step = step
        self._job = job
        self._capture = job.capture
        path.mkdir(parents=True, exist_ok=True)
        self._start_worker()
        self._jobs.put(job)
        _trace(f"save {step}", started_us)

    def _pending_updates(self) -> set[int]:
        """Parameters whose update of a closed iteration is still to come (overlap mode)."""
        if not isinstance(self._optimizer, DistributedOptimizer):
            return set()
        pending = self._optimizer.pending_updates()
        if pending and not self._stateless and any(not self._inner.state.get(p) for p in pending):
            # The pending update creates this state (the first step): its shape is not known yet.
            self._optimizer.apply_pending_updates()
            return set()
        return {id(p) for p in pending}

    def _manifest_skeleton(self, step: int, params: list[torch.Tensor]) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(params)}
        groups = []
        for g, group in enumerate(self._inner.param_groups):
            values = {
                k: fmt.to_json(v, f"optimizer param_groups[{g}][{k!r}]")
                for k, v in group.items()
                if k != "params"
            }
            groups.append({**values, "params": [index[id(p)] for p in group["params"]]})
        scheduler = None
        if self._scheduler is not None:
            scheduler = fmt.to_json(self._scheduler.state_dict(), "lr_scheduler.state_dict()")
        return {
            "format": fmt.FORMAT,
            "step": step,
            "run": f"{self._run:016x}",
            "ranks": self._size,
            "optimizer": {"class": type(self._inner).__name__, "param_groups": groups, "values": {}},
            "lr_scheduler": scheduler,
            "extra": {},
        }

    def _units(
        self, job: _Job, sources: dict[str, tuple[Any, Any]], params: list[torch.Tensor], pending: set[int]
    ) -> list[Unit]:
        units: dict[int, Unit] = {}
        loose: list[Unit] = []
        for piece, offset in job.placed:
            owner, source = sources[piece.entry.key]
            view = job.buffer[offset : offset + piece.nbytes].view(piece.entry.dtype).view(piece.shape)
            copy = Copy(piece, source, view)
            if owner is None:
                loose.append(Unit(None, [copy]))
            else:
                units.setdefault(id(owner), Unit(owner)).copies.append(copy)
        if self._rank == 0:  # rank 0 writes the manifest, so it keeps every parameter's non-tensor state
            for i, param in enumerate(params):
                unit = units.setdefault(id(param), Unit(param))
                unit.on_copied = lambda i=i, p=param: self._keep_values(job, i, p)
        for unit in units.values():
            unit.waits = 1 if id(unit.param) in pending else 0
            unit.state = WAITING if unit.waits else READY
        # Forward order first: overlap mode updates the first layers' parameters first.
        order = {id(p): i for i, p in enumerate(self._model.parameters())}
        ordered = sorted(units.values(), key=lambda u: order.get(id(u.param), len(order)))
        return loose + ordered

    def _keep_values(self, job: _Job, index: int, param: torch.Tensor) -> None:
        state = self._inner.state.get(param, {})
        values = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        if values:
            job.state_values[str(index)] = fmt.to_json(values, f"optimizer state of parameter {index}")

    def _host_buffer(self, nbytes: int, params: list[torch.Tensor]) -> torch.Tensor:
        """The reused host buffer; pinned when the state lives on a GPU, so copies run asynchronously."""
        pin = torch.cuda.is_available() and any(p.is_cuda for p in params)
        if self._buffer.numel() < nbytes or (pin and not self._buffer.is_pinned()):
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._buffer[:nbytes]

    # -- background work ---------------------------------------------------------------------
    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(
                target=_work, args=(weakref.ref(self), self._jobs), name="commsched-checkpoint", daemon=True
            )
            self._worker.start()

    def _complete(self, job: _Job) -> None:
        """Capture, write this rank's shard, agree, and (rank 0) write the manifest; on the worker."""
        ok, size, crc = 1, 0, 0
        try:
            start = _now_us()
            job.capture.run()
            _trace(f"capture {job.step}", start, f'{{"inline_units":{job.capture.inline_copies}}}')
            start = _now_us()
            size, crc = self._write_shard(job)
            _trace(f"write {job.step}", start, f'{{"bytes":{size}}}')
        except Exception as error:  # noqa: BLE001 - still take part in the agreement: no rank is left waiting
            job.error, ok = error, 0
        finally:
            if self._capture is job.capture:
                self._capture = None
        report = np.zeros(3 * self._size, dtype=np.int64)
        report[3 * self._rank : 3 * self._rank + 3] = (ok, size, crc)
        report = self._allreduce(report, f"{job.step}.shards")
        committed = np.zeros(1, dtype=np.int64)
        if self._rank == 0:
            shards = report.reshape(self._size, 3)
            if job.error is None and shards[:, 0].all():
                try:
                    self._write_manifest(job, shards)
                    committed[0] = 1
                except Exception as error:  # noqa: BLE001 - reported by wait() on every rank
                    job.error = error
            # Before the commit: no rank can start the next save (whose folder this would see), and
            # every rank has finished writing (each reported above).
            if committed[0]:
                self._remove_old(job)
            else:
                _discard(job.path)
        committed = self._allreduce(committed, f"{job.step}.commit")
        if not committed[0] and job.error is None:
            job.error = RuntimeError(f"checkpoint {job.path}: another rank failed to write its shard")
        job.durable_after = time.perf_counter() - job.started

    def _write_shard(self, job: _Job) -> tuple[int, int]:
        metadata = {
            "format": fmt.FORMAT,
            "step": str(job.step),
            "shard": str(self._rank),
            "of": str(self._size),
        }
        header = fmt.shard_header(job.placed, metadata)
        body = job.buffer.numpy() if job.buffer.numel() else b""
        return fmt.write_durable(job.path / _shard_name(self._rank, self._size), [header, body])

    def _write_manifest(self, job: _Job, shards: np.ndarray) -> None:
        manifest = job.manifest
        manifest["optimizer"]["values"] = job.state_values
        manifest["shards"] = [
            {"file": _shard_name(r, self._size), "bytes": int(shards[r, 1]), "crc32": int(shards[r, 2])}
            for r in range(self._size)
        ]
        tensors: dict[str, Any] = {}
        for rank, pieces in enumerate(job.pieces):
            for piece in pieces:
                entry = piece.entry
                record = tensors.setdefault(
                    entry.key,
                    {"dtype": fmt.dtype_name(entry.dtype), "shape": list(entry.shape), "pieces": []},
                )
                record["pieces"].append(
                    {"shard": rank, "name": piece.name, "rows": [piece.start, piece.stop]}
                )
        manifest["tensors"] = tensors
        fmt.write_durable(job.path / fmt.MANIFEST, [fmt.manifest_bytes(manifest)])

    def _remove_old(self, job: _Job) -> None:
        """Keeps the newest `keep` complete versions up to this one; drops the rest (and abandoned runs)."""
        kept = 0
        for version in reversed(fmt.versions(self.directory)):
            if version.path == job.path:
                kept += 1
                continue
            if version.step < job.step and version.complete and kept < self.keep:
                kept += 1
                continue
            try:
                fmt.remove_version(version)
            except OSError as error:  # the new version is complete: an old one left over is no failure
                warnings.warn(
                    f"checkpoint {version.path} could not be removed: {error}", RuntimeWarning, stacklevel=1
                )

    def _allreduce(self, values: np.ndarray, what: str) -> np.ndarray:
        if self._size == 1:
            return values
        name = f"commsched.checkpoint.{self._run:x}.{what}"
        return commsched.allreduce_async(values, name=name, priority=_LAST, op="sum").wait()

    # -- waiting and loading -----------------------------------------------------------------
    def wait(self) -> None:
        """Blocks until the last save() is durable on every rank; raises what went wrong."""
        with self._lock:
            self._wait()

    def _wait(self) -> None:
        job = self._job
        if job is None:
            return
        if (
            not job.done.is_set()
            and job.capture.waiting()
            and isinstance(self._optimizer, DistributedOptimizer)
        ):
            self._optimizer.apply_pending_updates()  # no next forward will apply them for us
        job.done.wait()
        self._job = None
        self.last_durable_seconds = job.durable_after
        if job.error is not None:
            raise RuntimeError(f"checkpoint step {job.step} was not saved: {job.error}") from job.error

    def latest(self) -> int | None:
        """The step of the newest version whose manifest exists (load() also verifies its shards)."""
        complete = [v for v in fmt.versions(self.directory) if v.complete]
        return complete[-1].step if complete else None

    def load(self, step: int | None = None) -> Restored | None:
        """Restores the newest intact version (or `step`) into model, optimizer and LR scheduler.

        Works at any rank count. A version it cannot trust (unfinished, a shard or the manifest
        damaged or changed, a manifest that fails its checksum or schema) is skipped with a warning
        and the one before it is tried; None when there is nothing to load.
        """
        with self._lock:
            return self._load(step)

    def _load(self, step: int | None) -> Restored | None:
        self.wait()
        candidates = [v for v in fmt.versions(self.directory) if step is None or v.step == step]
        for version in reversed(candidates):
            try:
                contents = _read_version(version)
            except fmt.DamagedVersion as why:
                warnings.warn(f"checkpoint {version.path} is skipped: {why}", RuntimeWarning, stacklevel=3)
                continue
            if not contents.verified:
                warnings.warn(
                    f"checkpoint {version.path} has no manifest checksum (saved by an older commsched): its "
                    "shards are verified, its manifest only for form",
                    RuntimeWarning,
                    stacklevel=3,
                )
            restored = self._restore(version, contents)
            self._agree_loaded(restored.step)
            return restored
        if step is not None:
            raise FileNotFoundError(f"no intact checkpoint of step {step} in {self.directory}")
        self._agree_loaded(-1)
        return None

    def _restore(self, version: fmt.Version, contents: _Contents) -> Restored:
        self._optimizer.load_state_dict(
            {"state": contents.optimizer_state, "param_groups": contents.param_groups}
        )
        self._model.load_state_dict(contents.model)
        if self._scheduler is not None and contents.lr_scheduler is not None:
            self._scheduler.load_state_dict(contents.lr_scheduler)
        self._last_step = None
        return Restored(contents.step, contents.extra, version.path)

    def _agree_loaded(self, step: int) -> None:
        """Raises on every rank if the ranks did not all load the same step."""
        if self._size == 1:
            return
        prefix = f"commsched.checkpoint.{self._run:x}.loaded"
        first = commsched.broadcast(np.array([step], dtype=np.int64), root=0, name=prefix + ".step")
        differs = np.array([int(first[0] != step)], dtype=np.int64)
        if commsched.allreduce(differs, name=prefix + ".differs", op="sum")[0]:
            raise RuntimeError(
                f"ranks loaded different checkpoints from {self.directory} (rank {self._rank}: step {step}, "
                f"rank 0: step {int(first[0])}); every rank must see the same directory"
            )

    def close(self) -> None:
        """Waits for the last save and stops the background thread."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._jobs.put(None)
                self._worker.join()
                self._worker = None
            for handle in self._hooks:
                handle.remove()
            self._hooks = []


def _ranks() -> tuple[int, int]:
    if commsched.is_initialized():
        return commsched.rank(), commsched.size()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "Checkpointer in a torch.distributed job needs commsched: call commsched.init() (or build the "
            "DistributedOptimizer) before the Checkpointer"
        )
    return 0, 1


def _shard_name(rank: int, size: int) -> str:
    return f"shard-{rank:05d}-of-{size:05d}.safetensors"


def _discard(path: Path) -> None:
    """Removes the folder of a save that failed, unless it holds a complete version."""
    if not (path / fmt.MANIFEST).exists():
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Contents:
    """A version read and verified, in the form load_state_dict() takes."""

    step: int
    verified: bool  # the manifest carries a checksum that matched (False: saved before checksums)
    model: dict[str, torch.Tensor]
    optimizer_state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    lr_scheduler: Any
    extra: dict[str, Any]


def _read_version(version: fmt.Version) -> _Contents:
    """Every tensor and value of a version, verified against its manifest; raises DamagedVersion."""
    manifest = fmt.read_manifest(version)
    pieces: dict[str, torch.Tensor] = {}
    try:
        for shard in manifest["shards"]:
            data = fmt.read_verified(version.path / shard["file"], shard["bytes"], shard["crc32"])
            for name, tensor in fmt.shard_tensors(data).items():
                pieces[f"{shard['file']}/{name}"] = tensor
        tensors = {}
        for key, record in manifest["tensors"].items():
            parts = [
                pieces[f"{manifest['shards'][p['shard']]['file']}/{p['name']}"] for p in record["pieces"]
            ]
            tensor = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
            if list(tensor.shape) != record["shape"]:
                raise fmt.DamagedVersion(
                    f"'{key}' has shape {list(tensor.shape)}, the manifest says {record['shape']}"
                )
            tensors[key] = tensor
    except (KeyError, IndexError, ValueError) as error:
        raise fmt.DamagedVersion(f"its shards do not match the manifest ({error!r})") from None
    optimizer_state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            optimizer_state.setdefault(int(index), {})[name] = value
    try:
        for index, values in manifest["optimizer"]["values"].items():
            optimizer_state.setdefault(int(index), {}).update(fmt.from_json(values))
        groups = [fmt.from_json(group) for group in manifest["optimizer"]["param_groups"]]
        scheduler = None if manifest["lr_scheduler"] is None else fmt.from_json(manifest["lr_scheduler"])
        extra = {k: fmt.from_json(v) for k, v in manifest["extra"].items()}
    except (TypeError, ValueError) as error:  # a malformed tuple or item list (only without a checksum)
        raise fmt.DamagedVersion(f"its manifest holds a value that cannot be read ({error})") from None
    extra.update({k[len("extra.") :]: v for k, v in tensors.items() if k.startswith("extra.")})
    return _Contents(
        step=manifest["step"],
        verified=fmt.CHECKSUM in manifest,
        model={k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")},
        optimizer_state=optimizer_state,
        param_groups=groups,
        lr_scheduler=scheduler,
        extra=extra,
    )


def _work(owner: weakref.ref[Checkpointer], jobs: queue.Queue[_Job | None]) -> None:
    _lower_priority()
    while True:
        job = jobs.get()
        if job is None:
            return
        checkpointer = owner()
        try:
            if checkpointer is not None:
                checkpointer._complete(job)
        except Exception as error:  # noqa: BLE001 - a failed collective: the job is over anyway
            job.error = job.error or error
        finally:
            del checkpointer
            job.done.set()


def _finish_at_exit(owner: weakref.ref[Checkpointer]) -> None:
    checkpointer = owner()
    if checkpointer is not None and checkpointer._job is not None:
        try:
            checkpointer.wait()
        except Exception as error:  # noqa: BLE001 - at exit there is nobody left to raise to
            warnings.warn(str(error), RuntimeWarning, stacklevel=1)
