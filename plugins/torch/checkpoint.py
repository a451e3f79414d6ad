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

With DistributedOptimizer(..., shard=True) each rank writes its own shard of the optimizer state
(nothing is gathered), and the manifest records the layout and rank count (checkpoint_shards): at
the same rank count and layout each rank loads its shard as it is; at another the shards are joined
into per-parameter state and cut again (checkpoint_read).

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
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from commsched.torch import checkpoint_format as fmt
from commsched.torch import checkpoint_shards as sharded
from commsched.torch.checkpoint_capture import READY, WAITING, Capture, Copy, Unit
from commsched.torch.checkpoint_check import check_version
from commsched.torch.checkpoint_read import Contents, discard, read_version, shard_name
from commsched.torch.checkpoint_worker import Job, finish_at_exit, now_us, trace, work
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
        self._rank, self._size = _ranks()
        if sharded.is_sharded(optimizer) and getattr(optimizer, "_ranks", self._size) != self._size:
            raise NotImplementedError(
                "Checkpointer saves DistributedOptimizer(shard=True) over every rank only, not over a process "
                "set; save optimizer.full_state_dict() (call it on every rank) with torch.save on rank 0 instead"
            )
        self.directory = Path(settings["directory"])
        self.keep: int = settings["keep"]
        self._model = model
        self._optimizer = optimizer
        self._inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
        self._scheduler = lr_scheduler
        self._run = self._agreed_run_id(next(_instances))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file of that name, no permission, a read-only file system
            raise OSError(
                error.errno,
                f"Checkpointer cannot use {self.directory} as its directory ({error.strerror}); give a "
                "directory every rank can write to (directory=... or COMMSCHED_CHECKPOINT_DIR)",
            ) from None
        # save(), wait(), load() and close() run one at a time: saves from several threads are
        # serialized, so no version is overwritten, lost or blamed on another save's caller.
        self._lock = threading.RLock()
        self._job: Job | None = None
        self._capture: Capture | None = None  # the capture the update hooks feed, while one runs
        self._stateless = False  # the optimizer updated a parameter and kept no state for it
        self._last_step: int | None = None
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._hooks = self._register_hooks()
        self.last_durable_seconds: float | None = None
        atexit.register(finish_at_exit, weakref.ref(self))

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
        started_us = now_us()
        # The layout of a sharded optimizer (its pending gathers applied), None while its state is per parameter.
        layout = self._optimizer.checkpoint_layout() if sharded.is_sharded(self._optimizer) else None
        pending = self._pending_updates()
        if layout is not None:
            params = self._optimizer.plain_parameters()
        else:
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
        fixed: dict[str, int] = {}
        values: dict[str, Any] | None = None
        if layout is not None:
            found, shard_sources, fixed, values = sharded.entries(
                self._optimizer, layout, self._rank, self._size
            )
            entries.extend(found)
            sources.update(shard_sources)
        if layout is None and any(self._nested(p) for p in params if id(p) in pending):
            # The update still to come may add to or replace the tensors inside those values (LBFGS's
            # history): apply it now, so what is planned here is what the capture copies.
            self._optimizer.apply_pending_updates()
            pending = set()
        for i, param in enumerate(params if layout is None else []):
            for name, value in self._inner.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    key = f"optimizer.{i}.{name}"
                    entries.append(fmt.Entry(key, value.dtype, tuple(value.shape)))
                    sources[key] = (param, lambda p=param, n=name: self._inner.state[p][n])
            for position, tensor in enumerate(self._nested(param)):
                key = fmt.nested_key(i, position)
                entries.append(fmt.Entry(key, tensor.dtype, tuple(tensor.shape)))
                sources[key] = (param, lambda t=tensor: t)  # no update comes before its copy
        manifest = self._manifest_skeleton(step, params, layout)
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
        pieces = fmt.plan(entries, self._size, rank_local, fixed)
        placed = fmt.arrange(pieces[self._rank])
        buffer = self._host_buffer(sum(p.nbytes for p, _ in placed), params)
        path = self.directory / fmt.version_name(step, self._run)
        job = Job(step, path, Capture([]), pieces, placed, buffer, manifest)
        if values is not None:
            job.state_values = values
        units = self._units(job, sources, params, pending, keep_values=values is None)
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
        trace(f"save {step}", started_us)

    def _pending_updates(self) -> set[int]:
        """Parameters whose update of a closed iteration is still to come (overlap mode)."""
        if not isinstance(self._optimizer, DistributedOptimizer) or sharded.is_sharded(self._optimizer):
            return set()  # a sharded optimizer's pending gathers were applied by checkpoint_layout()
        pending = self._optimizer.pending_updates()
        if pending and not self._stateless and any(not self._inner.state.get(p) for p in pending):
            # The pending update creates this state (the first step): its shape is not known yet.
            self._optimizer.apply_pending_updates()
            return set()
        return {id(p) for p in pending}

    def _manifest_skeleton(
        self, step: int, params: list[torch.Tensor], layout: dict[str, Any] | None
    ) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(params)}
        plain = (
            self._optimizer.plain_groups()
            if layout is not None
            else [
                {**group, "params": [index[id(p)] for p in group["params"]]}
                for group in self._inner.param_groups
            ]
        )
        groups = []
        for g, group in enumerate(plain):
            values = {
                k: fmt.to_json(v, f"optimizer param_groups[{g}][{k!r}]")
                for k, v in group.items()
                if k != "params"
            }
            groups.append({**values, "params": list(group["params"])})
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
        } | ({} if layout is None else {"sharded": layout})

    def _units(
        self,
        job: Job,
        sources: dict[str, tuple[Any, Any]],
        params: list[torch.Tensor],
        pending: set[int],
        keep_values: bool,
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
        if self._rank == 0 and keep_values:  # rank 0 writes the manifest: it keeps non-tensor state
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

    def _plain_values(self, param: torch.Tensor) -> dict[str, Any]:
        """The parameter's optimizer state that is not a tensor itself (numbers, LBFGS's lists)."""
        return {k: v for k, v in self._inner.state.get(param, {}).items() if not isinstance(v, torch.Tensor)}

    def _nested(self, param: torch.Tensor) -> list[torch.Tensor]:
        """The tensors inside the parameter's non-tensor optimizer state, in the order they are keyed."""
        return fmt.nested_tensors(self._plain_values(param))

    def _keep_values(self, job: Job, index: int, param: torch.Tensor) -> None:
        values = self._plain_values(param)
        if values:
            positions = itertools.count()
            job.state_values[str(index)] = fmt.to_json(
                values,
                f"optimizer state of parameter {index}",
                lambda tensor: fmt.nested_key(index, next(positions)),
            )

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
                target=work, args=(weakref.ref(self), self._jobs), name="commsched-checkpoint", daemon=True
            )
            self._worker.start()

    def _complete(self, job: Job) -> None:
        """Capture, write this rank's shard, agree, and (rank 0) write the manifest; on the worker."""
        ok, size, crc = 1, 0, 0
        try:
            start = now_us()
            job.capture.run()
            trace(f"capture {job.step}", start, f'{{"inline_units":{job.capture.inline_copies}}}')
            start = now_us()
            size, crc = self._write_shard(job)
            trace(f"write {job.step}", start, f'{{"bytes":{size}}}')
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
                discard(job.path)
        committed = self._allreduce(committed, f"{job.step}.commit")
        if not committed[0] and job.error is None:
            job.error = RuntimeError(f"checkpoint {job.path}: another rank failed to write its shard")
        job.durable_after = time.perf_counter() - job.started

    def _write_shard(self, job: Job) -> tuple[int, int]:
        metadata = {
            "format": fmt.FORMAT,
            "step": str(job.step),
            "shard": str(self._rank),
            "of": str(self._size),
        }
        header = fmt.shard_header(job.placed, metadata)
        body = job.buffer.numpy() if job.buffer.numel() else b""
        return fmt.write_durable(job.path / shard_name(self._rank, self._size), [header, body])

    def _write_manifest(self, job: Job, shards: np.ndarray) -> None:
        manifest = job.manifest
        manifest["optimizer"]["values"] = job.state_values
        manifest["shards"] = [
            {"file": shard_name(r, self._size), "bytes": int(shards[r, 1]), "crc32": int(shards[r, 2])}
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

    def _remove_old(self, job: Job) -> None:
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
                contents = read_version(version)
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
            try:
                # Before anything is restored: a refused version leaves model and optimizer as they were.
                check_version(self._model, self._optimizer, self._inner, contents, version.path)
            except fmt.DamagedVersion as why:
                warnings.warn(f"checkpoint {version.path} is skipped: {why}", RuntimeWarning, stacklevel=3)
                continue
            restored = self._restore(version, contents)
            self._agree_loaded(restored.step)
            return restored
        if step is not None:
            raise FileNotFoundError(f"no intact checkpoint of step {step} in {self.directory}")
        self._agree_loaded(-1)
        return None

    def _restore(self, version: fmt.Version, contents: Contents) -> Restored:
        sharded.restore(self._optimizer, contents, self._rank)
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
