"""Horovod's `horovod.run(func, ...)`: run a Python function on N ranks of this host, get its results.

`commsched.run(train, args=(x,), num_proc=4)` pickles the function and its arguments (with
cloudpickle: a function of the caller's own code travels by value, so a notebook's or a test
module's function needs no import on the ranks), starts the ranks with commsched-run (mpiexec with
`use_mpi=True`), runs `func(*args, **kwargs)` on each and returns the results in rank order. With
`min_num_proc`, `max_num_proc` or `host_discovery_script` the job is elastic, as under
`commsched-run --min-np/--max-np`, and the first `min_num_proc` results are returned, as Horovod
does. A rank that raises fails the call with a RuntimeError naming the rank and its exception.

Every rank runs on this host: `hosts` and `hostfile` may name only this machine (localhost,
127.0.0.1, its hostname), so ssh and network-interface options have nothing to act on.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# A surrounding job's launcher variables (this process may itself be a rank) would tell the new
# ranks the wrong rank and size, and its job token would let them talk to the old job.
_SURROUNDING_JOB = (
    "PMI_",
    "PMIX_",
    "OMPI_",
    "HYDRA_",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_",
    "HOROVOD_CROSS_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "COMMSCHED_JOB_TOKEN",
    "COMMSCHED_ELASTIC_ADDRESS",
    "COMMSCHED_ELASTIC_ID",
    "COMMSCHED_ELASTIC_GENERATION",
    "COMMSCHED_ELASTIC_NOTICES",
    "COMMSCHED_ELASTIC_MIN_NP",
    "COMMSCHED_ELASTIC_TIMEOUT",
)


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: Any = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: int | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    network_interfaces: Any = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Runs `func(*args, **kwargs)` on `num_proc` ranks of this host and returns every rank's result, in rank order."""
    num_proc = _renamed(num_proc, np, "num_proc", "np", default=1)
    min_num_proc = _renamed(min_num_proc, min_np, "min_num_proc", "min_np")
    max_num_proc = _renamed(max_num_proc, max_np, "max_num_proc", "max_np")
    if not callable(func):
        raise TypeError(f"run() needs a function to run on every rank, not {func!r}")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc must be a number of ranks, 1 or more, not {num_proc!r}")
    for name, value in (("reset_limit", reset_limit), ("cooldown_range", cooldown_range)):
        if value is not None:
            raise NotImplementedError(
                f"run({name}=...) is not supported: commsched's elastic launcher re-forms after every failure "
                f"while --min-np ranks are left; leave {name} out"
            )
    if use_gloo and use_mpi:
        raise ValueError("run() takes use_gloo=True or use_mpi=True, not both")
    elastic = min_num_proc is not None or max_num_proc is not None or host_discovery_script is not None
    if use_mpi and elastic:
        raise ValueError(
            "an elastic run (min_num_proc, max_num_proc, host_discovery_script) needs use_mpi=False"
        )
    _check_hosts(_host_slots(hosts, hostfile, slots), num_proc)
    with tempfile.TemporaryDirectory(prefix="commsched-run-") as folder:
        payload, results = Path(folder) / "payload.pkl", Path(folder) / "results"
        results.mkdir()
        payload.write_bytes(_pickled((func, tuple(args), dict(kwargs or {}))))
        worker = ["-m", "commsched.run_function", str(payload), str(results), output_filename or ""]
        python = executable or sys.executable
        if use_mpi:
            launcher = shutil.which(
                "mpiexec", path=os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
            )
            if launcher is None:
                raise RuntimeError("run(use_mpi=True) needs mpiexec on PATH (pip install mpich mpi4py)")
            command = [launcher, "-n", str(num_proc), *(mpi_args or "").split(), python, *worker]
        else:
            command = [python, "-m", "commsched.run", "-n", str(num_proc)]
            if elastic:
                command += ["--min-np", str(min_num_proc or 1), "--max-np", str(max_num_proc or num_proc)]
            if host_discovery_script is not None:
                command += ["--host-discovery-script", host_discovery_script]
            command += ["-m", *worker[1:]]
        if verbose:
            print(f"commsched.run: {' '.join(command)}", flush=True)
        environment = {k: v for k, v in os.environ.items() if not k.startswith(_SURROUNDING_JOB)}
        environment["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        status = subprocess.run(command, env=environment, check=False).returncode
        return _collect(results, status, min_num_proc if elastic else None)


def _renamed(value: Any, old: Any, name: str, old_name: str, default: Any = None) -> Any:
    if old is not None:
        warnings.warn(
            f"run({old_name}=...) is deprecated (as in Horovod); use {name}=", DeprecationWarning, 3
        )
        if value is not None and value != old:
            raise ValueError(f"run() got {name}={value} and {old_name}={old}; give only {name}")
        return old
    return default if value is None else value


def _host_slots(hosts: str | None, hostfile: str | None, slots: int | None) -> dict[str, int] | None:
    """Horovod's `host:slots,...` (or a hostfile of `host slots=N` lines) as {host: slots}; None: not given."""
    if hosts is not None and hostfile is not None:
        raise ValueError("run() takes hosts= or hostfile=, not both")
    entries: list[tuple[str, str | None]] = []
    if hosts is not None:
        for item in filter(None, (part.strip() for part in hosts.split(","))):
            host, _, count = item.partition(":")
            entries.append((host, count or None))
    elif hostfile is not None:
        for line in Path(hostfile).read_text().splitlines():
            words = line.split("#", 1)[0].split()
            if words:
                count = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), None)
                entries.append((words[0], count))
    else:
        return None
    found: dict[str, int] = {}
    for host, count in entries:
        try:
            number = int(count) if count is not None else (slots or 1)
        except ValueError:
            raise ValueError(f"run(): {host}:{count} is not host:slots with a number of slots") from None
        found[host] = found.get(host, 0) + number
    return found


def _check_hosts(found: dict[str, int] | None, num_proc: int) -> None:
    if found is None:
        return
    from commsched.elastic import discovery

    remote = [host for host in found if not discovery.is_local(host)]
    if remote:
        raise ValueError(
            f"run() starts every rank on this host; {', '.join(remote)} is another machine (commsched has no ssh "
            "launching): list localhost or 127.0.0.1 with its slots, or start each host's ranks with its own launcher"
        )
    if sum(found.values()) < num_proc:
        raise ValueError(f"run(): the hosts give {sum(found.values())} slots, fewer than num_proc={num_proc}")


def _pickled(value: Any) -> bytes:
    """`value` pickled so the ranks need not import the caller's own code (cloudpickle, by value)."""
    try:
        import cloudpickle
    except ImportError:  # by reference: the caller's module must be importable on the ranks
        return pickle.dumps(value)
    func = value[0]
    module = sys.modules.get(getattr(func, "__module__", "") or "")
    if module is not None and _own_code(module):
        cloudpickle.register_pickle_by_value(module)
        try:
            return bytes(cloudpickle.dumps(value))
        finally:
            cloudpickle.unregister_pickle_by_value(module)
    return bytes(cloudpickle.dumps(value))


def _own_code(module: Any) -> bool:
    """True for the caller's own module: not commsched, not installed, not the standard library."""
    path = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or path is None or module.__name__.split(".")[0] == "commsched":
        return False
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return not any(os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep) for folder in installed)


def _collect(results: Path, status: int, first: int | None) -> list[Any]:
    """Every rank's result in rank order; a RuntimeError naming the ranks that raised or gave none."""
    answers: dict[int, tuple[bool, Any]] = {}
    for file in results.glob("rank.*.pkl"):
        answers[int(file.name.split(".")[1])] = pickle.loads(file.read_bytes())
    raised = {rank: detail for rank, (ok, detail) in sorted(answers.items()) if not ok}
    if raised:
        described = "; ".join(f"rank {rank}: {detail}" for rank, detail in raised.items())
        raise RuntimeError(f"commsched.run(): the function raised on {len(raised)} rank(s): {described}")
    if status != 0:
        raise RuntimeError(
            f"commsched.run(): the job ended with exit status {status} (results from ranks {sorted(answers)}); "
            "its output above names the rank that failed"
        )
    values = [answers[rank][1] for rank in sorted(answers)]
    return values[:first] if first is not None else values


def _worker(payload: str, results: str, output_folder: str) -> int:
    """One rank: runs the function and leaves (True, result) or (False, its error) in `results`."""
    from commsched._horovod_util import get_env_rank_and_size

    rank, _ = get_env_rank_and_size()
    if output_folder:
        _redirect_output(Path(output_folder) / f"rank.{rank}")
    func, args, kwargs = pickle.loads(Path(payload).read_bytes())
    try:
        answer: tuple[bool, Any] = (True, func(*args, **kwargs))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller of run()
        traceback.print_exc()
        answer = (False, f"{type(error).__name__}: {error}")
    try:
        pickled = pickle.dumps(answer)
    except Exception as error:  # noqa: BLE001 - the caller hears why there is no result
        answer = (False, f"the result could not be pickled to go back to run()'s caller: {error}")
        pickled = pickle.dumps(answer)
    partial = Path(results) / f".rank.{rank}.pkl"
    partial.write_bytes(pickled)
    partial.replace(Path(results) / f"rank.{rank}.pkl")
    return 0 if answer[0] else 1


def _redirect_output(folder: Path) -> None:
    """Sends this rank's stdout and stderr to folder/stdout and folder/stderr, as Horovod's output_filename."""
    folder.mkdir(parents=True, exist_ok=True)
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        stream.flush()
        with open(folder / name, "ab") as target:
            os.dup2(target.fileno(), stream.fileno())


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
