"""The sharded DistributedOptimizer (ZeRO-2): reduce-scatter in backward, all-gather in forward order.

Each rank owns one contiguous shard of every flat bucket (see _shard_layout). A bucket is
reduce-scattered as soon as its last member's gradient is complete, with the priority of its first
member in the forward order; the full per-parameter gradients are dropped then, so a rank keeps only
its shard of the reduced gradient. The wrapped optimizer steps flat shard tensors, so its state
(momentum, moments) covers only this rank's shard; step() updates each bucket as its reduce-scatter
lands (see _shard_step). The updated shards are all-gathered, with the same priorities, each once
no more urgent reduce-scatter is pending: in barrier mode inside step(); with overlap_forward=True
in flight while the next forward runs, each module's pre-forward hook waiting only for its own
parameters' buckets, so the first layer's gather goes first and one the forward needs now passes
the next backward's reduce-scatters in the core's queue.

The wrapped optimizer's param_groups hold the shard tensors after the first forward (the layout
follows the measured forward order), so its state_dict() is this rank's shard; full_state_dict()
gathers the plain per-parameter form, which loads at any number of ranks or into a plain optimizer.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from commsched.torch import _optimizer_args as _args
from commsched.torch import _shard_layout as layout
from commsched.torch import _shard_state as _state
from commsched.torch import _shard_step, _wire, elastic_shard
from commsched.torch._order import ForwardOrder
from commsched.torch._reducer import bucket_limit
from commsched.torch._shard_order import FirstUse, ShardWaits
from commsched.torch.compression import Compression
from commsched.torch.optimizer import DistributedOptimizer

import commsched
import torch
from commsched import _horovod
from commsched._horovod import Average, global_process_set

_instances = itertools.count()


class ShardedOptimizer(DistributedOptimizer):
    """DistributedOptimizer(..., shard=True): ZeRO-2 sharding of gradients and optimizer state."""

    sharded = True  # each rank holds a shard of the state (commsched.torch.Checkpointer asks)
    # False, kept to measure against and to check both give the same parameters: _pipelined, step()
    # waits for every reduce-scatter before any update; _first_use, parameters used outside their own
    # module are sent last and settled before the root module (the layout before _shard_order).
    _pipelined = True
    _first_use = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Any = Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = global_process_set,
        *,
        model: torch.nn.Module | None = None,
        overlap_forward: bool = False,
        process_group: Any = None,
        shard: bool | None = True,
    ) -> None:
        """The arguments of DistributedOptimizer; compression is not supported with shard=True."""
        named = _args.check_wrap(
            optimizer, backward_passes_per_step, overlap_forward, model, named_parameters, num_groups, groups
        )
        _shard_step.check_elementwise(optimizer)
        how = _args.reduction(op, compression, gradient_predivide_factor, process_set)
        if how.wire_dtype is not None:
            raise ValueError("shard=True sends gradients uncompressed; pass compression=Compression.none")
        self._inner = optimizer
        self._overlap = overlap_forward
        self._model = model
        self._named = named
        labelled = self._labelled_parameters()
        if _wire.training_device(labelled) == "cuda":
            _wire.ensure_initialized(process_group, _wire.cuda_device_name(p for _, p in labelled))
        else:
            _wire.ensure_initialized(process_group, "cpu")
        how.settle()
        self._how = how
        self._ranks = int(how.ranks or commsched.size())
        members = list(_horovod.ranks_of(process_set))
        self._member = _horovod.is_global(process_set) or commsched.rank() in members
        self._position = members.index(commsched.rank()) if self._member else -1
        self._prefix = f"torch.shard{next(_instances)}."
        self._passes = backward_passes_per_step
        self._timeout: float | None = None
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._patch_step_function()
        self._synchronized = False
        self._skip_synchronize = False
        self._labelled = labelled
        self._group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._original_groups = [list(group["params"]) for group in optimizer.param_groups]
        self._buckets: list[layout.ShardBucket] = []
        self._where: dict[int, list[layout.ShardBucket]] = {}  # by parameter id: the buckets holding it
        self._built = False
        self._seen = [0] * len(labelled)
        self._open = False  # a gradient arrived since the last close
        self._reduced = False  # this iteration's reduce-scatters are finished
        self._counts: Any = None
        self._unused: set[int] = set()
        self._layouts = 0
        self._handles: list[Any] = []
        self._waits: ShardWaits | None = None
        self._recorder: ForwardOrder | None = None
        # A checkpoint loaded before the layout exists: (layout, this rank's shard, values, plain form).
        self._deferred: tuple[dict[str, Any], Any, Any, Callable[[], dict[str, Any]]] | None = None
        if not self._member:
            return  # outside the process set: a plain optimizer on this rank's own gradients
        for index, (_, param) in enumerate(labelled):
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index)))
        if model is not None:
            self._recorder = (FirstUse if self._first_use else ForwardOrder)(model, self._on_forward_order)
        elif not elastic_shard.lays_out_late():
            self._build([])

    def __repr__(self) -> str:
        mode = "overlap_forward" if self._overlap else "barrier"
        return f"DistributedOptimizer(shard=True, {mode}, {self._inner!r})"

    # -- layout ------------------------------------------------------------------------------
    def _on_forward_order(self, order: list[torch.Tensor]) -> None:
        self._build(order)

    def _build(self, order: list[torch.Tensor]) -> None:
        """Lays out the buckets in the forward order every rank agrees on, and cuts the state into shards."""
        position = {id(p): i for i, p in enumerate(order)}
        unranked = 2**62
        local = [
            position.get(id(p), len(order) + i) if p.requires_grad else unranked
            for i, (_, p) in enumerate(self._labelled)
        ]
        limit = bucket_limit(self._ranks)
        local.append(unranked if not limit else limit)
        device = self._labelled[0][1].device if self._labelled and self._labelled[0][1].is_cuda else None
        agreed = torch.tensor(local, dtype=torch.int64)
        agreed = agreed.to(device) if device is not None else agreed
        name = f"{self._prefix}layout{self._layouts}"
        self._layouts += 1
        priorities = (
            _wire.start_allreduce(agreed, name, -2, "min", **self._how.core)
            .finish(self._timeout)
            .cpu()
            .tolist()
        )
        limit_agreed = priorities.pop()
        # COMMSCHED_BUCKET_BYTES=0 (buckets off): every parameter is a bucket of its own.
        limit = 1 if limit is None else (0 if limit_agreed == unranked else limit_agreed)
        entries = [
            (p, label, i, self._group_of[id(p)])
            for i, (label, p) in enumerate(self._labelled)
            if priorities[i] != unranked
        ]
        entries.sort(key=lambda e: (priorities[e[2]], e[2]))
        # A parameter over the limit is cut into pieces across buckets; buckets off (1) cut nothing.
        plans = layout.plan(entries, priorities, limit, self._ranks if limit > 1 else 0)
        self._buckets = [
            layout.build(chosen, f"{k}", priorities[chosen[0][2]], self._ranks, self._position)
            for k, chosen in enumerate(plans)
        ]
        self._where = layout.link_pieces(self._buckets)
        deferred, self._deferred = self._deferred, None
        now = _state.layout_key(_state.layout_json(self._buckets, self._inner, self._ranks))
        direct = deferred is not None and now == _state.layout_key(deferred[0])
        if deferred is not None and not direct:
            self._inner.load_state_dict(deferred[3]())  # saved at another layout: cut again below
        full_state = {i: self._inner.state.get(p) for i, (_, p) in enumerate(self._labelled)}
        for g, group in enumerate(self._inner.param_groups):
            group["params"] = [b.shard for b in self._buckets if b.group == g]
        self._inner.state = defaultdict(dict)
        if direct and deferred is not None:
            _state.install(self._buckets, self._inner, *deferred[:3])
        else:
            self._cut(full_state)
        self._built = True
        if self._overlap and self._model is not None:
            self._waits = ShardWaits(self._model, set(self._where), self._settle, self._recorder)
            owned = {id(p) for p in self._model.parameters()}
            self._waits.set_reached(order, [p for p in self._parameters() if id(p) not in owned])

    def _cut(self, full_state: dict[int, dict[str, Any] | None]) -> None:
        """Gives each shard its part of per-parameter state (a plain optimizer's, keyed by parameter index)."""
        for bucket in self._buckets:
            states = [full_state.get(m.index) or {} for m in bucket.members]
            cut = _state.cut(bucket, states, layout.shard_state)
            if cut:
                self._inner.state[bucket.shard] = cut

    def _parameters(self) -> list[torch.Tensor]:
        return [p for _, p in self._labelled]

    def buckets(self) -> list[list[str]]:
        """The parameters of each bucket, by name, in the order they are sent (empty before the first forward)."""
        return [[m.label for m in b.members] for b in self._buckets]

    def priorities(self) -> dict[str, int]:
        """Each bucketed parameter's priority (its bucket's; smaller is sent sooner), by name."""
        return {m.label: b.priority for b in self._buckets for m in b.members}

    # -- backward: reduce-scatter each bucket once complete ---------------------------------
    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(param: torch.Tensor) -> None:
            self._on_gradient(index, param)

        return ready

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        if not self._built:
            self._build([])
        self._open = True
        self._seen[index] += 1
        if self._seen[index] > self._passes:
            raise RuntimeError(
                f"commsched.torch: gradient of '{self._labelled[index][0]}' became ready again while its "
                f"reduction is in flight; call optimizer.step() after every {self._passes} backward pass(es), "
                "or set backward_passes_per_step"
            )
        if self._seen[index] < self._passes:
            return
        # Not found: trainable only since the layout was built, refused at close.
        for bucket in self._where.get(id(param), ()):
            bucket.ready += 1  # every bucket holding a piece of it
            if bucket.ready == len(bucket.members) and bucket.scatter is None:
                self._scatter(bucket)

    def _scatter(self, bucket: layout.ShardBucket) -> None:
        seen = [self._seen[m.index] > 0 for m in bucket.members]
        bucket.used = seen
        flat = layout.flat_gradient(bucket, seen)
        how = self._how
        bucket.scatter = commsched.reducescatter_async(
            flat,
            op=how.op,
            name=f"{self._prefix}grad.{bucket.name}",
            priority=bucket.priority,
            prescale_factor=how.prescale,
            postscale_factor=how.postscale,
            **how.core,
        )

    def _close(self) -> None:
        """Sends every bucket not yet sent (zeros for missing gradients), then the used counts."""
        if not self._built:
            self._build([])
        for index, (label, param) in enumerate(self._labelled):
            if id(param) not in self._where and param.requires_grad and param.grad is not None:
                raise RuntimeError(
                    f"commsched.torch: parameter '{label}' became trainable after shard=True laid out its "
                    "buckets (at the first forward); unfreeze parameters before that forward, or build a new "
                    "DistributedOptimizer"
                )
        for bucket in self._buckets:
            if bucket.scatter is None:
                self._scatter(bucket)
        counts = torch.zeros(len(self._labelled), dtype=torch.int32)
        for bucket in self._buckets:
            for member, used in zip(bucket.members, bucket.used):
                counts[member.index] = int(used)
        device = self._buckets[0].shard.device if self._buckets else torch.device("cpu")
        self._counts = _wire.start_allreduce(
            counts.to(device), f"{self._prefix}used", -1, "sum", **self._how.core
        )

    def _finish(self) -> None:
        """Waits for the reduce-scatters; each rank keeps its shard of the reduced gradient."""
        for bucket in self._buckets:
            _shard_step.take(bucket, self._timeout)
        self._take_counts()
        self._seen = [0] * len(self._labelled)

    def _take_counts(self) -> set[int]:
        """The parameters no rank used this iteration (waits for the used counts once)."""
        if self._counts is not None:
            counts = self._counts.finish(self._timeout).cpu().tolist()
            self._counts = None
            self._unused = {i for i, c in enumerate(counts) if c == 0}
        return self._unused

    def _reduce(self, force: bool) -> None:
        if self._reduced or not (force or self._open):
            return
        self._close()
        self._finish()
        self._reduced = True
        self._open = False

    def _pipeline(self) -> None:
        """Updates each bucket as soon as its reduce-scatter lands, in the order they land, and gathers it
        once no reduce-scatter more urgent than it is still pending."""
        self._close()
        pending = list(self._buckets)
        position = {id(b): k for k, b in enumerate(pending)}  # priority order; pieces tie on priority
        updated: list[layout.ShardBucket] = []
        while pending:
            bucket = _shard_step.next_landed(pending, self._timeout)
            pending.remove(bucket)
            _shard_step.take(bucket, self._timeout)
            # Only a member this rank did not use may be unused by every rank: then the counts decide.
            unused = self._take_counts() if not all(bucket.used) else set()
            self._update([bucket], unused)
            updated.append(bucket)
            # A gather passes pending reduce-scatters in the core's queue, and step() (so the next
            # forward) waits for those: only one the forward needs before all of them goes now.
            urgent = min((position[id(b)] for b in pending), default=len(position))
            ready = sorted((b for b in updated if position[id(b)] < urgent), key=lambda b: position[id(b)])
            updated = [b for b in updated if b not in ready]
            self._gather(ready)
        self._take_counts()
        self._seen = [0] * len(self._labelled)
        self._open = False

    # -- forward: all-gather the updated shards --------------------------------------------
    def _gather(self, buckets: list[layout.ShardBucket]) -> None:
        for bucket in buckets:
            bucket.gather = commsched.allgather_async(
                bucket.shard.detach(),
                name=f"{self._prefix}param.{bucket.name}",
                priority=bucket.priority,
                **self._how.core,
            )

    def _land(self, bucket: layout.ShardBucket) -> None:
        handle, bucket.gather = bucket.gather, None
        full = handle.wait(self._timeout)
        layout.scatter_into(bucket, full if isinstance(full, torch.Tensor) else torch.as_tensor(full))

    def _settle(self, params: list[torch.Tensor]) -> None:
        """Waits for the gathers of these parameters' buckets (a module's pre-forward hook)."""
        for param in params:
            for bucket in self._where.get(id(param), ()):
                if bucket.gather is not None:
                    self._land(bucket)

    def _settle_all(self) -> None:
        for bucket in self._buckets:
            if bucket.gather is not None:
                self._land(bucket)

    # -- the optimizer API -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finishes the gathers of the last step and this iteration's reduce-scatters, if any."""
        if not self._member:
            return
        self._settle_all()
        self._reduce(force=False)
        self._synchronized = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the reduced gradient shards by the global norm (one scalar allreduce); returns that norm."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ with shard=True takes norm_type=2, not {norm_type}")
        if not self._member:
            params = [p for g in self._inner.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        self._settle_all()
        self._reduce(force=True)
        grads = [b.shard.grad for b in self._buckets if b.shard.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for grad in grads:
            squares += grad.double().pow(2).sum()
        total = _wire.start_allreduce(squares, f"{self._prefix}norm", -1, "sum", **self._how.core)
        norm = total.finish(self._timeout).sqrt()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return norm.float().reshape(())

    def _update(self, buckets: list[layout.ShardBucket], unused: set[int]) -> None:
        """Steps the wrapped optimizer on these shards; a parameter no rank used keeps its values and state."""
        _shard_step.update(self._inner, buckets, unused, self._updating)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finishes the reduce-scatters, updates this rank's shards and all-gathers them (overlap: in flight)."""
        if not self._member:
            step = self._inner.step if closure is None else lambda: self._inner.step(closure)
            return self._updating(self._parameters(), step)
        if closure is not None:
            raise ValueError("step(closure) is not supported with shard=True; call the closure before step()")
        self._settle_all()
        if not self._pipelined:  # every reduce-scatter first, then one update and every gather
            self._reduce(force=True)
            self._update(self._buckets, self._unused)
            self._gather(self._buckets)
        elif self._reduced:  # reduced already (clipping, synchronize): gathers overlap later updates
            for bucket in self._buckets:
                self._update([bucket], self._unused)
                self._gather([bucket])
        else:
            self._pipeline()
        self._reduced = False
        self._synchronized = False
        if not self._overlap:
            self._settle_all()
        commsched.autotune_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradient shards and the parameters' gradients; finishes reductions still in flight."""
        if self._member and (self._open or any(b.scatter is not None for b in self._buckets)):
            self._reduce(force=True)
        self._reduced = False
        self._inner.zero_grad(set_to_none=set_to_none)
        for param in self._parameters():
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported with shard=True: the shards are cut once."""
        raise NotImplementedError(
            "shard=True cannot add parameter groups; build the optimizer with every group"
        )

    def pending_updates(self) -> list[torch.Tensor]:
        """Overlap mode: parameters whose gathered values are not written back yet."""
        pending = {id(m.param): m.param for b in self._buckets if b.gather is not None for m in b.members}
        return list(pending.values())

    def apply_pending_updates(self) -> None:
        """Overlap mode: writes back now every gather that waits for the next forward."""
        self._settle_all()

    # -- state -------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        records = {k: b.records for k, b in enumerate(self._buckets) if b.records is not None}
        return {"ranks": self._ranks, "rank": self._position, "buckets": self.buckets(), "records": records}

    def _undefer(self) -> None:
        """Loads a checkpoint kept for the layout in plain form now: its state is asked for before it."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._inner.load_state_dict(deferred[3]())

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (the wrapped optimizer's state_dict) with its layout under "shard"."""
        self._settle_all()
        self._undefer()
        result = self._inner.state_dict()
        if self._member and self._built:
            result["shard"] = self._meta()
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a shard saved by state_dict() at this rank and layout, or a plain state (re-cut into shards).

        A shard of another rank (broadcast_optimizer_state) gives its hyper-parameters only: every
        rank keeps the state of its own shard.
        """
        self._settle_all()
        meta = state_dict.get("shard")
        if meta is None:
            self._load_plain(state_dict)
            return
        body = {k: v for k, v in state_dict.items() if k != "shard"}
        if not self._built or meta["buckets"] != self.buckets() or meta["ranks"] != self._ranks:
            raise ValueError(
                f"this state_dict holds shard {meta['rank']} of {meta['ranks']} rank(s) of another layout; load "
                "the plain form that optimizer.full_state_dict() gives (at any number of ranks)"
            )
        if meta["rank"] == self._position:
            self._inner.load_state_dict(body)
            records = meta.get("records", {})
            for k, bucket in enumerate(self._buckets):
                bucket.records = records.get(k)
            return
        for group, saved in zip(self._inner.param_groups, body["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _load_plain(self, state_dict: dict[str, Any]) -> None:
        """A plain optimizer's state_dict: loaded over the parameters, then cut into this rank's shards."""
        self._deferred = None
        if not self._built or not self._member:
            self._inner.load_state_dict(state_dict)
            return
        shards = [list(group["params"]) for group in self._inner.param_groups]
        for group, params in zip(self._inner.param_groups, self._original_groups):
            group["params"] = params
        self._inner.state = defaultdict(dict)
        try:
            self._inner.load_state_dict(state_dict)
            full_state = {i: self._inner.state.get(p) for i, (_, p) in enumerate(self._labelled)}
        finally:
            for group, params in zip(self._inner.param_groups, shards):
                group["params"] = params
        self._inner.state = defaultdict(dict)
        self._cut(full_state)

    def plain_parameters(self) -> list[torch.Tensor]:
        """The wrapped optimizer's parameters in group order: what a plain state_dict's indices count."""
        return self._parameters()

    def plain_groups(self) -> list[dict[str, Any]]:
        """The param_groups of a plain optimizer's state_dict: hyper-parameters and parameter indices."""
        index = {id(p): i for i, (_, p) in enumerate(self._labelled)}
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in params]}
            for group, params in zip(self._inner.param_groups, self._original_groups)
        ]

    def full_state_dict(self) -> dict[str, Any]:
        """The plain per-parameter state_dict, gathered from every rank's shard (a collective: call on every rank)."""
        self._settle_all()
        self._undefer()
        if not self._member or not self._built:
            return self._inner.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for bucket in self._buckets:
            shard_state = self._inner.state.get(bucket.shard, {})
            for k, member in enumerate(bucket.members):
                record = _state.record_of(bucket, shard_state, k)
                if record is not None and member.index not in state:  # a piece's: its parameter's
                    state[member.index] = dict(_state.copy_record(record) or {})
            for key in sorted(shard_state):
                value = shard_state[key]
                if not _state.per_element(value, bucket.shard.numel()):
                    continue
                handle = commsched.allgather_async(
                    value.detach().contiguous(),
                    name=f"{self._prefix}state.{bucket.name}.{key}",
                    priority=-1,
                    **self._how.core,
                )
                full = handle.wait(self._timeout)
                full = (full if isinstance(full, torch.Tensor) else torch.as_tensor(full)).reshape(-1)
                for m in bucket.members:
                    if m.index in state:
                        layout.place(
                            state[m.index], key, m, full[m.offset : m.offset + m.numel].to(value.device)
                        )
        return {"state": state, "param_groups": self.plain_groups()}

    # -- checkpoints (commsched.torch.Checkpointer) ------------------------------------------
    def checkpoint_layout(self) -> dict[str, Any] | None:
        """The shard layout as JSON (None before the layout exists: the state is still per parameter)."""
        self._settle_all()
        if not self._member or not self._built:
            return None
        return _state.layout_json(self._buckets, self._inner, self._ranks)

    def shard_tensors(self) -> list[dict[str, torch.Tensor]]:
        """Per bucket, this rank's per-element state tensors by key (live: they change at the next step)."""
        return _state.shard_tensors(self._buckets, self._inner)

    def member_values(self) -> dict[int, dict[str, Any]]:
        """Each parameter's per-parameter values (Adam's step), by parameter index; none for one without state."""
        return _state.member_values(self._buckets, self._inner)

    def load_shards(
        self,
        saved: dict[str, Any],
        tensors: list[dict[str, torch.Tensor]],
        values: dict[int, dict[str, Any]],
        plain: Callable[[], dict[str, Any]],
    ) -> bool:
        """Installs this rank's saved shard as it is when saved at this rank count and layout; False otherwise.

        Before the layout exists (the first forward lays it out) the shard is kept, and installed then
        if the layout matches; if not, `plain()` (the per-parameter form) is loaded and cut instead.
        """
        if not self._member:
            return False
        layout_now = self.checkpoint_layout()
        if layout_now is None:
            self._deferred = (saved, tensors, values, plain)
            return True
        if _state.layout_key(layout_now) != _state.layout_key(saved):
            return False
        return _state.install(self._buckets, self._inner, saved, tensors, values)

    def remove(self) -> None:
        """Detaches every hook of this optimizer (gradient hooks, forward recording, module waits)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._recorder is not None:
            self._recorder.remove()
        if self._waits is not None:
            self._waits.remove()
