"""Tests for the shaped-network rig in benchmarks/netrig.py.

The rig tests build real namespaces, so they need root and iproute2; the timing
assertion is deliberately loose (0.6x to 3x of the rate's prediction) because it
only has to prove that the bytes crossed the shaped link rather than shared memory.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

NETRIG_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "netrig.py"


def _load_netrig() -> ModuleType:
    """Import benchmarks/netrig.py, which is a script folder, not a package."""
    spec = importlib.util.spec_from_file_location("netrig", NETRIG_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netrig"] = module
    spec.loader.exec_module(module)
    return module


netrig = _load_netrig()
sys.path.insert(0, str(NETRIG_PATH.parent))
import netrig_check  # benchmarks/ is a script folder: importable once on the path above

_OK, _WHY = netrig.available()
needs_rig = pytest.mark.skipif(not _OK, reason=f"shaped-network rig unavailable: {_WHY}")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _rig_namespaces(pid: int) -> list[str]:
    return [ns for ns in netrig.list_namespaces() if ns.startswith(f"{netrig.DEFAULT_PREFIX}{pid}")]


def test_parse_rate_units() -> None:
    assert netrig.parse_rate("4gbit") == 4e9
    assert netrig.parse_rate("200mbit") == 200e6
    assert netrig.parse_rate("1mbps") == 8e6  # tc's bps means bytes per second
    assert netrig.parse_rate("1000") == 1000.0
    with pytest.raises(ValueError, match="bad rate"):
        netrig.parse_rate("fast")


def test_parse_size_and_expected_time() -> None:
    assert netrig.parse_size("64MiB") == 64 * 2**20
    assert netrig.parse_size("512KB") == 512_000
    expected = netrig.expected_allreduce_seconds(64 * 2**20, 2, 1e9)
    assert expected == pytest.approx(64 * 2**20 * 8 / 1e9)
    assert netrig.expected_allreduce_seconds(100, 4, 8.0) == pytest.approx(150.0)


def test_names_fit_interface_limit() -> None:
    rig = netrig.NetRig(n_ranks=4, handle_signals=False)
    names = [rig.interface(i) for i in range(4)] + [rig.hub_port(i) for i in range(4)] + [rig.bridge]
    assert all(len(n) <= 15 for n in names)
    assert len(set(rig.namespaces + [rig.hub])) == 5
    assert rig.addresses == ["10.77.0.1", "10.77.0.2", "10.77.0.3", "10.77.0.4"]
    other = netrig.NetRig(n_ranks=2, handle_signals=False)
    assert other.prefix != rig.prefix
    with pytest.raises(ValueError):
        netrig.NetRig(n_ranks=5)


def test_launch_argv_shapes() -> None:
    rig = netrig.NetRig(n_ranks=2, handle_signals=False)
    cmd = rig.command_for(1, ["python", "x.py"], {"A": "1"})
    assert cmd == ["ip", "netns", "exec", rig.namespaces[1], "env", "A=1", "python", "x.py"]
    mpi = rig.mpiexec_argv([["python", "a.py"], ["python", "b.py"]], mpiexec="mpiexec")
    assert mpi.count(":") == 1 and mpi[:3] == ["mpiexec", "-n", "1"]
    assert f"FI_TCP_IFACE={rig.interface(1)}" in mpi and "MPIR_CVAR_NOLOCAL=1" in mpi
    # The ring the simulator models, unless asked for MPICH's own choice.
    assert "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_ring" in mpi
    auto = netrig.NetRig(n_ranks=2, handle_signals=False, mpi_allreduce="auto")
    assert not any("ALLREDUCE" in word for word in auto.mpiexec_argv(["python"], mpiexec="mpiexec"))
    with pytest.raises(ValueError, match="mpi_allreduce"):
        netrig.NetRig(n_ranks=2, mpi_allreduce="tree")
    env = rig.torch_env(1, 29555)
    assert env["MASTER_ADDR"] == "10.77.0.1" and env["GLOO_SOCKET_IFNAME"] == rig.interface(1)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29555"


def _assert_rate_bound(result: object, nbytes: int, repeats: int) -> None:
    # Every timed allreduce must have pushed its bytes out of rank 0's veth.
    assert result.link_tx_bytes >= 0.9 * repeats * nbytes  # type: ignore[attr-defined]
    assert 0.6 < result.ratio < 3.0, result.summary()  # type: ignore[attr-defined]


@needs_rig
@pytest.mark.skipif(not _has("mpi4py"), reason="mpi4py is not installed")
def test_mpi_allreduce_crosses_shaped_link() -> None:
    nbytes, repeats = 4 * 2**20, 3
    with netrig.NetRig(n_ranks=2, rate="200mbit") as rig:
        namespaces = [*rig.namespaces, rig.hub]
        assert set(namespaces) <= set(netrig.list_namespaces())
        result = netrig_check.run_check(rig, nbytes, backend="mpi", repeats=repeats, timeout_s=60)
    _assert_rate_bound(result, nbytes, repeats)
    assert not set(namespaces) & set(netrig.list_namespaces())


@needs_rig
@pytest.mark.skipif(not _has("torch"), reason="torch is not installed")
def test_gloo_allreduce_crosses_shaped_link() -> None:
    nbytes, repeats = 4 * 2**20, 2
    with netrig.NetRig(n_ranks=2, rate="200mbit") as rig:
        result = netrig_check.run_check(rig, nbytes, backend="gloo", repeats=repeats, timeout_s=60)
    _assert_rate_bound(result, nbytes, repeats)


@needs_rig
def test_links_receive_each_flow_on_one_cpu() -> None:
    every_cpu = (1 << (os.cpu_count() or 1)) - 1
    with netrig.NetRig(n_ranks=2, rate="1gbit") as rig:
        ends = [(ns, rig.interface(i)) for i, ns in enumerate(rig.namespaces)]
        ends += [(rig.hub, rig.hub_port(i)) for i in range(2)]
        for namespace, dev in ends:
            setting = f"/sys/class/net/{dev}/queues/rx-0/rps_cpus"
            shown = subprocess.run(
                ["ip", "netns", "exec", namespace, "cat", setting], capture_output=True, text=True, check=True
            ).stdout
            assert int(shown.strip().replace(",", ""), 16) == every_cpu, (namespace, dev, shown)


@needs_rig
def test_priority_queue_puts_pfifo_fast_under_every_tbf() -> None:
    """--queue priority: each shaped link, both directions, queues in pfifo_fast under its tbf; fifo has none."""
    with pytest.raises(ValueError, match="queue"):
        netrig.NetRig(n_ranks=2, queue="lifo")
    for queue in netrig.QUEUES:
        with netrig.NetRig(n_ranks=2, rate="1gbit", queue=queue) as rig:
            ends = [(ns, rig.interface(i)) for i, ns in enumerate(rig.namespaces)]
            ends += [(rig.hub, rig.hub_port(i)) for i in range(2)]
            for namespace, dev in ends:
                shown = subprocess.run(
                    ["tc", "-n", namespace, "qdisc", "show", "dev", dev],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                assert "qdisc tbf 1: root" in shown, shown
                assert ("qdisc pfifo_fast 10: parent 1:1" in shown) == (queue == "priority"), (queue, shown)


@needs_rig
def test_cleanup_on_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), netrig.NetRig(n_ranks=3, rate="1gbit") as rig:
        namespaces = [*rig.namespaces, rig.hub]
        raise RuntimeError("boom")
    assert not set(namespaces) & set(netrig.list_namespaces())


@needs_rig
@pytest.mark.skipif(not _has("mpi4py"), reason="mpi4py is not installed")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_cleans_up_when_interrupted(sig: signal.Signals) -> None:
    sleeper = "from mpi4py import MPI; import time; print('up', flush=True); time.sleep(60)"
    # SIGINT back to its default before the rig starts: a test run started in the background
    # (`cmd &` in a script) ignores it, children inherit that, and the rig rightly keeps an
    # ignored signal ignored.
    default_sigint = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", default_sigint, sys.executable, str(NETRIG_PATH), "--ranks", "2", "--"]
        + [sys.executable, "-c", sleeper],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # SIGINT must reach only the rig
    )
    try:
        assert proc.stdout is not None
        assert "up" in proc.stdout.readline()  # both ranks print it; mpiexec may glue the lines
        assert len(_rig_namespaces(proc.pid)) == 3
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)  # teardown allows 3 s per signal; a loaded host needs slack
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            netrig.cleanup_stale(f"{netrig.DEFAULT_PREFIX}{proc.pid}")
    assert proc.returncode != 0
    assert _rig_namespaces(proc.pid) == []


@needs_rig
def test_cleanup_stale_removes_orphans() -> None:
    # A namespace named like a rig's but owned by a pid that cannot exist.
    orphan = f"{netrig.DEFAULT_PREFIX}9999999zn0"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        removed = netrig.cleanup_stale(f"{netrig.DEFAULT_PREFIX}9999999")
        assert removed == [orphan]
        assert orphan not in netrig.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", orphan], check=False, capture_output=True)


@needs_rig
@pytest.mark.skipif(not _has("mpi4py"), reason="needs mpi4py")
def test_reconfigure_switches_over_a_shaped_link_never_hang() -> None:
    """A run of reconfigure() switches mid-training over the rig: it hung once credit was local."""
    script = Path(__file__).resolve().parent / "ranks" / "reconfigure_grid.py"
    env = dict(os.environ, COMMSCHED_STALL_TIMEOUT="5", COMMSCHED_STALL_SHUTDOWN="20")
    argv = [sys.executable, str(NETRIG_PATH), "--ranks", "2", "--rate", "1gbit", "--"]
    argv += [sys.executable, "-m", "mpi4py", str(script), "9"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0 and "PASS" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
