"""DistributedOptimizer(shard=True): the sharded optimizer matches the unsharded one, rank by rank.

The rank script (tests/torch_ranks/shard_cases.py) trains two copies of each model side by side,
unsharded and sharded, and compares parameters, state and per-rank memory; see its docstring.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from mpirun import clean_rank_env, full_matrix, local_launch, unglue
from torch_launcher import HERE, have_mpiexec, launch

torch = pytest.importorskip("torch")
needs_mpi = pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")

# Cases and their modes (memory and clip run in barrier mode only); see shard_cases.py.
ALL = ("sgd", "small", "adamw", "exact", "mixed", "clip", "pset", "memory", "state")


def _runs(cases: tuple[str, ...]) -> int:
    return sum(1 if case in ("memory", "clip") else 2 for case in cases)


def _check(result: object, ranks: int, cases: tuple[str, ...], transport: str = "") -> str:
    output = result.stdout  # type: ignore[attr-defined]
    assert result.returncode == 0, output[-4000:]  # type: ignore[attr-defined]
    text = unglue(output, "PASS ", "FAIL ")
    assert "FAIL" not in text, text[-4000:]
    passes = [p for p in re.findall(r"PASS (\S+)", text) if not p.startswith("recut/")]
    assert len(passes) == ranks * _runs(cases), text[-4000:]
    if transport:  # every run went over the transport asked for
        assert text.count(f"transport={transport}") == len(passes), text[-4000:]
    return text


@pytest.fixture(scope="module")
def recut_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the 2-rank MPI launch saves the full state that the 3-rank one loads."""
    return str(tmp_path_factory.mktemp("recut") / "state.pt")


@functools.cache
def _mpiexec(ranks: int, recut_file: str) -> subprocess.CompletedProcess[str]:
    """The MPI launch at 2 or 3 ranks: every case, then the state saved (2) or loaded (3)."""
    if ranks == 3:
        _mpiexec(2, recut_file)  # saves the state the 3-rank launch loads
    return launch("mpiexec", ranks, "shard_cases.py", "--recut", recut_file, timeout=180)


@needs_mpi
def test_mpiexec_two_ranks_every_case(recut_file: str) -> None:
    """MPI, 2 ranks: SGD/AdamW in both modes, exact integer data, mixed dtypes, clipping, a process set,
    memory, state; small, exact and state with parameters cut into pieces across buckets."""
    text = _check(_mpiexec(2, recut_file), 2, ALL)
    assert "grad_ratio=1.0" in text
    for case in ("small", "exact", "state"):  # parameters cut into pieces across buckets
        assert re.search(rf"PASS {case}/overlap .* cut=[1-9]", text), text[-4000:]


@needs_mpi
def test_mpiexec_three_ranks(recut_file: str) -> None:
    """MPI, 3 ranks (shards padded to a multiple of 3): the same cases."""
    _check(_mpiexec(3, recut_file), 3, ALL)


@needs_mpi
def test_state_saved_at_two_ranks_loads_at_three(recut_file: str) -> None:
    """full_state_dict() saved at 2 ranks, loaded at 3 into laid-out shards: gathered again it is equal,
    and training goes on to the unsharded optimizer's parameters (the end of each MPI launch)."""
    saved = _mpiexec(2, recut_file)
    assert saved.returncode == 0 and "PASS recut/save" in saved.stdout, saved.stdout[-4000:]
    loaded = _mpiexec(3, recut_file)
    text = unglue(loaded.stdout, "PASS ", "FAIL ")
    assert loaded.returncode == 0 and text.count("PASS recut/load ranks=3") == 3, text[-4000:]


def test_torchrun_gloo_two_ranks() -> None:
    """torchrun (Gloo, no MPI), 2 ranks: equivalence in both modes, many buckets, exact data, state."""
    cases = ("sgd", "small", "adamw", "exact", "state")
    _check(launch("torchrun", 2, "shard_cases.py", "--cases", ",".join(cases), timeout=90), 2, cases)


# Per rank count: cases that cover buckets cut across parameters, exact data and the state round trip
# between the two launches while keeping each launch short.
TRANSPORT_CASES = {2: ("sgd", "adamw", "exact", "state"), 3: ("small", "exact", "mixed")}
# broadcast_parameters (the sgd case) asks torch for a CUDA device, which the fake GPU cannot give.
# exact runs on the fake GPU at 2 ranks; at 3 it runs over MPI, gRPC and Gloo (TRANSPORT_CASES).
FAKE_GPU_CASES = {2: ("adamw", "exact", "state"), 3: ("small", "mixed")}


def _cases(table: dict[int, tuple[str, ...]], ranks: int) -> tuple[str, ...]:
    """The cases of a rank count. The 2-rank cells are in the full matrix only, so without it the
    3-rank launch also runs theirs: the default run leaves out a launch, not a case."""
    if ranks == 3 and not full_matrix():
        return tuple(dict.fromkeys(table[2] + table[3]))
    return table[ranks]


@pytest.mark.skipif(importlib.util.find_spec("grpc") is None, reason="needs grpcio")
@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.full), 3])
def test_grpc_matches_the_unsharded_optimizer(ranks: int) -> None:
    """gRPC transport (commsched-run), 2 and 3 ranks: reduce-scatter and all-gather over its rings give
    the unsharded optimizer's parameters, bit for bit on integer data."""
    cases = _cases(TRANSPORT_CASES, ranks)
    argv = local_launch(
        ranks, str(HERE / "shard_cases.py"), "--transport", "grpc", "--cases", ",".join(cases)
    )
    result = subprocess.run(
        argv,
        check=False,
        env=clean_rank_env(HERE),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=90,
    )
    text = _check(result, ranks, cases, "grpc")
    assert "exact/overlap difference=0 " in text


@needs_mpi
@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.full), 3])
def test_nccl_on_the_fake_gpu_matches_the_unsharded_optimizer(
    ranks: int, fake_nccl: tuple[Path, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL transport over the fake libnccl (which reduces across the rank processes), 2 and 3 ranks:
    CUDA-claiming parameters reduce-scattered and all-gathered through ncclReduceScatter/ncclAllGather
    give the unsharded optimizer's parameters."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", str(ranks))
    cases = _cases(FAKE_GPU_CASES, ranks)
    result = launch(
        "mpiexec",
        ranks,
        "shard_cases.py",
        "--fake-gpu",
        str(fake_nccl[0]),
        "--cases",
        ",".join(cases),
        timeout=90,
    )
    text = _check(result, ranks, cases, "nccl")
    if "exact" in cases:
        assert "exact/overlap difference=0 " in text


def test_python_gloo_two_ranks(tmp_path: Path) -> None:
    """The Python Gloo transport (commsched._gloo made unimportable), 2 ranks: the same parameters."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['commsched._gloo'] = None\n")
    cases = ("small", "exact")
    argv = local_launch(2, str(HERE / "shard_cases.py"), "--transport", "gloo", "--cases", ",".join(cases))
    result = subprocess.run(
        argv,
        check=False,
        env=clean_rank_env(tmp_path, HERE),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=90,
    )
    _check(result, 2, cases, "gloo(python)")


def test_whole_tensor_optimizer_is_refused_by_name() -> None:
    """An optimizer whose step needs whole tensors (LBFGS) is refused at wrap time, naming it."""
    import commsched.torch as ct

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="shard=True cannot wrap LBFGS"):
        ct.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), model=model, shard=True)

    class Muon(torch.optim.SGD):
        """Stands for an orthogonalising optimizer: refused by its class name."""

    with pytest.raises(ValueError, match="cannot wrap Muon"):
        ct.DistributedOptimizer(Muon(model.parameters(), lr=0.1), model=model, shard=True)


def test_checkpointer_refuses_a_sharded_optimizer_over_a_process_set(tmp_path: Path) -> None:
    """Checkpointer saves a sharded optimizer over every rank; over a subset it says so and names full_state_dict()."""
    import commsched.torch as ct
    from commsched.torch._shard import ShardedOptimizer

    model = torch.nn.Linear(4, 2)
    optimizer = object.__new__(ShardedOptimizer)  # the refusal looks at the class and the rank count only
    optimizer._ranks = 2  # a process set of 2 in a job of 1 rank
    with pytest.raises(NotImplementedError, match="full_state_dict"):
        ct.Checkpointer(model, optimizer, tmp_path)


@pytest.mark.parametrize(("ranks", "position"), [(1, 0), (3, 1)])
def test_adam_counts_steps_per_parameter_like_a_plain_adam(ranks: int, position: int) -> None:
    """One bucket stepped as a shard, with parameters left unused in some iterations, keeps each
    parameter's own `step`, moments and values bit for bit equal to a plain torch Adam's, also
    after its state is cut again from the plain form (a load)."""
    from commsched.torch import _shard_layout as layout
    from commsched.torch import _shard_state as state

    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2), (7,)]
    params = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    plain = [p.clone().requires_grad_() for p in params]
    reference = torch.optim.Adam(plain, lr=0.1)
    chosen = [(p, f"p{i}", i, 0) for i, p in enumerate(params)]
    bucket = layout.build(chosen, "0", 0, ranks, position)
    inner = torch.optim.Adam([bucket.shard], lr=0.1)
    unused_by_iteration = [set(), {1}, {1, 2}, set(), {0}, set(), {3}, set()]

    def check() -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in plain])
        begin = bucket.start
        end = min(begin + bucket.shard.numel(), flat.numel())
        assert torch.equal(bucket.shard[: end - begin], flat[begin:end])
        values = state.member_values([bucket], inner)
        assert set(values) == set(reference.state_dict()["state"])
        for i, entry in reference.state_dict()["state"].items():
            assert torch.equal(values[i]["step"], entry["step"]), (i, values[i], entry["step"])
        moments = torch.cat(
            [
                reference.state[p]["exp_avg"].reshape(-1)
                if p in reference.state
                else torch.zeros(p.numel(), dtype=p.dtype)
                for p in plain
            ]
        )
        assert torch.equal(inner.state[bucket.shard]["exp_avg"][: end - begin], moments[begin:end])

    for iteration, unused in enumerate(unused_by_iteration):
        grads = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
        for i, p in enumerate(plain):
            p.grad = None if i in unused else grads[i]
        reference.step()
        flat = torch.zeros(bucket.padded, dtype=torch.float64)
        flat[: sum(p.numel() for p in params)] = torch.cat([g.reshape(-1) for g in grads])
        for i in unused:
            m = bucket.members[i]
            flat[m.offset : m.offset + m.numel] = 0
        bucket.shard.grad = flat[bucket.start : bucket.start + bucket.shard.numel()].clone()
        state.update(inner, [bucket], unused, inner.step)
        check()
        if iteration == 3:  # a load: the plain state cut into a fresh bucket of the same layout
            saved = reference.state_dict()["state"]
            fresh = layout.build([(p, f"p{i}", i, 0) for i, p in enumerate(plain)], "0", 0, ranks, position)
            fresh.shard.copy_(bucket.shard)
            plain_states = [
                {k: v.clone() for k, v in saved[i].items()} if i in saved else {} for i in range(len(params))
            ]
            cut = state.cut(fresh, plain_states, layout.shard_state)
            bucket = fresh
            inner = torch.optim.Adam([bucket.shard], lr=0.1)
            inner.state[bucket.shard] = cut
            assert bucket.records is not None  # the parameters' steps differ
            check()


def test_shard_setting() -> None:
    """COMMSCHED_SHARD is read when shard= is not given; bad values name the variable and the fix."""
    from commsched.config import SettingError, shard_setting

    assert shard_setting(None, {"COMMSCHED_SHARD": "1"}) is True
    assert shard_setting(None, {}) is False
    assert shard_setting(False, {"COMMSCHED_SHARD": "1"}) is False
    with pytest.raises(SettingError, match="COMMSCHED_SHARD: 'maybe' is not valid; use 1 or 0"):
        shard_setting(None, {"COMMSCHED_SHARD": "maybe"})


class _Landing:
    """Reduce-scatter handles that land one at a time, in the order of `order` (bucket names)."""

    def __init__(self, events: list[tuple[str, str]]) -> None:
        self.order: list[str] = []
        self.events = events
        self.landed = 0

    def wrap(self, real: Any, name: str) -> Any:
        landing = self

        class Held:
            def done(self) -> bool:
                return landing.order.index(name) <= landing.landed and bool(real.done())

            def wait(self, timeout: float | None = None) -> Any:
                landing.events.append(("land", name))
                landing.landed += 1
                return real.wait(timeout)

        return Held()


SENT_AS_VIEW: dict[str, bool] = {}  # by bucket, in the last _train_one_rank


def _train_one_rank(
    pipelined: bool, clip: bool, overlap: bool, monkeypatch: pytest.MonkeyPatch, landing_order: str = "3210"
) -> tuple:
    """Trains a small model with shard=True on one rank (4 buckets), its reduce-scatters landing in `landing_order`.

    Returns (the last step's events, the buckets, the model, its initial copy, the same model trained by
    a plain torch AdamW on the same batches).
    """
    import commsched.torch as ct

    import commsched

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    initial, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    events: list[tuple[str, str]] = []
    landing = _Landing(events)
    scatter, gather = commsched.reducescatter_async, commsched.allgather_async

    def held_scatter(array: Any, *args: Any, name: str = "", **kwargs: Any) -> Any:
        # A view of a bigger gradient: the piece went without a copy.
        SENT_AS_VIEW[name.rsplit(".", 1)[-1]] = array.untyped_storage().nbytes() > array.nbytes
        return landing.wrap(scatter(array, *args, name=name, **kwargs), name.rsplit(".", 1)[-1])

    def seen_gather(array: Any, *args: Any, name: str = "", **kwargs: Any) -> Any:
        if ".param." in name:
            events.append(("gather", name.rsplit(".", 1)[-1]))
        return gather(array, *args, name=name, **kwargs)

    monkeypatch.setattr(commsched, "reducescatter_async", held_scatter)
    monkeypatch.setattr(commsched, "allgather_async", seen_gather)
    commsched.init(transport="loopback", bucket_bytes=256)
    try:
        optimizer = ct.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05), model=model, overlap_forward=overlap, shard=True
        )
        optimizer._pipelined = pipelined
        plain = torch.optim.AdamW(plain_model.parameters(), lr=0.05)
        update = optimizer._update

        def seen_update(buckets: list[Any], unused: set[int]) -> None:
            # By bucket, not by parameter: the first layer's weight is cut across buckets 0 and 1.
            events.extend(("update", bucket.name) for bucket in buckets)
            update(buckets, unused)

        monkeypatch.setattr(optimizer, "_update", seen_update)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 4, generator=generator)
            events.clear()
            landing.landed = 0
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            assert len(optimizer.buckets()) == len(landing_order), optimizer.buckets()
            landing.order = list(landing_order)
            if clip:
                optimizer.clip_grad_norm_(0.05)
            optimizer.step()
            plain.zero_grad()
            torch.nn.functional.mse_loss(plain_model(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.05)
            plain.step()
        optimizer.synchronize()
        return list(events), optimizer.buckets(), model, initial, plain_model
    finally:
        commsched.shutdown()


def _difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# Buckets 0-3 in priority order (0: the first layer's, needed first by the next forward). Each is
# updated as it lands; its gather starts once no more urgent reduce-scatter is pending.
PIPELINED = {
    "3210": "L3 U3 L2 U2 L1 U1 L0 U0 G0 G1 G2 G3",
    "0312": "L0 U0 G0 L3 U3 L1 U1 G1 L2 U2 G2 G3",
}


def _story(events: list[tuple[str, str]]) -> str:
    return " ".join(f"{what[0].upper()}{k}" for what, k in events)


@pytest.mark.parametrize(("overlap", "landing_order"), [(False, "3210"), (True, "3210"), (False, "0312")])
def test_step_updates_each_bucket_as_its_reduce_scatter_lands(
    overlap: bool, landing_order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """step() updates each bucket right after its reduce-scatter lands, before the next one lands, gathers it
    once no more urgent reduce-scatter is pending, and ends at a plain torch AdamW's parameters; the
    unpipelined step lands every bucket first (the order check tells the two apart), to the same end.
    The first layer's weight is over the bucket limit: its two pieces go in buckets 0 and 1."""
    events, buckets, model, initial, plain_model = _train_one_rank(
        True, False, overlap, monkeypatch, landing_order
    )
    assert buckets[:2] == [["0.weight"], ["0.weight", "0.bias"]], buckets  # 384 bytes cut at 256
    assert SENT_AS_VIEW == {"0": True, "1": False, "2": False, "3": False}
    assert _story(events) == PIPELINED[landing_order]
    assert _difference(model, plain_model) <= 1e-6 and _difference(model, initial) > 1e-2
    events, _, unpipelined, _, _ = _train_one_rank(False, False, overlap, monkeypatch, landing_order)
    assert _story(events) == "L0 L1 L2 L3 U0 U1 U2 U3 G0 G1 G2 G3"
    assert _difference(model, unpipelined) == 0.0


def test_clipped_step_matches_torch_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    """With clip_grad_norm_ every reduce-scatter lands before any update; the per-bucket updates then give
    torch's clip_grad_norm_ and AdamW's parameters, which differ from the unclipped training's."""
    events, _, model, _, plain_model = _train_one_rank(True, True, False, monkeypatch)
    assert _story(events) == "L0 L1 L2 L3 U0 G0 U1 G1 U2 G2 U3 G3"
    assert _difference(model, plain_model) <= 1e-6
    _, _, unclipped, _, _ = _train_one_rank(True, False, False, monkeypatch)
    assert _difference(model, unclipped) > 1e-3
