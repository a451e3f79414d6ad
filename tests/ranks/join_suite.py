"""Rank program: Horovod's join() with uneven data, checked on every rank against numpy.

Rank r runs BASE + r + 1 steps of allreduce (sum, average, int32, small ones inline and large ones
on the wire), then joins; the ranks that still step get the joined ranks' zeros (average divides
by every rank, as Horovod). join() returns the last rank to join on every rank; broadcast and
allgather fail while a rank has joined, as in Horovod; a second, even epoch and a reversed
uneven one follow. With --torch, a commsched.torch DistributedOptimizer trains on uneven
batches ending in join on every rank and matches SGD on the data of the ranks still stepping.
Last, a rank that joined hears of another rank's shutdown instead of waiting.

With --sets (3 ranks), join() in process sets: rank 0 joins while rank 1 allreduces on {0,1} (rank 0's
zeros, average over both members), on {1,2} and on {0,1,2} with rank 2; allgather, broadcast,
reducescatter and alltoall on {0,1} fail at once naming rank 0, a barrier on {0,1} completes; none
may wait for the stall limit.

Run as: mpiexec -n N python join_suite.py [--transport grpc] [--torch | --tensorflow-only | --sets]  (tests/test_join.py)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import commsched

BASE = 2
LARGE = 3000  # float32 elements: past the 4096-byte inline limit, so it goes on the wire


def contribution(rank: int, step: int, count: int, salt: int) -> np.ndarray:
    """What `rank` submits at `step`: small integers, so float sums and averages are exact."""
    return np.random.default_rng([salt, rank, step]).integers(-50, 50, count).astype(np.float64)


def rows_of(rank: int, step: int) -> np.ndarray:
    """Rank's allgather rows at `step`: rank + 1 rows of 3, tagged with rank and step."""
    return np.full((rank + 1, 3), 100 * step + rank, np.int64)


def uneven_epoch(size: int, rank: int, steps_of: list[int], salt: int) -> int:
    """Steps this rank's share, checking each result against the ranks still stepping; returns join()."""
    for step in range(steps_of[rank]):
        active = [q for q in range(size) if steps_of[q] > step]
        small = commsched.allreduce_async(
            contribution(rank, step, 4, salt).astype(np.float32), name="join.small"
        )
        large = commsched.allreduce_async(
            contribution(rank, step, LARGE, salt + 1).astype(np.float32), name="join.large", op="average"
        )
        counts = commsched.allreduce(contribution(rank, step, 5, salt + 2).astype(np.int32), name="join.int")
        expected_small = sum(contribution(q, step, 4, salt) for q in active)
        expected_large = sum(contribution(q, step, LARGE, salt + 1) for q in active) / size
        expected_counts = sum(contribution(q, step, 5, salt + 2) for q in active)
        np.testing.assert_array_equal(small.wait(), expected_small.astype(np.float32))
        np.testing.assert_allclose(large.wait(), expected_large, rtol=1e-6)
        np.testing.assert_array_equal(counts, expected_counts.astype(np.int32))
    return commsched.join()


def agreed_everywhere(value: int, size: int) -> None:
    """Every rank got the same `value`."""
    everyone = commsched.allgather(np.array([value], np.int64), name="join.same")
    assert list(everyone) == [value] * size, f"join() returned {list(everyone)} across ranks"


def framework_free(size: int, rank: int, inline_bytes: int) -> None:
    """Two uneven epochs (last joiner: the highest rank, then rank 0) around an even one."""
    last = uneven_epoch(size, rank, [BASE + q + 1 for q in range(size)], salt=1)
    assert last == size - 1, f"rank {rank}: join() returned {last}, expected {size - 1}"
    agreed_everywhere(last, size)
    # An even epoch: every rank's data counts again.
    for step in range(2):
        summed = commsched.allreduce(contribution(rank, step, 6, 9), name="even")
        np.testing.assert_array_equal(summed, sum(contribution(q, step, 6, 9) for q in range(size)))
    last = uneven_epoch(size, rank, [BASE + size - q for q in range(size)], salt=2)
    assert last == 0, f"rank {rank}: join() returned {last}, expected 0"
    agreed_everywhere(last, size)
    # Every rank joins with nothing left: one answer everywhere, whatever the rounds.
    agreed_everywhere(commsched.join(), size)
    # A broadcast or allgather while a rank has joined fails on the ranks that asked for it, as in Horovod.
    if rank == 0:
        last = commsched.join()
    else:
        for kind, run in [
            ("broadcast", lambda: commsched.broadcast(np.ones(4), root=size - 1, name="join.broadcast")),
            ("allgather", lambda: commsched.allgather(rows_of(rank, 0), name="join.allgather")),
        ]:
            try:
                run()
            except commsched.CollectiveError as error:
                assert "cannot run while rank 0 joined" in str(error), error
            else:
                raise AssertionError(f"a {kind} while rank 0 joined did not fail")
        commsched.barrier(name="join.barrier")  # a barrier needs no data from rank 0: it completes
        last = commsched.join()
    assert 1 <= last < size, f"rank {rank}: join() returned {last} although rank 0 joined first"
    agreed_everywhere(last, size)
    print(f"rank {rank}: JOIN OK inline_bytes={inline_bytes}", flush=True)


def torch_training(size: int, rank: int) -> None:
    """DistributedOptimizer on uneven batches, then join and a broadcast from the last to join."""
    import commsched.torch as hvd
    import torch

    def batch(q: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * q + step)
        return torch.randn(8, 5, generator=generator), torch.randn(8, 1, generator=generator)

    def fresh_model() -> torch.nn.Module:
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    steps_of = [BASE + q + 1 for q in range(size)]
    model = fresh_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for step in range(steps_of[rank]):
        optimizer.zero_grad()
        inputs, targets = batch(rank, step)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    last = hvd.join()
    assert last == size - 1, f"rank {rank}: hvd.join() returned {last}"
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)

    # Reference: one process, each step's gradient summed over the ranks still stepping, over every rank.
    reference = fresh_model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(max(steps_of)):
        grads = [torch.zeros_like(p) for p in reference.parameters()]
        for q in (q for q in range(size) if steps_of[q] > step):
            reference.zero_grad()
            inputs, targets = batch(q, step)
            torch.nn.functional.mse_loss(reference(inputs), targets).backward()
            for total, parameter in zip(grads, reference.parameters()):
                total += parameter.grad
        for total, parameter in zip(grads, reference.parameters()):
            parameter.grad = total / size
        plain.step()
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    print(f"rank {rank}: TORCH JOIN OK", flush=True)


def tensorflow_eager(settings: dict[str, str]) -> None:
    """commsched.tensorflow in eager mode: uneven allreduce steps, then hvd.join()."""
    import commsched.tensorflow as hvd
    import tensorflow as tf

    hvd.init(**settings)
    size, rank = hvd.size(), hvd.rank()
    steps_of = [BASE + q + 1 for q in range(size)]
    for step in range(steps_of[rank]):
        active = [q for q in range(size) if steps_of[q] > step]
        summed = hvd.allreduce(tf.constant(contribution(rank, step, 6, 5)), op=hvd.Sum, name="tf.join.sum")
        averaged = hvd.allreduce(
            tf.constant(contribution(rank, step, LARGE, 6), tf.float32),
            op=hvd.Average,
            name="tf.join.average",
        )
        np.testing.assert_array_equal(summed.numpy(), sum(contribution(q, step, 6, 5) for q in active))
        expected_average = sum(contribution(q, step, LARGE, 6) for q in active) / size
        np.testing.assert_allclose(averaged.numpy(), expected_average, rtol=1e-6)
    last = hvd.join()
    assert last == size - 1, f"rank {rank}: hvd.join() returned {last}"
    hvd.shutdown()
    print(f"rank {rank}: TENSORFLOW JOIN OK", flush=True)


def shutdown_while_joined(rank: int) -> None:
    """Rank 0 joins; the others shut down: rank 0's join() raises instead of waiting."""
    if rank == 0:
        try:
            commsched.join(timeout=120)
        except commsched.NotRunningError as error:
            assert "shutdown" in str(error), error
        else:
            raise AssertionError("join() returned although the other ranks shut down")
    commsched.shutdown()
    print(f"rank {rank}: SHUTDOWN WHILE JOINED OK", flush=True)


def join_in_process_sets(rank: int) -> None:
    """Rank 0 joins; ranks 1 and 2 go on with collectives on the sets rank 0 is a member of."""
    prompt = 20.0  # far below the stall limit: a set collective must not wait for a joined member
    pair, right = (commsched.add_process_set(ranks) for ranks in ([0, 1], [1, 2]))
    everyone = commsched.global_process_set  # a set of every rank is the global set (as in Horovod)
    small, large = contribution(rank, 0, 5, 31), contribution(rank, 0, LARGE, 32)
    if rank == 0:
        last = commsched.join(timeout=60)
    else:
        if rank == 1:
            summed = commsched.allreduce(small.copy(), name="sets.sum", process_set=pair, timeout=prompt)
            np.testing.assert_array_equal(summed, small)  # rank 0 adds zeros
            averaged = commsched.allreduce(
                large.astype(np.float32), name="sets.average", op="average", process_set=pair, timeout=prompt
            )
            np.testing.assert_allclose(averaged, large / 2, rtol=1e-6)  # divided by both members
            refused = {
                "allgather": lambda: commsched.allgather(
                    rows_of(rank, 0), name="sets.allgather", process_set=pair
                ),
                "broadcast": lambda: commsched.broadcast(
                    np.ones(4), root=1, name="sets.broadcast", process_set=pair
                ),
                "reducescatter": lambda: commsched.reducescatter(
                    np.ones((4, 2)), name="sets.rs", process_set=pair
                ),
                "alltoall": lambda: commsched.alltoall(
                    np.ones((2, 3)), name="sets.alltoall", process_set=pair
                ),
            }
            for kind, run in refused.items():
                started = time.monotonic()
                try:
                    run()
                except commsched.CollectiveError as error:
                    assert "cannot run while rank 0 joined" in str(error), error
                    assert time.monotonic() - started < prompt, (
                        f"the {kind} failed only after the stall limit"
                    )
                else:
                    raise AssertionError(f"a {kind} on {{0,1}} while rank 0 joined did not fail")
            commsched.barrier(name="sets.barrier", process_set=pair, timeout=prompt)
        both = commsched.allreduce(small.copy(), name="sets.right", process_set=right, timeout=prompt)
        np.testing.assert_array_equal(both, contribution(1, 0, 5, 31) + contribution(2, 0, 5, 31))
        all_three = commsched.allreduce(large.copy(), name="sets.all", process_set=everyone, timeout=prompt)
        np.testing.assert_array_equal(
            all_three, contribution(1, 0, LARGE, 32) + contribution(2, 0, LARGE, 32)
        )
        last = commsched.join(timeout=60)
    assert last in (1, 2), f"rank {rank}: join() returned {last}"
    agreed_everywhere(last, 3)
    # Every rank stepped again: the set of rank 0 and 1 has both members' data once more.
    if rank in (0, 1):
        again = commsched.allreduce(small.copy(), name="sets.sum", process_set=pair, timeout=prompt)
        np.testing.assert_array_equal(again, contribution(0, 0, 5, 31) + contribution(1, 0, 5, 31))
    commsched.barrier(name="sets.end")  # nobody shuts down under the others' last collective
    print(f"rank {rank}: JOIN IN SETS OK", flush=True)


def main() -> int:
    """Runs every scenario on this rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="")
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--tensorflow-only", action="store_true")
    parser.add_argument("--sets", action="store_true")
    args = parser.parse_args()
    settings = {"transport": args.transport} if args.transport else {}
    if args.sets:
        commsched.init(**settings)
        join_in_process_sets(commsched.rank())
        commsched.shutdown()
        return 0
    if args.tensorflow_only:
        tensorflow_eager(settings)
        return 0
    for inline_bytes in (4096, 0):  # small tensors inline in the reports, then every one on the wire
        commsched.init(**settings, inline_bytes=inline_bytes)
        size, rank = commsched.size(), commsched.rank()
        framework_free(size, rank, inline_bytes)
        if args.torch and inline_bytes == 0:
            torch_training(size, rank)
        if inline_bytes == 0:
            shutdown_while_joined(rank)
        else:
            commsched.shutdown()
    print(f"rank {rank}: ALL JOIN OK over {args.transport or 'auto'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
