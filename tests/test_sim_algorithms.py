"""The simulator's allreduce algorithms against their closed forms, written out here by hand."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from commsched import _core, collective_model
from commsched.bench import schedule, sim_cli
from commsched.link_defaults import default_sizes
from commsched.link_probe import link_from_timings, mpich_algorithm, transport_algorithm

RANKS = [2, 3, 4, 5, 6, 7, 8, 12, 64, 100, 1000, 1024]
CONCRETE = ["ring", "recursive-doubling", "halving-doubling", "tree"]


def power_below(ranks: int) -> int:
    """The largest power of two <= ranks, found by doubling."""
    power = 1
    while power * 2 <= ranks:
        power *= 2
    return power


def by_hand(algorithm: str, nbytes: float, ranks: int) -> tuple[float, float]:
    """(message latencies, wire bytes) from the published cost formulas (Thakur et al.; NCCL's tuning model)."""
    p = power_below(ranks)
    k = round(math.log2(p))
    # MPICH folds the ranks beyond p in and out whole: one message each way, one latency each way.
    fold_steps, fold_bytes = (0, 0.0) if p == ranks else (2, 2.0 * nbytes)
    if algorithm == "ring":
        return 2 * (ranks - 1), 2 * (ranks - 1) / ranks * nbytes
    if algorithm == "recursive-doubling":
        return k + fold_steps, k * nbytes + fold_bytes
    if algorithm == "halving-doubling":
        return 2 * k + fold_steps, 2 * (p - 1) / p * nbytes + fold_bytes
    assert algorithm == "tree"
    return 2 * math.floor(math.log2(ranks)), 2.0 * nbytes


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("algorithm", CONCRETE)
def test_each_algorithm_pays_its_closed_form(algorithm: str, ranks: int) -> None:
    nbytes = 3 << 20
    steps, wire = by_hand(algorithm, nbytes, ranks)
    cost = _core.allreduce_cost(nbytes, ranks, algorithm, 1e9, 10e-6)
    assert cost["algorithm"] == algorithm
    assert cost["steps"] == steps
    assert cost["wire_bytes"] == pytest.approx(wire, rel=1e-12)
    assert cost["seconds"] == pytest.approx(steps * 10e-6 + wire / 1e9, rel=1e-12)
    # The Python copy of the model (the link probe and the defaults use it) agrees.
    assert collective_model.steps(algorithm, ranks) == steps
    assert collective_model.wire_bytes(algorithm, nbytes, ranks) == pytest.approx(wire, rel=1e-12)


@pytest.mark.parametrize("algorithm", CONCRETE)
def test_two_ranks_pay_two_latencies_and_one_message_except_recursive_doubling(algorithm: str) -> None:
    cost = _core.allreduce_cost(1 << 20, 2, algorithm, 1e9, 1e-5)
    if algorithm == "recursive-doubling":  # a single exchange of the whole message
        assert (cost["steps"], cost["wire_bytes"]) == (1, 1 << 20)
    elif algorithm == "tree":  # NCCL's model charges twice the message at any rank count
        assert (cost["steps"], cost["wire_bytes"]) == (2, 2 << 20)
    else:
        assert (cost["steps"], cost["wire_bytes"]) == (2, 1 << 20)


@pytest.mark.parametrize("ranks", [3, 8, 1000, 1024])
def test_mpich_doubles_short_messages_and_halves_long_ones(ranks: int) -> None:
    p = power_below(ranks)
    # Up to 2048 bytes, or fewer float32 elements than p: recursive doubling; above both: Rabenseifner.
    short = [4, 2048, 4 * (p - 1)]
    long = [max(2052, 4 * p), 1 << 20]
    for nbytes in short:
        assert _core.allreduce_cost(nbytes, ranks, "mpich")["algorithm"] == "recursive-doubling"
        assert collective_model.resolve("mpich", nbytes, ranks, 1e9, 1e-5) == "recursive-doubling"
    for nbytes in long:
        assert _core.allreduce_cost(nbytes, ranks, "mpich")["algorithm"] == "halving-doubling"
        assert collective_model.resolve("mpich", nbytes, ranks, 1e9, 1e-5) == "halving-doubling"


@pytest.mark.parametrize(
    ("ranks", "rate", "latency"), [(4, 1.25e9, 20e-6), (8, 1.25e8, 2e-6), (16, 1.25e10, 5e-6)]
)
def test_nccl_takes_the_tree_below_the_crossover_and_the_ring_above(
    ranks: int, rate: float, latency: float
) -> None:
    # ring - tree = (2(n-1) - 2 log2 n) latency - 2m / (n rate): zero at m below.
    crossover = ranks * rate * ((ranks - 1) - math.log2(ranks)) * latency
    for nbytes, expected in ((crossover * 0.9, "tree"), (crossover * 1.1, "ring")):
        assert _core.allreduce_cost(int(nbytes), ranks, "nccl", rate, latency)["algorithm"] == expected
        assert collective_model.resolve("nccl", int(nbytes), ranks, rate, latency) == expected


def test_nccl_runs_the_ring_at_two_ranks() -> None:
    # Same two latencies, half the bytes: the tree never wins.
    for nbytes in (4, 1 << 30):
        assert _core.allreduce_cost(nbytes, 2, "nccl", 1e9, 1e-3)["algorithm"] == "ring"


ONE_TENSOR = 1_000_000


@pytest.mark.parametrize("ranks", [2, 3, 6, 8, 1024])
@pytest.mark.parametrize("algorithm", [*CONCRETE, "mpich", "nccl"])
def test_one_tensor_costs_compute_exchange_and_its_algorithm(algorithm: str, ranks: int) -> None:
    layers = [("l0", 0.01, 0.02, [ONE_TENSOR])]
    rate, latency = 1e8, 1e-4
    concrete = {"mpich": "halving-doubling"}.get(algorithm, algorithm)
    if algorithm == "nccl":  # one megabyte: whichever of the two closed forms is faster
        costs = {a: by_hand(a, ONE_TENSOR, ranks) for a in ("ring", "tree")}
        concrete = min(costs, key=lambda a: costs[a][0] * latency + costs[a][1] / rate)
    steps, wire = by_hand(concrete, ONE_TENSOR, ranks)
    one = steps * latency + wire / rate
    result = _core.simulate(
        layers,
        ranks,
        rate,
        latency,
        "fifo",
        4 << 20,
        8 << 20,
        1 << 20,
        "barrier",
        1.0,
        3e-4,
        4,
        2,
        algorithm=algorithm,
    )
    assert result["iteration_s"] == pytest.approx(0.03 + 3e-4 + one, rel=1e-9)
    assert result["communication_s"] == pytest.approx(one, rel=1e-9)
    best = _core.simulate_ideal(layers, ranks, rate, 4, 2, latency, algorithm)
    # The ideal moves the same bytes and pays exactly one of the algorithm's latencies, with no exchange.
    assert best["iteration_s"] == pytest.approx(0.03 + one, rel=1e-9)


def ideal_two_layer_period(
    small_wire_s: float, small_latency_s: float, big_wire_s: float, big_latency_s: float
) -> float:
    """Period of the ideal schedule of TWO_LAYERS-like profiles (1 s of forward and of backward per layer),
    worked by hand: from the end of layer 1's backward (its big gradient ready) the next forward of
    layer 1 waits for the later of two paths, layer 0's backward, preemptive reduction and forward
    (2 s + its wire time and latency) or the big reduction, delayed by the small one's wire time;
    then 2 s of forward and backward close the period."""
    via_small = 2.0 + small_wire_s + small_latency_s
    via_big = big_wire_s + small_wire_s + big_latency_s
    return 2.0 + max(via_small, via_big)


def test_ideal_pays_each_tensors_own_latency_under_a_choice_by_size() -> None:
    # MPICH on 8 ranks at 1 MB/s, 0.1 s per message: layer 0's 1 KiB gradient goes by recursive doubling
    # (3 latencies, 3 x 1 KiB), layer 1's 1 MB one by halving-doubling (6 latencies, 7/4 MB).
    layers = [("first", 1.0, 1.0, [1024]), ("second", 1.0, 1.0, [1_000_000])]
    best = _core.simulate_ideal(layers, 8, 1e6, 4, 2, 0.1, "mpich")
    assert best["iteration_s"] == pytest.approx(
        ideal_two_layer_period(3 * 1024 / 1e6, 0.3, 1.75, 0.6), rel=1e-9
    )
    # The same profile under the ring: 14 latencies and 7/4 of the bytes for both.
    ring = _core.simulate_ideal(layers, 8, 1e6, 4, 2, 0.1, "ring")
    assert ring["iteration_s"] == pytest.approx(
        ideal_two_layer_period(1.75 * 1024 / 1e6, 1.4, 1.75, 1.4), rel=1e-9
    )


def test_bad_algorithm_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="'rings' is not one of ring, recursive-doubling"):
        _core.allreduce_cost(4, 8, "rings")
    with pytest.raises(ValueError, match="halving-doubling, tree, mpich or nccl"):
        _core.simulate_ideal([("l", 0.0, 0.0, [4])], 2, 1e9, 1, 0, 0.0, "openmpi")
    with pytest.raises(ValueError, match="at least 2 ranks"):
        _core.allreduce_cost(4, 1, "ring")
    with pytest.raises(ValueError, match="'bogus' is not one of"):
        default_sizes(8, 1e9, 1e-5, algorithm="bogus")


def _profile() -> SimpleNamespace:
    layer = SimpleNamespace(name="l0", params=[("l0.w", (64, 64))], forward_flops=1e9, backward_flops=2e9)
    return SimpleNamespace(name="tiny", batch_size=1, layers=[layer])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algorithm", "bogus"], "--algorithm 'bogus' is not one of ring, recursive-doubling"),
        (["--ranks", "1,8"], "--ranks '1,8': the simulator needs 2 or more ranks"),
    ],
)
def test_sim_cli_refuses_bad_input(argv: list[str], message: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr(schedule, "load_model", lambda name: _profile())
    assert sim_cli.main(["--model", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_sim_cli_uses_the_algorithm_for_defaults_and_communication(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(schedule, "load_model", lambda name: _profile())
    out = tmp_path / "sim.json"
    argv = [
        "--model",
        "tiny",
        "--ranks",
        "1024",
        "--bandwidth",
        "100gbit",
        "--algorithm",
        "mpich",
        "--json",
        str(out),
    ]
    assert sim_cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["algorithm"] == "mpich"
    total = 4 * 4096
    for row in data["results"]:
        # 16 KiB on 1024 ranks: 4096 elements >= 1024 and above 2 KiB, so halving-doubling: 20 latencies.
        assert row["communication_s"] == pytest.approx(2 * 1023 / 1024 * total / 12.5e9 + 20 * 20e-6)
        expected = default_sizes(1024, 12.5e9, 20e-6, algorithm="mpich")
        assert {name: row[name] for name in expected} == expected


def test_sim_cli_rounds_choose_the_model_and_the_defaults(tmp_path, monkeypatch) -> None:
    """--rounds channel (the default) keeps rounds off the data's queue and fits the credit to it;
    --rounds data queues them behind the bytes in flight, with the rule for that."""
    results = {}
    for rounds in ("channel", "data"):
        out = tmp_path / f"{rounds}.json"
        argv = ["--model", "resnet50", "--ranks", "1024", "--bandwidth", "100gbit", "--latency", "20us"]
        assert (
            sim_cli.main(
                [
                    *argv,
                    "--rounds",
                    rounds,
                    "--policies",
                    "priority",
                    "--modes",
                    "overlap",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        data = json.loads(out.read_text())
        assert data["rounds"] == rounds
        results[rounds] = data["results"][0]
        expected = default_sizes(1024, 12.5e9, 20e-6, rounds=rounds)
        assert {name: results[rounds][name] for name in expected} == expected
    assert results["channel"]["credit_bytes"] < results["data"]["credit_bytes"]
    # A round behind a whole iteration's queued bytes holds back every launch after it.
    assert results["channel"]["iteration_s"] < results["data"]["iteration_s"]
    assert results["channel"]["best_s"] == results["data"]["best_s"]


@pytest.mark.parametrize("ranks", [2, 3, 4, 8, 64, 1000, 1024])
@pytest.mark.parametrize(
    ("rate", "latency"), [(1.25e8, 50e-6), (1.25e9, 20e-6), (1.25e10, 5e-6), (1.25e10, 20e-6)]
)
def test_defaults_fit_the_delay_of_the_algorithm_the_transport_runs(
    ranks: int, rate: float, latency: float
) -> None:
    # The rule depends on the link only through its delay, so an algorithm with s latencies gets the
    # ring's sizes for a latency scaled by s / 2(n-1).
    ring_steps = 2 * (ranks - 1)
    assert default_sizes(ranks, rate, latency, algorithm="ring") == default_sizes(ranks, rate, latency)
    halving_steps, _ = by_hand("halving-doubling", 1, ranks)
    expected = default_sizes(ranks, rate, latency * halving_steps / ring_steps)
    assert default_sizes(ranks, rate, latency, algorithm="mpich") == expected
    assert default_sizes(ranks, rate, latency, algorithm="halving-doubling") == expected
    nccl = default_sizes(ranks, rate, latency, algorithm="nccl")
    # Under NCCL's choice: the tree's delay where the tree is faster for a message of that partition,
    # and then the next power of two the ring is faster for, up to 64 MiB, with the ring's credit.
    tree_steps, _ = by_hand("tree", 1, ranks)

    def tree_faster(nbytes: int) -> bool:
        return (
            tree_steps * latency + 2 * nbytes / rate
            < ring_steps * latency + 2 * (ranks - 1) / ranks * nbytes / rate
        )

    tree = default_sizes(ranks, rate, latency * tree_steps / ring_steps)
    if not tree_faster(tree["partition_bytes"]):
        assert nccl == default_sizes(ranks, rate, latency)
        return
    ring_from = next(
        (
            p
            for p in (tree["partition_bytes"] << k for k in range(1, 12))
            if p <= 64 << 20 and not tree_faster(p)
        ),
        None,
    )
    assert nccl == (
        tree if ring_from is None else default_sizes(ranks, rate, latency, partition_bytes=ring_from)
    )


def test_two_ranks_keep_the_same_defaults_under_every_transport() -> None:
    for rate, latency in ((1.25e8, 40e-6), (1.25e9, 20e-6), (1.25e10, 2e-6)):
        ring = default_sizes(2, rate, latency)
        for algorithm in ("mpich", "nccl", "halving-doubling", "tree"):
            assert default_sizes(2, rate, latency, algorithm=algorithm) == ring


@pytest.mark.parametrize("ranks", [2, 3, 4, 8, 1024])
def test_link_from_timings_inverts_the_mpich_model(ranks: int) -> None:
    """Times made with MPICH's closed forms (recursive doubling for 4 bytes, Rabenseifner for 1 MiB)."""
    rate, latency, nbytes = 1.25e9, 15e-6, 1 << 20
    tiny_steps, _ = by_hand("recursive-doubling", 4, ranks)
    big_steps, big_wire = by_hand("halving-doubling", nbytes, ranks)
    tiny = tiny_steps * latency  # its 4 bytes are below the model's notice
    big = big_steps * latency + big_wire / rate
    assert link_from_timings(ranks, tiny, big, nbytes, "mpich") == pytest.approx((rate, latency))


def test_transports_name_the_algorithm_they_run() -> None:
    assert transport_algorithm("gloo") == transport_algorithm("grpc") == "ring"
    assert transport_algorithm("nccl") == "nccl"
    assert transport_algorithm("mpi", environ={}, library="MPICH Version: 4.2.0") == "mpich"
    assert transport_algorithm("mpi", environ={}, library="Open MPI v5.0.3") == "ring"
    variable = "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM"
    assert mpich_algorithm(variable, {variable: "tsp_ring"}) == "ring"
    assert mpich_algorithm(variable, {variable: "sched_recursive_doubling"}) == "recursive-doubling"
    assert mpich_algorithm(variable, {variable: "sched_reduce_scatter_allgather"}) == "halving-doubling"
    assert mpich_algorithm(variable, {variable: "auto"}) == "mpich"


def test_the_rig_forces_the_ring_so_its_defaults_keep_the_ring_model() -> None:
    """benchmarks/netrig.py's MPICH variables make both the probe and the transport a ring."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "netrig.py"
    spec = importlib.util.spec_from_file_location("netrig_for_algorithms", path)
    assert spec is not None and spec.loader is not None
    netrig = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(netrig)
    environ = dict(netrig.RING_COLLECTIVES_ENV)
    assert mpich_algorithm("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", environ) == "ring"
    assert transport_algorithm("mpi", environ=environ, library="MPICH Version: 5.0.2") == "ring"
    assert environ["MPIR_CVAR_IALLGATHERV_INTRA_ALGORITHM"] == "sched_ring"  # the split's all-gathers too
