"""Rank program: the defaults init() derives from the link, checked on every rank.

argv[1] is the scenario: "measured" (no link settings: init() probes it), "given" (the link from
COMMSCHED_LINK_* variables) or "explicit" (partition from a variable, fusion from init()).
Prints LINK-OK on success.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import commsched
from commsched.link_defaults import default_inline_bytes, default_sizes
from commsched.link_probe import transport_algorithm

scenario = sys.argv[1]
comm = MPI.COMM_WORLD
arguments = {"fusion_bytes": 12345} if scenario == "explicit" else {}
commsched.init(**arguments)
settings = commsched.config()
sizes = {name: settings[name] for name in ("partition_bytes", "credit_bytes", "fusion_bytes", "inline_bytes")}
link = (settings["link_bandwidth"], settings["link_latency"])
assert link[0] > 0 and link[1] >= 0, link
# Every rank holds the same link figures and the same sizes.
assert comm.allgather((link, sizes)) == [(link, sizes)] * comm.Get_size(), comm.allgather((link, sizes))
if scenario == "given":
    assert abs(link[0] - 1.25e9) < 1 and abs(link[1] - 20e-6) < 1e-12, link
# Partitions and fusion also cover commsched's own cost per collective (COMMSCHED_COLLECTIVE_OVERHEAD)
# and the transport's fixed cost per large message, probed on fast links only (none for a given link).
message_cost = settings["link_message_cost"]
assert message_cost is not None and message_cost >= 0, message_cost
if scenario == "given":
    assert message_cost == 0.0, message_cost
overhead = settings["collective_overhead"] + message_cost
expected = default_sizes(comm.Get_size(), *link, collective_overhead_s=overhead)
if scenario == "explicit":
    expected = default_sizes(
        comm.Get_size(), *link, partition_bytes=128 * 1024, collective_overhead_s=overhead
    )
    expected["fusion_bytes"] = 12345
    assert sizes["partition_bytes"] == 128 * 1024, sizes
# The inline limit follows the link and the algorithm MPI runs for a small message.
expected["inline_bytes"] = default_inline_bytes(
    comm.Get_size(), *link, expected["credit_bytes"], transport_algorithm("mpi")
)
assert sizes == expected, (sizes, expected)
# The sizes in effect schedule real reductions correctly.
array = np.full(300000, comm.Get_rank() + 1, np.float32)
commsched.allreduce(array, name="sum", op="sum")
assert np.array_equal(array, np.full(300000, sum(range(1, comm.Get_size() + 1)), np.float32)), array[:4]
commsched.shutdown()
print("LINK-OK", scenario, link, sizes, flush=True)
