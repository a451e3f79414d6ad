"""Elastic training for PyTorch with Horovod's API: ``TorchState``, ``ElasticSampler`` and ``run``.

@commsched.torch.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        for batch in loader:  # over an ElasticSampler held by the state
            ...
            state.sampler.record_batch(index, batch_size)
            state.commit()
        state.sampler.set_epoch(state.epoch + 1)

train(commsched.torch.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0))
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

from commsched.torch.collectives import broadcast_object
from commsched.torch.elastic_commit import BackgroundCommit, directory_setting, supported
from commsched.torch.functions import broadcast_optimizer_state, broadcast_parameters

import commsched
import torch
from commsched.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reform,
    run_fn,
)

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]


def run(func: Any) -> Any:
    """Decorator: runs `func(state, ...)` elastically, re-forming the ranks when one fails (Horovod's API)."""
    return run_fn(func, reform)


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the ranks and, after a re-forming, shards what this epoch has not processed
    yet over the new ranks: no sample is dropped, none processed before the resize comes again, and
    where the rest does not split evenly up to size - 1 are given twice so every rank takes as many
    steps (Horovod's sampler).

    Call ``record_batch`` after each batch and ``set_epoch`` at the end of each epoch.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0  # samples of this epoch processed by all ranks together
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts `epoch`: a new order (when shuffling) and nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank processed one more batch of `batch_size` samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """The epoch and how many of its samples were processed."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Takes a state_dict() and re-shards the remaining samples over the current ranks."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Shards the samples this epoch has left over the current ranks."""
        self.num_replicas = commsched.size() if commsched.is_initialized() else 1
        self.rank = commsched.rank() if commsched.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Any:
        indices = self.remaining_indices[:]
        # Padded from the front so every rank gets as many (as DistributedSampler does).
        indices += indices[: self.total_size - len(indices)]
        self.indices = indices[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """Commits, restores and synchronises one tracked object of a TorchState."""

    def __init__(self, value: Any, keep: bool = True) -> None:
        self.value = value
        self.saved: Any = None
        if keep:
            self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)


class _ModelHandler(_Handler):
    def save(self) -> None:
        # Into the buffers of the previous commit where they fit: a commit allocates nothing.
        current = self.value.state_dict()
        saved = self.saved
        if (
            isinstance(saved, dict)
            and saved.keys() == current.keys()
            and all(
                isinstance(t, torch.Tensor) and t.shape == saved[k].shape and t.dtype == saved[k].dtype
                for k, t in current.items()
            )
        ):
            with torch.no_grad():
                for name, tensor in current.items():
                    saved[name].copy_(tensor)
            return
        super().save()

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def restore(self) -> None:
        _discard_in_flight(self.value)
        super().restore()

    def sync(self) -> None:
        # The wrapped optimizer's state: a worker that just joined fills its empty state with a step
        # on zero gradients, which through a DistributedOptimizer would start reductions only it has.
        # A sharded optimizer's own: its state_dict() is this rank's shard, which every rank keeps
        # (or, before its layout, the plain form, which every rank takes).
        sharded = getattr(self.value, "sharded", False)
        broadcast_optimizer_state(
            self.value if sharded else getattr(self.value, "_inner", self.value), root_rank=0
        )


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


def _discard_in_flight(optimizer: Any) -> None:
    """Forgets the reductions a DistributedOptimizer had in flight when commsched stopped on a failure:
    they will never finish, and waiting for them (as load_state_dict() would) raises the failure again.
    The gradient hooks are built afresh, for the next generation's core."""
    reducer = getattr(optimizer, "_reducer", None)
    if reducer is None:
        return  # a plain optimizer: nothing in flight
    if commsched.is_initialized():
        # A restore without a failure: every rank submitted these, so they finish; a new reducer's
        # first step would otherwise submit its used counts under a name still in flight.
        try:
            reducer.drain()
        except commsched.CommschedError:
            pass  # stopped meanwhile, or of a generation that ended: discarded, as after a failure
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None  # may be a guard of a reduction that will never finish
    optimizer._replace_reducer()
    optimizer._synchronized = False


def _handler_for(value: Any, keep: bool = True) -> _Handler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value, keep)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value, keep)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value, keep)
    return None


_PAIR = ("model", "optimizer")  # committed in the background together (elastic_commit)


class TorchState(ObjectState):
    """The state of a PyTorch training process: models, optimizers, ElasticSamplers (by keyword) and
    plain picklable objects, committed to memory together (Horovod's TorchState).

    `model` and `optimizer` are committed through the Checkpointer's background capture: commit()
    returns before their parameters are copied (elastic_commit); a DistributedOptimizer(shard=True)
    commits its shard and gathers every rank's in the background, so a lost rank's shard survives.
    With `checkpoint_dir` each commit is also saved there by a commsched.torch.Checkpointer.
    """

    def __init__(
        self, model: Any = None, optimizer: Any = None, checkpoint_dir: Any = None, **kwargs: Any
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        directory = directory_setting(checkpoint_dir)
        background = supported(model, optimizer)
        if directory is not None and not background:
            raise ValueError(
                "TorchState(checkpoint_dir=...) needs model= a torch.nn.Module and optimizer= an optimizer "
                "(a DistributedOptimizer(shard=True) over every rank, not a process set); save such state "
                "with commsched.torch.Checkpointer"
            )
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value, keep=not (background and name in _PAIR))
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        object.__setattr__(self, "_directory", directory)
        object.__setattr__(self, "_background", None)
        # Commit number -> the objects committed with it: a restore that falls back to the commit
        # before (a capture that failed) takes that commit's objects too, so they stay together.
        object.__setattr__(self, "_versions", {})
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        if background:
            self._start_background()
        super().__init__(bcast_object=broadcast_object, get_rank=commsched.rank, **plain)
        self._record_version()  # the start is a commit a restore can go back to, objects and all

    def tracked(self) -> dict[str, Any]:
        """The models, optimizers and ElasticSamplers this state commits, by name."""
        return {name: handler.value for name, handler in self._handlers.items()}

    def _start_background(self) -> None:
        """Commits model and optimizer in the background from now on, starting with their current state."""
        if self._background is not None:
            self._background.close()
        background = BackgroundCommit(self.model, self.optimizer, self._directory)
        background.commit(background=False)
        object.__setattr__(self, "_background", background)
        self._versions.clear()  # numbered by the previous BackgroundCommit
        if "_saved_state" in self.__dict__:  # a model or optimizer replaced after __init__
            self._record_version()

    def _own(self) -> dict[str, _Handler]:
        """The handlers that commit and restore themselves (not the background pair)."""
        if self._background is None:
            return self._handlers
        return {name: h for name, h in self._handlers.items() if name not in _PAIR}

    def save(self) -> None:
        """Copies every tracked object's state into memory (model and optimizer in the background)."""
        self._save(background=True)

    def save_local(self) -> None:
        """save() on this rank alone, with no collective: for a commit the other ranks do not make."""
        self._save(background=False)

    def _save(self, background: bool) -> None:
        if self._background is not None:
            # First: a rank lost in its collectives (ranks on one host may each copy a part) fails
            # the commit before any other object took the new values, so a restore finds the last
            # commit's objects whole. Here all of it, or in the background.
            self._background.commit(background=background)
        for handler in self._own().values():
            handler.save()
        super().save()
        self._record_version()

    def _record_version(self) -> None:
        """Keeps the objects just committed under the background commit's number, for restore()."""
        if self._background is None:
            return
        own = {name: handler.saved for name, handler in self._own().items()}
        self._versions.pop(self._background.commits, None)  # a number given again goes last
        self._versions[self._background.commits] = (self._saved_state, own)
        # The newest three: commit numbers may jump when the ranks of a host agree on theirs.
        for number in list(self._versions)[:-3]:
            del self._versions[number]

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank together when a host-update notice came."""
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            self.wait()  # the commit's capture (a sharded one's gather) needs this generation's ranks
            raise

    def wait(self) -> None:
        """Blocks until the last commit of model and optimizer is captured (before changing them outside step())."""
        if self._background is not None:
            self._background.wait()

    def restore(self) -> None:
        """Loads the last committed state into every tracked object."""
        if self._background is not None:
            number = self._background.restore(_discard_in_flight)
            kept = self._versions.get(number)
            if kept is not None:
                object.__setattr__(self, "_saved_state", kept[0])
                for name, saved in kept[1].items():
                    self._handlers[name].saved = saved
        for handler in self._own().values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Broadcasts rank 0's state (parameters, optimizer, sampler, objects) to every rank."""
        self.wait()  # the broadcast writes into parameters a capture may not have copied yet
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """Re-shards the samplers over the new ranks."""
        if self._background is not None:
            self._background.reformed()
        for handler in self._handlers.values():
            if isinstance(handler, _SamplerHandler):
                handler.value.reset()
            elif isinstance(handler, _OptimizerHandler):
                _discard_in_flight(handler.value)  # its gradient hooks belong to the last generation's core

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            if self.__dict__.get("_background") is not None and name in _PAIR:
                handlers[name].value = value
                object.__setattr__(self, name, value)
                self._start_background()
            else:
                handlers[name].set_value(value)
        super().__setattr__(name, value)
