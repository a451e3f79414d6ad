"""The sharded DistributedOptimizer (ZeRO-2): reduce-scatter in backward, all-gather in forward order.

Each rank owns one contiguous shard of every flat bucket (see _shard_layout). A bucket is
reduce-scattered as soon as its last member's gradient is complete, with the priority of its first
member in the forward order; the full per-parameter gradients are dropped then, so a rank keeps only
its shard of the reduced gradient. The wrapped optimizer steps flat shard tensors, so its state
(momentum, moments) covers only this rank's shard. The updated shards are all-gathered, with the
same priorities: in barrier mode inside step(); with overlap_forward=True in flight while the next
forward runs, each module's pre-forward hook waiting only for its own parameters' buckets, so the
first layer's gather goes first and one the forward needs now passes the next backward's
reduce-scatters in the core's queue.

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
from commsched.torch import _wire
from commsched.torch._order import ForwardOrder, ModuleWaits
from commsched.torch._reducer import bucket_limit
from commsched.torch.compression import Compression
from commsched.torch.optimizer import DistributedOptimizer, _needs_closure

import commsched
import torch
from commsched import _horovod
from commsched._horovod import Average, global_process_set

_instances = itertools.count()

# Optimizers whose update of a parameter reads the whole tensor (norms, factored moments, matrix
# roots): a flat shard would change their maths, so they are refused by name.
WHOLE_TENSOR = frozenset(
    {
        "lbfgs",
        "muon",
        "adafactor",
        "shampoo",
        "distributedshampoo",
        "soap",
        "kron",
        "lamb",
        "lars",
        "sparseadam",
    }
)


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer whose step needs whole tensors (or a closure), naming it."""
    names = [cls.__name__ for cls in type(optimizer).__mro__]
    whole = next((name for name in names if name.lower() in WHOLE_TENSOR), None)
    if whole is not None or _needs_closure(optimizer):
        raise ValueError(
            f"shard=True cannot wrap {type(optimizer).__name__}: its step needs whole parameter tensors "
            "(or a closure), but each rank holds only a flat shard of them. Use an elementwise optimizer "
            "(SGD, Adam, AdamW, RMSprop, Adagrad, ...) or shard=False"
        )


class ShardedOptimizer(DistributedOptimizer):
    """DistributedOptimizer(..., shard=True): ZeRO-2 sharding of gradients and optimizer state."""

    sharded = True  # each rank holds a shard of the state (commsched.torch.Checkpointer asks)

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
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a commsched DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}"
            )
        check_elementwise(optimizer)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be an integer >= 1, not {backward_passes_per_step!r}"
            )
        if overlap_forward and model is None:
            raise ValueError("overlap_forward=True needs model= (the next forward waits module by module)")
        named = _args.named(named_parameters)
        _args.check_all_named(named, optimizer)
        _args.check_groups(num_groups, groups, optimizer)
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
        self._where: dict[int, tuple[layout.ShardBucket, int]] = {}
        self._built = False
        self._seen = [0] * len(labelled)
        self._open = False  # a gradient arrived since the last close
        self._reduced = False  # this iteration's reduce-scatters are finished
        self._counts: Any = None
        self._unused: set[int] = set()
        self._layouts = 0
        self._handles: list[Any] = []
        self._waits: ModuleWaits | None = None
        self._recorder: ForwardOrder | None = None
        if not self._member:
            return  # outside the process set: a plain optimizer on this rank's own gradients
        for index, (_, param) in enumerate(labelled):
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index)))
        if model is not None:
            self._recorder = ForwardOrder(model, self._on_forward_order)
        else:
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
        plans = layout.plan(entries, priorities, limit)
        self._buckets = [
            layout.build(chosen, f"{k}", priorities[chosen[0][2]], self._ranks, self._position)
            for k, chosen in enumerate(plans)
        ]
        self._where = {
            id(m.param): (bucket, k) for bucket in self._buckets for k, m in enumerate(bucket.members)
        }
        full_state = {i: self._inner.state.get(p) for i, (_, p) in enumerate(self._labelled)}
        for g, group in enumerate(self._inner.param_groups):
            group["params"] = [b.shard for b in self._buckets if b.group == g]
        self._inner.state = defaultdict(dict)
        self._cut(full_state)
        self._built = True
        if self._overlap and self._model is not None:
            self._waits = ModuleWaits(self._model, set(self._where), self._settle)
            owned = {id(p) for p in self._model.parameters()}
            self._waits.set_reached(order, [p for p in self._parameters() if id(p) not in owned])

    def _cut(self, full_state: dict[int, dict[str, Any] | None]) -> None:
        """Gives each shard its part of per-parameter state (a plain optimizer's, keyed by parameter index)."""
        for bucket in self._buckets:
            states = [full_state.get(m.index) or {} for m in bucket.members]
            keys = sorted({key for state in states for key in state})
            if not keys:
                continue
            cut: dict[str, Any] = {}
            for key in keys:
                values = [state.get(key) for state in states]
                example = next(v for v in values if v is not None)
                per_element = [
                    v if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == m.numel else None
                    for v, m in zip(values, bucket.members)
                ]
                if any(v is not None for v in per_element):
                    cut[key] = layout.shard_state(example, bucket, per_element)
                else:
                    cut[key] = example.clone() if isinstance(example, torch.Tensor) else example
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
        found = self._where.get(id(param))
        if found is None:
            return  # trainable only since the layout was built: refused at close
        bucket = found[0]
        bucket.ready += 1
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
            part = bucket.scatter.wait(self._timeout)
            bucket.scatter = None
            bucket.ready = 0
            if not isinstance(part, torch.Tensor):
                part = torch.as_tensor(part)
            part = part.reshape(-1).to(bucket.shard.device)
            if bucket.shard.grad is None:
                bucket.shard.grad = torch.empty_like(bucket.shard)
            bucket.shard.grad.copy_(
                part.view(bucket.shard.dtype) if part.dtype != bucket.shard.dtype else part
            )
        counts = self._counts.finish(self._timeout).cpu().tolist() if self._counts is not None else []
        self._counts = None
        self._unused = {i for i, c in enumerate(counts) if c == 0}
        self._seen = [0] * len(self._labelled)

    def _reduce(self, force: bool) -> None:
        if self._reduced or not (force or self._open):
            return
        self._close()
        self._finish()
        self._reduced = True
        self._open = False

    # -- forward: all-gather the updated shards --------------------------------------------
    def _gather(self) -> None:
        for bucket in self._buckets:
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
            found = self._where.get(id(param))
            if found is not None and found[0].gather is not None:
                self._land(found[0])

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

    @torch.no_grad()
    def _update(self) -> None:
        """Steps the wrapped optimizer on the shards; a parameter no rank used keeps its values and state."""
        keep: list[tuple[torch.Tensor, slice, torch.Tensor]] = []
        fresh: list[tuple[layout.ShardBucket, set[str], list[slice]]] = []
        for bucket in self._buckets:
            layout.refresh(bucket)
            state = self._inner.state.get(bucket.shard, {})
            parts = []
            for member in bucket.members:
                where = bucket.overlaps(member) if member.index in self._unused else None
                if where is not None:
                    parts.append(slice(where[0], where[0] + where[2]))
            for part in parts:
                tensors = [bucket.shard] + [
                    v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == bucket.shard.shape
                ]
                keep.extend((t, part, t[part].clone()) for t in tensors)
            if parts:
                fresh.append((bucket, set(state), parts))
        self._updating(self._parameters(), self._inner.step)
        for tensor, part, value in keep:
            tensor[part] = value
        # State made by this step did not exist for an unused parameter: as in a plain optimizer,
        # it starts from zeros (momentum, moments) at its first real update.
        for bucket, before, parts in fresh:
            for key, value in self._inner.state.get(bucket.shard, {}).items():
                if (
                    key not in before
                    and isinstance(value, torch.Tensor)
                    and value.shape == bucket.shard.shape
                ):
                    for part in parts:
                        value[part] = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finishes the reduce-scatters, updates this rank's shards and all-gathers them (overlap: in flight)."""
        if not self._member:
            step = self._inner.step if closure is None else lambda: self._inner.step(closure)
            return self._updating(self._parameters(), step)
        if closure is not None:
            raise ValueError("step(closure) is not supported with shard=True; call the closure before step()")
        self._settle_all()
        self._reduce(force=True)
        self._update()
        self._reduced = False
        self._synchronized = False
        self._gather()
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
        return [m.param for b in self._buckets if b.gather is not None for m in b.members]

    def apply_pending_updates(self) -> None:
        """Overlap mode: writes back now every gather that waits for the next forward."""
        self._settle_all()

    # -- state -------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"ranks": self._ranks, "rank": self._position, "buckets": self.buckets()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (the wrapped optimizer's state_dict) with its layout under "shard"."""
        self._settle_all()
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
            return
        for group, saved in zip(self._inner.param_groups, body["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _load_plain(self, state_dict: dict[str, Any]) -> None:
        """A plain optimizer's state_dict: loaded over the parameters, then cut into this rank's shards."""
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

    def full_state_dict(self) -> dict[str, Any]:
        """The plain per-parameter state_dict, gathered from every rank's shard (a collective: call on every rank)."""
        self._settle_all()
        if not self._member or not self._built:
            return self._inner.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for bucket in self._buckets:
            shard_state = self._inner.state.get(bucket.shard, {})
            for key in sorted(shard_state):
                value = shard_state[key]
                if isinstance(value, torch.Tensor) and value.shape == bucket.shard.shape:
                    handle = commsched.allgather_async(
                        value.detach().contiguous(),
                        name=f"{self._prefix}state.{bucket.name}.{key}",
                        priority=-1,
                        **self._how.core,
                    )
                    full = handle.wait(self._timeout)
                    full = (full if isinstance(full, torch.Tensor) else torch.as_tensor(full)).reshape(-1)
                    for m in bucket.members:
                        piece = full[m.offset : m.offset + m.numel].view_as(m.param).to(value.device).clone()
                        state.setdefault(m.index, {})[key] = piece
                else:
                    for m in bucket.members:
                        copied = value.clone() if isinstance(value, torch.Tensor) else value
                        state.setdefault(m.index, {})[key] = copied
        groups = []
        index = {id(p): i for i, (_, p) in enumerate(self._labelled)}
        for group, params in zip(self._inner.param_groups, self._original_groups):
            groups.append(
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [index[id(p)] for p in params],
                }
            )
        return {"state": state, "param_groups": groups}

    def remove(self) -> None:
        """Detaches every hook of this optimizer (gradient hooks, forward recording, module waits)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._recorder is not None:
            self._recorder.remove()
        if self._waits is not None:
            self._waits.remove()
