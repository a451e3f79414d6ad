"""Arrives in torchrun's exit barrier for the agents an elastic job lost, so that the survivors'
agents end once their workers are done instead of waiting 300 s for an agent that left.

When its workers succeed, each of torchrun's agents meets the others in torch's exit barrier
(torch/distributed/elastic/agent/server/api.py `_exit_barrier`, utils/store.py `barrier`): it adds 1
to `<P>/num_members`, the one that brings it to GROUP_WORLD_SIZE sets `<P>/last_member`, and all
wait up to 300 s for that key. P is `torchelastic/agent/terminal_state` in the agents' store: the
PrefixStore `torch.rendezvous.<run id>.<round>` of the rendezvous store at --rdzv-endpoint, not the
store the workers get at MASTER_ADDR:MASTER_PORT. An agent whose worker failed returns without
arriving, so once every worker of an agent is lost the new rank 0 arrives for that agent, once.
A torch whose barrier keys differ, or a store or round that cannot be found, is left alone (debug log).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

log = logging.getLogger("commsched")

# torch 2.13's barrier layout; another layout is left alone rather than guessed at.
_BARRIER_PREFIX = "torchelastic/agent/terminal_state"
_NUM_MEMBERS = "/num_members"
_LAST_MEMBER = "/last_member"
_DEFAULT_PORT = 29400  # torch's c10d rendezvous backend, for an endpoint without a port
_ROUNDS = 16  # rendezvous rounds searched for the one that started these workers
_STORE_TIMEOUT = datetime.timedelta(seconds=5)


def record_agent(store: Any, prefix: str, member: int) -> None:
    """Writes which agent (GROUP_RANK) runs worker `member`, for the arrival on its behalf."""
    store.set(f"{prefix}/agent/{member}", os.environ.get("GROUP_RANK", ""))


def _layout() -> tuple[str, str] | None:
    """The counter and last-member keys of torch's exit barrier, or None if torch's differ."""
    try:
        from torch.distributed.elastic.agent.server import api
        from torch.distributed.elastic.utils import store as store_util
    except ImportError:
        return None
    if (
        getattr(api, "_TERMINAL_STATE_SYNC_ID", None) != _BARRIER_PREFIX
        or getattr(store_util, "_NUM_MEMBERS", None) != _NUM_MEMBERS
        or getattr(store_util, "_LAST_MEMBER_CHECKIN", None) != _LAST_MEMBER
        or not callable(getattr(store_util, "_barrier_nonblocking", None))
    ):
        return None
    return _BARRIER_PREFIX + _NUM_MEMBERS, _BARRIER_PREFIX + _LAST_MEMBER


def gone_agents(store: Any, prefix: str, launched: list[int], members: list[int]) -> list[int]:
    """Group ranks of the agents none of whose workers is among `members` (every worker is known)."""
    agents: dict[int, list[int]] = {}
    per_agent = os.environ.get("LOCAL_WORLD_SIZE", "")
    for member in launched:
        key = f"{prefix}/agent/{member}"
        raw = store.get(key).decode() if store.check([key]) else ""
        if not raw.isdigit() and per_agent.isdigit() and int(per_agent) > 0:
            # Lost before it recorded its agent: torchrun numbers workers agent by agent, each with
            # LOCAL_WORLD_SIZE of them where every node runs as many (this worker's count).
            raw = str(member // int(per_agent))
        if not raw.isdigit():
            log.debug("commsched.elastic: the agent of rank %d is not known; no exit-barrier arrival", member)
            return []
        agents.setdefault(int(raw), []).append(member)
    return sorted(agent for agent, workers in agents.items() if not set(workers) & set(members))


def _agents_store(endpoint: str, run_id: str) -> Any | None:
    """The agents' store: the round of the rendezvous at `endpoint` that named this MASTER_PORT."""
    import torch.distributed as dist

    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", str(_DEFAULT_PORT))
    if not port.isdigit() or int(port) == 0:
        return None
    client = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=_STORE_TIMEOUT)
    found = None
    for number in range(_ROUNDS):
        key = f"torch.rendezvous.{run_id}.{number}/MASTER_PORT"
        if client.check([key]) and client.get(key).decode() == os.environ.get("MASTER_PORT"):
            found = number
    return None if found is None else dist.PrefixStore(f"torch.rendezvous.{run_id}.{found}", client)


def arrive_for_gone(
    store: Any, prefix: str, launched: list[int], members: list[int], endpoint: str
) -> list[int]:
    """Arrives in torch's exit barrier once for each agent whose workers are all lost; returns
    their group ranks. `store`/`prefix`: the workers' store and the job's keys in it."""
    layout = _layout()
    world = os.environ.get("GROUP_WORLD_SIZE", "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if layout is None or not world.isdigit() or not run_id or not endpoint:
        log.debug("commsched.elastic: torch's exit barrier is not the one known here; no arrival")
        return []
    try:
        gone = gone_agents(store, prefix, launched, members)
        if not gone:
            return []
        agents = _agents_store(endpoint, run_id)
        if agents is None:
            log.debug("commsched.elastic: no rendezvous round at %s names this job; no arrival", endpoint)
            return []
        arrived = []
        for agent in gone:
            # The first to count an agent arrives for it: a later generation's rank 0 finds it gone too.
            if store.add(f"{prefix}/exited/{agent}", 1) != 1:
                continue
            if agents.add(layout[0], 1) == int(world):
                agents.set(layout[1], "<val_ignored>")
            arrived.append(agent)
    except (RuntimeError, OSError, ValueError) as error:
        log.debug("commsched.elastic: no exit-barrier arrival (%s)", error)
        return []
    return arrived


def arrive_later(address: str, prefix: str, launched: list[int], members: list[int], endpoint: str) -> None:
    """Runs arrive_for_gone on a thread with its own client of the workers' store at `address`:
    the re-forming does not wait for its connections, and the interpreter waits for it at exit."""
    if not (
        os.environ.get("GROUP_WORLD_SIZE", "").isdigit()
        and os.environ.get("TORCHELASTIC_RUN_ID")
        and endpoint
    ):
        log.debug(
            "commsched.elastic: not under torchrun's agents (no GROUP_WORLD_SIZE or endpoint); no arrival"
        )
        return

    def arrive() -> None:
        import torch.distributed as dist

        host, _, port = address.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=_STORE_TIMEOUT)
        except (RuntimeError, ValueError) as error:
            log.debug("commsched.elastic: no exit-barrier arrival (%s)", error)
            return
        arrive_for_gone(store, prefix, launched, members, endpoint)

    threading.Thread(target=arrive, name="commsched-exit-barrier").start()
