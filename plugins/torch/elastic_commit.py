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

With a directory (TorchState(..., checkpoint_dir=...)) every commit is also saved to disk by a
commsched.torch.Checkpointer, loadable with Checkpointer(model, optimizer, directory).load().
"""

from __future__ import annotations

import copy
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

from commsched.torch import checkpoint_format as fmt
from commsched.torch import checkpoint_shards as sharded
from commsched.torch.checkpoint_capture import Capture, Copy, Unit
from commsched.torch.checkpoint_worker import lower_priority
from commsched.torch.optimizer import DistributedOptimizer

import commsched
import torch


def supported(model: Any, optimizer: Any) -> bool:
    """True when the pair can be committed in the background (a sharded optimizer cannot yet)."""
    return (
        isinstance(model, torch.nn.Module)
        and isinstance(optimizer, torch.optim.Optimizer)
        and not sharded.is_sharded(optimizer)
    )


class _Version:
    """One commit: host tensors by key, the optimizer's non-tensor state and its param_groups."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.model: dict[str, Any] = {}
        self.optimizer: dict[str, Any] = {}

    def tensor(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The reused host tensor for `key`, reallocated only when its dtype or shape changed."""
        held = self.tensors.get(key)
        if held is None or held.dtype != like.dtype or held.shape != like.shape:
            pin = like.is_cuda and torch.cuda.is_available()
            held = self.tensors[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        return held


class BackgroundCommit:
    """Commits, restores and (optionally) saves to disk one model and its optimizer."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | None
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
        self._directory = directory
        self._disk: Any = None  # the Checkpointer, built at the first commit with commsched running
        self._commits = 0
        self._lock = threading.Lock()
        self._committed: _Version | None = None
        self._spare = _Version()  # the buffers the next capture writes into
        self._capture: Capture | None = None
        self._running: tuple[threading.Thread, Capture] | None = None
        self._hooks = self._register_hooks()

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
        if isinstance(self._optimizer, DistributedOptimizer) and self._optimizer.pending_updates():
            # Overlap mode: the last step's updates wait for the next forward; the commit holds them.
            self._optimizer.apply_pending_updates()
        version = self._spare
        params = [p for group in self._inner.param_groups for p in group["params"]]
        units: dict[int, Unit] = {}
        loose: list[Unit] = []
        for name, tensor in self._model.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                version.model[name] = copy.deepcopy(tensor)
                continue
            key = f"model.{name}"
            version.model[name] = destination = version.tensor(key, tensor)
            piece = _copy(key, lambda t=tensor: t, destination)
            if isinstance(tensor, torch.nn.Parameter):
                units.setdefault(id(tensor), Unit(tensor)).copies.append(piece)
            else:  # a buffer: the next forward may change it, and no update hook says when
                loose.append(Unit(None, [piece]))
        state: dict[int, dict[str, Any]] = {}
        for i, param in enumerate(params):
            for name, value in self._inner.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    key = f"optimizer.{i}.{name}"
                    state.setdefault(i, {})[name] = destination = version.tensor(key, value)
                    source = lambda p=param, n=name: self._inner.state[p][n]  # looked up when copied
                    units.setdefault(id(param), Unit(param)).copies.append(_copy(key, source, destination))
                else:
                    state.setdefault(i, {})[name] = copy.deepcopy(value)
        groups = [
            {**copy.deepcopy({k: v for k, v in group.items() if k != "params"}), "params": []}
            for group in self._inner.param_groups
        ]
        index = 0
        for group, original in zip(groups, self._inner.param_groups, strict=True):
            group["params"] = list(range(index, index + len(original["params"])))
            index += len(original["params"])
        version.optimizer = {"state": state, "param_groups": groups}
        capture = Capture(loose + list(units.values()))
        for unit in loose:
            capture.copy_now(unit)
        self._commits += 1
        if not background:
            capture.run()
            self._publish(version)
        else:
            self._capture = capture
            thread = threading.Thread(
                target=self._run, args=(capture, version), name="commsched-commit", daemon=True
            )
            self._running = (thread, capture)
            thread.start()
        self._save_to_disk()

    def _run(self, capture: Capture, version: _Version) -> None:
        """The background thread: copies what is left, then makes the version the committed one."""
        try:
            lower_priority()
            capture.run()
        except BaseException as error:  # noqa: BLE001 - reported by wait(); the last commit stays
            capture.error = capture.error or error
            return
        finally:
            if self._capture is capture:
                self._capture = None
        self._publish(version)

    def _publish(self, version: _Version) -> None:
        with self._lock:
            self._spare = self._committed if self._committed is not None else _Version()
            self._committed = version

    def wait(self) -> None:
        """Blocks until the last commit is captured; a failed capture is warned of (the one before stays)."""
        if self._running is None:
            return
        thread, capture = self._running
        thread.join()
        self._running = None
        if capture.error is not None:
            warnings.warn(
                f"commit {self._commits} was not captured ({capture.error}); a restore goes back to the commit before it",
                RuntimeWarning,
                stacklevel=3,
            )

    def _save_to_disk(self) -> None:
        if self._directory is None or not commsched.is_initialized():
            return
        if self._disk is None:
            from commsched.torch.checkpoint import Checkpointer

            self._disk = Checkpointer(self._model, self._optimizer, self._directory)
        self._disk.save(self._commits)

    # -- restore -------------------------------------------------------------------------------
    def restore(self, discard_in_flight: Callable[[Any], None]) -> None:
        """Loads the last complete commit into the model and the optimizer."""
        self.wait()
        self.close_disk()  # its save in progress may belong to the failed generation
        committed = self._committed
        if committed is None:
            raise RuntimeError("TorchState.restore(): nothing was committed yet; call commit() first")
        self._model.load_state_dict(committed.model)
        discard_in_flight(self._optimizer)
        # A copy: load_state_dict keeps CPU tensors as given, and the next commits reuse these buffers.
        self._optimizer.load_state_dict(copy.deepcopy(committed.optimizer))

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


def _copy(key: str, source: Callable[[], torch.Tensor], destination: torch.Tensor) -> Copy:
    entry = fmt.Entry(key, destination.dtype, tuple(destination.shape))
    return Copy(fmt.Piece(entry, 0, entry.rows), source, destination)


def directory_setting(directory: str | os.PathLike[str] | None) -> str | None:
    """TorchState(checkpoint_dir=...) as a path, or None (memory only)."""
    if directory is None:
        return None
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"TorchState(checkpoint_dir=...) takes a directory path, not {type(directory).__name__}"
        )
    return os.fspath(directory)
