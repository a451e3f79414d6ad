"""Rank script: hvd.DistributedOptimizer with Horovod's arguments, against one process on the whole batch.

Horovod-style wrapping (named_parameters=, no model=): the predivide factor, op=Sum, clipping
between synchronize() and step() inside skip_synchronize() (and the warning without it),
sparse embedding gradients (sparse again after the reduction, with or without sparse_as_dense, as
Horovod gives them back), Compression
objects, num_groups/groups, and refusals of bad arguments. Prints PASS/FAIL per check.
"""

from __future__ import annotations

import copy
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import commsched.torch as hvd
import torch
import torch.nn.functional as F
from torch_common import Net, data, max_difference, shard, skips

failures = 0
ITERATIONS = 4


def check(label: str, test: Callable[[], None]) -> None:
    """Runs one check; prints PASS or FAIL with the reason."""
    global failures
    try:
        test()
    except Exception as error:  # noqa: BLE001 - every failure is reported, then the run goes on
        failures += 1
        print(f"FAIL {label}: {error!r}\n{traceback.format_exc()}", flush=True)
    else:
        print(f"PASS {label}", flush=True)


class EmbedNet(torch.nn.Module):
    """An embedding with sparse gradients feeding a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 6, sparse=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor, skip: bool = False) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def batches(model: torch.nn.Module, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs for `model`: features for Net, token ids for EmbedNet (each rank uses its shard)."""
    x, y = data(size)
    if isinstance(model, EmbedNet):
        x = (x.abs() * 7).long().clamp_max(19)[..., :5]  # a few tokens per sample, a subset of rows
    return x, y


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return F.cross_entropy(model(shard(x[step], rank), skips(rank, step)), shard(y[step], rank))


def reference(
    model: torch.nn.Module,
    make: Callable[[Any], torch.optim.Optimizer],
    scale: float = 1.0,
    clip: float | None = None,
) -> torch.nn.Module:
    """One process on every rank's shard: the mean of the ranks' losses (times `scale`)."""
    model = copy.deepcopy(model)
    if isinstance(model, EmbedNet):
        model.embed.sparse = False  # the same values as dense gradients, which every optimizer takes
    optimizer = make(model.parameters())
    size = hvd.size()
    x, y = batches(model, size)
    for step in range(ITERATIONS):
        optimizer.zero_grad()
        (sum(loss_of(model, x, y, r, step) for r in range(size)) * (scale / size)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def train(
    model: torch.nn.Module,
    optimizer: hvd.DistributedOptimizer,
    clip: float | None = None,
    skip: bool = True,
    seen: list[torch.Tensor] | None = None,
) -> None:
    """The Horovod loop on this rank's shard; `seen` collects each step's first parameter gradient."""
    rank = hvd.rank()
    x, y = batches(model, hvd.size())
    for step in range(ITERATIONS):
        optimizer.zero_grad()
        loss_of(model, x, y, rank, step).backward()
        if clip is not None:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if skip:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        else:
            optimizer.step()
        if seen is not None:
            seen.append(next(model.parameters()).grad)


def fresh(kind: type[torch.nn.Module] = Net) -> torch.nn.Module:
    """The same initial model on every rank."""
    torch.manual_seed(0)
    return kind()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def compare(label: str, got: torch.nn.Module, want: torch.nn.Module, tolerance: float = 2e-5) -> None:
    difference = max_difference(got, want)
    assert difference <= tolerance, f"{label}: weights differ from one process by {difference:.3g}"


def expect(error: type[BaseException], match: str, call: Callable[[], Any]) -> None:
    try:
        call()
    except error as raised:
        assert match in str(raised), f"{error.__name__} says {raised!s}, not {match!r}"
        return
    raise AssertionError(f"no {error.__name__} ({match})")


def main() -> int:
    hvd.init()

    def named_parameters_missing() -> None:
        model = fresh()
        named = list(model.named_parameters())
        expect(
            ValueError,
            "are not in it",
            lambda: hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named[:-1]),
        )
        expect(
            ValueError,
            "appears twice",
            lambda: hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named + named[:1]),
        )

    def arguments_refused() -> None:
        model = fresh()
        for call, error, match in [
            (
                lambda: hvd.DistributedOptimizer(
                    sgd(model.parameters()), op=hvd.Adasum, overlap_forward=True, model=model
                ),
                NotImplementedError,
                "Adasum",
            ),
            (
                lambda: hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Max),
                ValueError,
                "op=hvd.Average",
            ),
            (
                lambda: hvd.DistributedOptimizer(
                    sgd(model.parameters()), op=hvd.Sum, gradient_predivide_factor=2.0
                ),
                ValueError,
                "only with op=hvd.Average",
            ),
            (
                lambda: hvd.DistributedOptimizer(
                    sgd(model.parameters()), compression=hvd.compression.Compressor
                ),
                TypeError,
                "custom compressor",
            ),
            (
                lambda: hvd.DistributedOptimizer(sgd(model.parameters()), num_groups=-1),
                ValueError,
                "num_groups",
            ),
        ]:
            expect(error, match, call)

    def predivide() -> None:
        model = fresh()
        optimizer = hvd.DistributedOptimizer(
            sgd(model.parameters()), named_parameters=model.named_parameters(), gradient_predivide_factor=2.0
        )
        want = reference(model, sgd)
        train(model, optimizer)
        compare("predivide", model, want)

    def sum_op() -> None:
        model = fresh()
        optimizer = hvd.DistributedOptimizer(
            sgd(model.parameters()), named_parameters=model.named_parameters(), op=hvd.Sum
        )
        want = reference(model, sgd, scale=hvd.size())
        train(model, optimizer)
        compare("op=Sum", model, want)

    def clipping(skip: bool) -> Callable[[], None]:
        def test() -> None:
            model = fresh()
            optimizer = hvd.DistributedOptimizer(
                sgd(model.parameters()), named_parameters=model.named_parameters()
            )
            want = reference(model, sgd, clip=0.05)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train(model, optimizer, clip=0.05, skip=skip)
            about = [w for w in caught if "skip_synchronize" in str(w.message)]
            assert len(about) == (0 if skip else ITERATIONS), [str(w.message) for w in caught]
            compare("clipping", model, want)

        return test

    def sparse(as_dense: bool) -> Callable[[], None]:
        def test() -> None:
            model = fresh(EmbedNet)
            make = lambda p: torch.optim.SGD(p, lr=0.5)  # takes sparse and dense gradients
            optimizer = hvd.DistributedOptimizer(
                make(model.parameters()), named_parameters=model.named_parameters(), sparse_as_dense=as_dense
            )
            want = reference(model, make)
            seen: list[torch.Tensor] = []
            train(model, optimizer, seen=seen)
            assert seen and all(g.is_sparse for g in seen), [g.layout for g in seen]
            compare("sparse", model, want)

        return test

    def compression_objects() -> None:
        for compression in (hvd.Compression.fp16, hvd.Compression.bf16, hvd.Compression.none):
            model = fresh()
            optimizer = hvd.DistributedOptimizer(
                sgd(model.parameters()), named_parameters=model.named_parameters(), compression=compression
            )
            want = reference(model, sgd)
            train(model, optimizer)
            compare(
                f"compression={compression.__name__}", model, want, 5e-2 if compression.wire_dtype else 2e-5
            )

    def groups_accepted() -> None:
        for groups in ({"num_groups": 2}, {"groups": 3}, {"groups": "lists"}):
            model = fresh()
            if groups.get("groups") == "lists":
                groups = {"groups": [[model.embed.weight, model.embed.bias], [model.head.weight]]}
            optimizer = hvd.DistributedOptimizer(
                sgd(model.parameters()), named_parameters=model.named_parameters(), **groups
            )
            want = reference(model, sgd)
            train(model, optimizer)
            compare(f"groups={groups}", model, want)

    def broadcast_state() -> None:
        rank = hvd.rank()
        torch.manual_seed(rank)  # different weights and optimizer state on every rank
        model = Net()
        plain = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
        if rank == 0:  # only the root has optimizer state; the others must receive it whole
            model(torch.randn(2, 8)).sum().backward()
            plain.step()
        optimizer = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
        torch.manual_seed(0)
        expected = Net()
        expected.load_state_dict(hvd.broadcast_object(model.state_dict() if rank == 0 else None, 0))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0, prefix="model.")
        hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model)
        compare("broadcast_parameters", model, expected, 0.0)
        state = optimizer.state_dict()
        root_state = hvd.broadcast_object(state, root_rank=0)
        assert state["param_groups"] == root_state["param_groups"]
        for index, values in root_state["state"].items():
            for key, value in values.items():
                assert torch.equal(state["state"][index][key], value), (
                    f"state {index}.{key} differs from rank 0"
                )

    def parameter_names() -> None:
        # Horovod's optimizer keeps {parameter: name}; without named_parameters the names are
        # made up, unique, and the same on every rank.
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
        names = optimizer._parameter_names
        assert len(names) == 4 and len(set(names.values())) == 4, names
        assert set(names) == set(model.parameters())
        everyone = hvd.allgather_object(sorted(names.values()))
        assert all(theirs == everyone[0] for theirs in everyone), everyone

    def outside_the_process_set() -> None:
        # A rank outside the optimizer's process set keeps its own gradients (Horovod's rule): with
        # a set of rank 0 alone, every rank ends where a plain optimizer on its own shard ends.
        rank = hvd.rank()
        first = hvd.add_process_set([0])
        try:
            model = fresh()
            local = copy.deepcopy(model)
            optimizer = hvd.DistributedOptimizer(
                sgd(model.parameters()), named_parameters=model.named_parameters(), process_set=first
            )
            plain = sgd(local.parameters())
            x, y = data(hvd.size())
            for step in range(ITERATIONS):
                for m, opt in ((model, optimizer), (local, plain)):
                    opt.zero_grad()
                    loss_of(m, x, y, rank, step).backward()
                    opt.step()
            compare("outside-the-process-set", model, local, 1e-6)
        finally:
            hvd.barrier()
            hvd.remove_process_set(first)

    for label, test in [
        ("parameter-names", parameter_names),
        ("outside-the-process-set", outside_the_process_set),
        ("named-parameters-missing", named_parameters_missing),
        ("arguments-refused", arguments_refused),
        ("predivide", predivide),
        ("sum-op", sum_op),
        ("skip-synchronize-clipping", clipping(skip=True)),
        ("warning-without-skip", clipping(skip=False)),
        ("sparse-embedding", sparse(as_dense=False)),
        ("sparse-as-dense", sparse(as_dense=True)),
        ("compression-objects", compression_objects),
        ("groups-accepted", groups_accepted),
        ("broadcast-state", broadcast_state),
    ]:
        check(label, test)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
