"""Rank program: process sets built from MPI communicators, as Horovod's hvd.init(comm=...,
process_sets=...): each rank passes the half of a split communicator it is in, both halves are
registered, in sorted order, before the sets of listed ranks; a repeat of the global set is refused
after the others are registered; freed ids are reused (3 ranks)."""

from __future__ import annotations

import commsched.torch as hvd
import torch
from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
assert size == 3, "run on 3 ranks"
even = rank % 2 == 0
half = world.Split(color=rank % 2, key=rank)  # ranks 0 and 2, or rank 1
mine, copy_of_world, pair = hvd.ProcessSet(half), hvd.ProcessSet(world.Dup()), hvd.ProcessSet([0, 1])
assert (mine.ranks, mine.process_set_id, mine.mpi_comm) == (None, None, half)
try:
    hvd.init(comm=world, process_sets=[mine, copy_of_world, pair])
except ValueError as error:
    assert "entry number 1 ([0, 1, 2])" in str(error), error
else:
    raise AssertionError("init() accepted a communicator set that repeats the global set")
assert hvd.global_process_set.mpi_comm == world
assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: [0, 1, 2], 1: [0, 2], 2: [1], 3: [0, 1]}
assert mine.process_set_id == (1 if even else 2) and mine.ranks == ([0, 2] if even else [1]), mine
assert copy_of_world.process_set_id is None and pair.process_set_id == 3
assert str(pair) == "ProcessSet(process_set_id=3, ranks=[0, 1], mpi_comm=None)", str(pair)

total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, process_set=mine, name="half")
assert total.tolist() == [4.0 if even else 2.0], total
if rank < 2:
    both = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, process_set=pair, name="pair")
    assert both.tolist() == [3.0], both
try:
    hvd.allreduce(torch.ones(1), process_set=copy_of_world, name="refused")
except ValueError as error:
    assert "not registered" in str(error), error
else:
    raise AssertionError("a set refused at init ran a collective")

# Different numbers of communicator sets by rank: every rank is told, and none is left waiting.
try:
    hvd.init(process_sets=[hvd.ProcessSet(half) for _ in range(2 if rank == 0 else 1)])
except ValueError as error:
    assert "different numbers of sets built from MPI communicators by rank ([2, 1, 1])" in str(error), error
else:
    raise AssertionError("ranks passing different numbers of communicator sets were not refused")

# As Horovod's: a removed set's id goes to the next set added, and every rank's set is refused.
odd = hvd.ProcessSet([1])
hvd.init(process_sets=[odd])  # a second init() binds the new object to the id its ranks have
assert odd.process_set_id == 2
assert hvd.remove_process_set(odd) and odd.process_set_id is None
reused = hvd.add_process_set([1, 2])
assert reused.process_set_id == 2, reused
try:
    hvd.add_process_set([2, 1, 0])
except ValueError as error:
    assert "hvd.global_process_set" in str(error), error
else:
    raise AssertionError("a set of every rank was added beside the global set")
hvd.barrier()
hvd.shutdown()
print(f"PASS comm-sets rank {rank}", flush=True)
