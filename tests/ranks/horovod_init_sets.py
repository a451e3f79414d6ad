"""Rank program: hvd.init(process_sets=...) as Horovod's: duplicates fail after the others are
registered, a second init() binds new set objects to the ids their ranks have, and the global set's
ranks are the job's while it runs (2 ranks)."""

from __future__ import annotations

import commsched.torch as hvd
import torch
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
assert hvd.global_process_set.ranks is None, hvd.global_process_set.ranks
first = [hvd.ProcessSet([0]), hvd.ProcessSet([1]), hvd.ProcessSet([1, 0]), hvd.ProcessSet([0])]
try:
    hvd.init(process_sets=first)
except ValueError as error:
    assert "entry number 2" in str(error) and "entry number 3" in str(error), error
else:
    raise AssertionError("init() accepted duplicate process sets")
assert hvd.is_initialized()
assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: [0, 1], 1: [0], 2: [1]}
assert [s.process_set_id for s in first] == [1, 2, None, None], first

second = [hvd.ProcessSet([0]), hvd.ProcessSet(reversed([1]))]
hvd.init(process_sets=second)
assert [s.process_set_id for s in second] == [1, 2], second
assert hvd.global_process_set.ranks == [0, 1], hvd.global_process_set.ranks
assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: [0, 1], 1: [0], 2: [1]}
mine = second[rank]
total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, process_set=mine, name="own.set")
assert total.tolist() == [rank + 1.0], total
everyone = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, name="global.set")
assert everyone.tolist() == [3.0], everyone
hvd.shutdown()
assert hvd.global_process_set.ranks is None, hvd.global_process_set.ranks
print(f"PASS init-sets rank {rank}", flush=True)
