"""Runs a Horovod test file (e.g. Horovod's test/parallel/test_torch.py) against commsched, on N ranks.

    python scripts/horovod_suite.py --ranks 2 /path/to/horovod/test/parallel/test_torch.py [-- -k allreduce]

The only thing between the test file and commsched is a table of module renames (RENAMES):
`import horovod.torch as hvd` imports commsched.torch, and so on. Nothing is patched and no Horovod
code is involved. Each rank runs pytest on the whole file (Horovod's tests are collective: every
rank runs every test in the same order) and writes a JUnit report; the launcher then counts each
test once: failed if it failed on any rank, skipped if skipped on every rank, else passed.

`--launcher torchrun` starts the ranks with torchrun (the Gloo transport) instead of mpiexec.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Horovod module -> the commsched module that plays its role. Packages in between that commsched
# does not have (horovod.runner, horovod.runner.util) become empty namespaces holding the renamed ones.
RENAMES = {
    "horovod": "commsched",
    "horovod.torch": "commsched.torch",
    "horovod.torch.mpi_ops": "commsched.torch.collectives",
    "horovod.torch.compression": "commsched.torch.compression",
    "horovod.torch.functions": "commsched.torch.functions",
    "horovod.torch.optimizer": "commsched.torch.optimizer",
    "horovod.torch.sync_batch_norm": "commsched.torch.sync_batch_norm",
    "horovod.common.basics": "commsched._horovod",
    "horovod.common.process_sets": "commsched._horovod",
    "horovod.runner.util.threads": "commsched.threads",
    "horovod.tensorflow": "commsched.tensorflow",
}
# Test dependencies with a standard-library twin of the same API.
TWINS = {"mock": "unittest.mock"}


class _RenameFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `horovod...` modules as their commsched counterparts; refuses the rest by name."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        """A spec for a renamed module or a namespace on the way to one; None for anything else."""
        if fullname in RENAMES or any(name.startswith(fullname + ".") for name in RENAMES):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname.split(".")[0] == "horovod":
            raise ImportError(
                f"{fullname} has no commsched counterpart in scripts/horovod_suite.py RENAMES; "
                "add the rename if commsched has a module that plays its role"
            )
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """The commsched module itself (so attributes and identity match), or an empty namespace."""
        target = RENAMES.get(spec.name)
        if target is not None:
            return importlib.import_module(target)
        namespace = types.ModuleType(spec.name, f"namespace for renamed {spec.name}.* modules")
        namespace.__path__ = []
        return namespace

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module was imported under its commsched name."""


def install_renames() -> None:
    """Makes `import horovod.<x>` import the commsched module of RENAMES, in this process."""
    for name, twin in TWINS.items():
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = importlib.import_module(twin)
    sys.meta_path.insert(0, _RenameFinder())


def _rank_from_env() -> int:
    for variable in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK"):
        if os.environ.get(variable):
            return int(os.environ[variable])
    return 0


class _Recorder:
    """A pytest plugin that appends each test's outcome to this rank's log as it happens.

    A rank that hangs or is stopped still leaves what it finished; the log is one line per test:
    "<outcome> <test id>", and a "running <test id>" line before each test starts.
    """

    def __init__(self, log: Path) -> None:
        self._log = log.open("a", buffering=1)
        self._failures = log.with_suffix(".failures")

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        """Records which test is running, so a hang names its test."""
        self._log.write(f"running {nodeid}\n")

    def pytest_runtest_logreport(self, report: object) -> None:
        """Records a test's outcome once its call phase (or a failed setup) reports."""
        when, outcome = report.when, report.outcome  # type: ignore[attr-defined]
        if when == "call" or (when == "setup" and outcome != "passed"):
            self._log.write(f"{outcome} {report.nodeid}\n")  # type: ignore[attr-defined]
        if outcome == "failed":
            with self._failures.open("a") as failures:
                failures.write(f"==== {report.nodeid} ({when})\n{report.longreprtext}\n")  # type: ignore[attr-defined]


def run_rank(test_path: str, report_dir: str, stack_dump_s: float, pytest_args: Sequence[str]) -> int:
    """One rank: renames installed, pytest on the test file, each outcome logged as it happens."""
    install_renames()
    import faulthandler

    import pytest

    rank = _rank_from_env()
    log = Path(report_dir) / f"rank{rank}.log"
    if stack_dump_s > 0:  # a test stuck this long prints every thread's stack (then goes on waiting)
        faulthandler.dump_traceback_later(stack_dump_s, repeat=True)
    args = [test_path, "-p", "no:cacheprovider", "-q", "-rfE", *pytest_args]
    return int(pytest.main(args, plugins=[_Recorder(log)]))


def _launch_argv(launcher: str, ranks: int, inner: list[str]) -> list[str]:
    if launcher == "mpiexec":
        beside = Path(sys.executable).parent / "mpiexec"
        mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"
        return [mpiexec, "-n", str(ranks), sys.executable, *inner]
    from commsched.run import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *inner,
    ]


def outcomes(report_dir: Path) -> tuple[dict[str, list[str]], list[str]]:
    """Test id -> its outcome on each rank; and the tests a rank started but never finished."""
    found: dict[str, list[str]] = {}
    unfinished = []
    for log in sorted(report_dir.glob("rank*.log")):
        running = None
        for line in log.read_text().splitlines():
            outcome, _, test = line.partition(" ")
            if outcome == "running":
                running = test
                continue
            found.setdefault(test, []).append("failed" if outcome == "failed" else outcome)
            running = None
        if running is not None:
            unfinished.append(f"{log.stem}: {running}")
            found.setdefault(running, []).append("failed")
    return found, unfinished


def verdict(per_rank: list[str], ranks: int) -> str:
    """One outcome for a test from every rank's: any failure (or a rank without a report) fails it."""
    if "failed" in per_rank or len(per_rank) < ranks:
        return "failed"
    return "skipped" if all(o == "skipped" for o in per_rank) else "passed"


def _launch(options: argparse.Namespace, inner: list[str], env: dict[str, str]) -> None:
    try:
        subprocess.run(
            _launch_argv(options.launcher, options.ranks, inner),
            check=False,
            env=env,
            timeout=options.timeout,
        )
    except subprocess.TimeoutExpired:
        print(f"horovod_suite: the ranks ran past --timeout={options.timeout:g}s and were stopped")


def _collect(test_path: str, env: dict[str, str], pytest_args: Sequence[str]) -> list[str]:
    """The test ids in the file (collected in one process, renames installed)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import horovod_suite, pytest; "
        "horovod_suite.install_renames(); "
        "sys.exit(pytest.main([sys.argv[2], '--collect-only', '-q', '-p', 'no:cacheprovider', *sys.argv[3:]]))"
    )
    argv = [sys.executable, "-c", code, str(Path(__file__).resolve().parent), test_path, *pytest_args]
    listing = subprocess.run(argv, env=env, capture_output=True, text=True, check=False).stdout
    return [line for line in listing.splitlines() if "::" in line]


def main(argv: Sequence[str] | None = None) -> int:
    """Launches the ranks, waits, prints each test's verdict and the counts; 0 when nothing failed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("test_path", help="a Horovod test file, e.g. horovod/test/parallel/test_torch.py")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="mpiexec")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are stopped")
    parser.add_argument("--report-dir", help="where the ranks' logs go (default: a temporary folder)")
    parser.add_argument(
        "--stack-dump", type=float, default=120, help="seconds a test may run before its stacks are printed"
    )
    parser.add_argument(
        "--per-test", action="store_true", help="one launch per test, so a failure cannot upset the next test"
    )
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest on every rank (after --)")
    options = parser.parse_args(argv)
    if options.rank_mode:
        return run_rank(options.test_path, options.report_dir, options.stack_dump, options.pytest_args)

    test_path = str(Path(options.test_path).resolve())
    if not Path(test_path).is_file():
        parser.error(f"{options.test_path} is not a file; pass the path of a Horovod test file")
    report_dir = Path(options.report_dir or tempfile.mkdtemp(prefix="horovod-suite-"))
    report_dir.mkdir(parents=True, exist_ok=True)
    for old in [*report_dir.glob("rank*.log"), *report_dir.glob("rank*.failures")]:
        old.unlink()
    inner = [str(Path(__file__).resolve()), "--rank-mode", "--report-dir", str(report_dir)]
    inner += ["--stack-dump", str(options.stack_dump)]
    extra = ["--", *options.pytest_args] if options.pytest_args and not options.per_test else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    if options.per_test:
        for test in _collect(test_path, env, options.pytest_args):
            _launch(options, [*inner, f"{test_path}::{test.partition('::')[2]}"], env)
    else:
        _launch(options, [*inner, test_path, *extra], env)

    found, unfinished = outcomes(report_dir)
    for where in unfinished:
        print(f"UNFINISHED {where}")
    verdicts = {test: verdict(per_rank, options.ranks) for test, per_rank in found.items()}
    for test, result in sorted(verdicts.items()):
        if result != "passed":
            print(f"{result.upper():8} {test}  (per rank: {', '.join(found[test])})")
    counts = Counter(verdicts.values())
    print(
        f"horovod_suite: {options.ranks} ranks ({options.launcher}): {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped; reports in {report_dir}"
    )
    return 1 if counts["failed"] or not verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
