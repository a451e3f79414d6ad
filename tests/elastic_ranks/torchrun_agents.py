"""Starts an elastic job as torchrun starts one across nodes, on this host: one single-process agent
per node under one c10d rendezvous (for tests/test_elastic_torchrun.py and
benchmarks/elastic_recovery.py).

The first agent hosts both of torchrun's stores (--rdzv-conf is_host=1, and --local-addr 127.0.0.1
sorts it to group rank 0), so a worker that a run kills is never the one whose agent holds them.
Once the workers said they are done, what is left is ended here, unless the caller waits for every
agent to end by itself (commsched arrives in torch's exit barrier for an agent that left).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# The variables a launcher sets for a rank: a job started from a rank must not pass its own on.
_RANK_VARIABLES = (
    *("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "COMMSCHED_GRPC_PEERS",
)


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def environment(out: Path, **extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, with ELASTIC_OUT=out, Gloo (unless
    `extra` names another COMMSCHED_TRANSPORT) and `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _RANK_VARIABLES and not k.startswith(("TORCHELASTIC_", "COMMSCHED_ELASTIC_"))
    }
    env.update({"ELASTIC_OUT": str(out), "COMMSCHED_TRANSPORT": "gloo", **extra})
    return env


def run_agents(
    out: Path,
    script: Path,
    nodes: int,
    min_nodes: int,
    finishers: int,
    timeout_s: float,
    wait_agents: bool = False,
    join_when: str = "",
    **extra: str,
) -> str:
    """`nodes` agents (`--nnodes min_nodes:nodes`, one worker each) running `script`; returns their
    output once `finishers` workers printed `... done` (with `wait_agents`: once every agent ended,
    then followed by `--- agents ended at T` (time.time()) and each agent's exit status) or every
    agent ended, or at the timeout. With `join_when`, one more agent (the maximum is nodes + 1)
    starts once a file of that name appears in `out`, to join the running job; its address sorts
    before the others', so torchrun makes its worker rank 0."""
    out.mkdir(parents=True, exist_ok=True)
    endpoint = f"127.0.0.1:{free_port()}"
    env = environment(out, **extra)
    agents: list[subprocess.Popen[bytes]] = []
    ended = ""
    most = nodes + (1 if join_when else 0)
    logs = [out / f"agent.{node}.log" for node in range(most)]

    def address(node: int) -> str:
        # A joining agent sorts first: it becomes group rank 0, and the workers that kept the commit
        # are renumbered ahead of it.
        if not join_when:
            return f"127.0.0.{node + 1}"
        return "127.0.0.1" if node == nodes else f"127.0.0.{node + 2}"

    # A job that starts below its maximum closes its first round 1 s after the minimum arrived, not
    # after torch's 30 s of last call. A job that starts at its maximum closes it as the last agent
    # arrives, so it keeps the 30 s: on a loaded host an agent can start more than 1 s after the
    # others, and a round closed without it would make it a joining node.
    last_call_s = 1 if nodes < most else 30

    def start(node: int) -> None:
        command = [
            *(sys.executable, "-m", "torch.distributed.run"),
            *("--nnodes", f"{min_nodes}:{most}", "--nproc-per-node", "1", "--max-restarts", "0"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", out.name),
            *("--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout={last_call_s}"),
            *("--local-addr", address(node)),
            *("--monitor-interval", "0.1", str(script)),
        ]
        with open(logs[node], "wb") as handle:
            agents.append(
                subprocess.Popen(
                    command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    try:
        for node in range(nodes):
            start(node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(agents) < most and (out / join_when).exists():
                start(len(agents))
            text = "".join(log.read_text(errors="replace") for log in logs[: len(agents)])
            if all(agent.poll() is not None for agent in agents):
                ended = f"--- agents ended at {time.time():.6f}\n" + "".join(
                    f"--- agent {node} exit {agent.returncode}\n" for node, agent in enumerate(agents)
                )
                break
            if text.count(" done\n") >= finishers and not wait_agents:
                break
            time.sleep(0.1)
    finally:
        _stop(agents, out, script)
    output = "".join(
        f"--- agent {node}\n" + log.read_text(errors="replace")
        for node, log in enumerate(logs[: len(agents)])
    )
    return output + (ended if wait_agents else "")


def _stop(agents: list[subprocess.Popen[bytes]], out: Path, script: Path) -> None:
    """Ends what is left: agents (their sessions) and workers (by the pid each wrote to out/pid.ID)."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    for pid_file in out.glob("pid.*"):
        try:
            pid = int(pid_file.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                ours = script.name.encode() in handle.read()  # not a later process given its pid
            if ours:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
