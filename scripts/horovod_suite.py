"""Runs a Horovod test file (e.g. Horovod's test/parallel/test_torch.py) against commsched, on N ranks.

    python scripts/horovod_suite.py --ranks 2 /path/to/horovod/test/parallel/test_torch.py [-- -k allreduce]
    python scripts/horovod_suite.py --reference /tmp/hvdref /path/to/test_torch.py   # also real Horovod

The test files this is run on come from github horovod/horovod at commit 2626dc8 (its tip,
`git describe` v0.28.1-25, "Disable scheduled CI run (#4318)"); their test/parallel/test_torch.py
is the file of the v0.28.1 tag. Horovod's helper test/parallel/common.py must sit beside the file.

The only thing between the test file and commsched is a table of module renames (RENAMES):
`import horovod.torch as hvd` imports commsched.torch, and so on. Nothing is patched and no Horovod
code is involved. The test ids are collected first (`pytest --collect-only`, renames installed; a
collection error is reported as such, never as zero tests). Each test then runs in its own launch
of N ranks, so one test's failure or hang cannot upset the next; every rank logs each outcome as it
happens, and the launcher counts each test once: failed if it failed on any rank, if a rank gave no
outcome, or if the launch ran past --timeout (named as a timeout); skipped if skipped on every rank;
else passed.

`--launcher torchrun` starts the ranks with torchrun (the Gloo transport) instead of mpiexec.
`--reference VENV` runs the same tests with VENV's python and real Horovod (no renames; always under
mpiexec, the launcher Horovod's MPI build reads) and prints each test Horovod passes that commsched
does not; the exit status is then 1 exactly when there is such a test.
`--one-launch` runs the whole file in one launch per side instead (quicker, less isolated).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
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
    "horovod.tensorflow.keras": "commsched.tensorflow.keras",
    "horovod.keras": "commsched.tensorflow.keras",
    "horovod.tensorflow.util": "commsched.tensorflow.util",
    "horovod.tensorflow.mpi_ops": "commsched.tensorflow.collectives",
    "horovod.tensorflow.elastic": "commsched.tensorflow.elastic",
    "horovod.tensorflow.keras.elastic": "commsched.tensorflow.keras.elastic",
    "horovod.keras.elastic": "commsched.tensorflow.keras.elastic",
    "horovod.tensorflow.sync_batch_norm": "commsched.tensorflow.sync_batch_norm",
    "horovod.common.util": "commsched._horovod_util",
    "horovod.runner.common.util.env": "commsched._horovod_util",
    "horovod.runner.common.util.secret": "commsched.compute_service",
    "horovod.runner.common.util.timeout": "commsched.compute_service",
    "horovod.runner.common.service.compute_service": "commsched.compute_service",
    "horovod.tensorflow.data": "commsched.tensorflow.data",
    "horovod.tensorflow.data.compute_service": "commsched.tensorflow.data.compute_service",
    "horovod.tensorflow.data.compute_worker": "commsched.tensorflow.data.compute_worker",
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


def run_rank(
    test_path: str, report_dir: str, stack_dump_s: float, pytest_args: Sequence[str], renames: bool = True
) -> int:
    """One rank: renames installed (unless running real Horovod), pytest, each outcome logged as it happens."""
    if renames:
        install_renames()
    _horovodrun_variables()
    import faulthandler

    import pytest

    rank = _rank_from_env()
    log = Path(report_dir) / f"rank{rank}.log"
    if stack_dump_s > 0:  # a test stuck this long prints every thread's stack (then goes on waiting)
        faulthandler.dump_traceback_later(stack_dump_s, repeat=True)
    args = [test_path, "-p", "no:cacheprovider", "-q", "-rfE", *pytest_args]
    return int(pytest.main(args, plugins=[_Recorder(log)]))


def _horovodrun_variables() -> None:
    """Under torchrun, the variables horovodrun's Gloo launcher would set, from torchrun's own.

    Horovod's tests read the launcher's rank from HOROVOD_RANK (Gloo) or PMI_RANK (MPI); torchrun
    sets neither, so the suite plays horovodrun's part with the same numbers torchrun gave.
    """
    pairs = [
        ("HOROVOD_RANK", "RANK"),
        ("HOROVOD_SIZE", "WORLD_SIZE"),
        ("HOROVOD_LOCAL_RANK", "LOCAL_RANK"),
        ("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"),
    ]
    if "RANK" in os.environ and "PMI_RANK" not in os.environ and "HOROVOD_RANK" not in os.environ:
        for horovod, torchrun in pairs:
            if torchrun in os.environ:
                os.environ[horovod] = os.environ[torchrun]


def _launch_argv(launcher: str, ranks: int, python: str, inner: list[str]) -> list[str]:
    if launcher == "mpiexec":
        beside = Path(python).parent / "mpiexec"
        mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"
        return [mpiexec, "-n", str(ranks), python, *inner]
    from commsched.run import free_port

    return [
        python,
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


class CollectionError(RuntimeError):
    """pytest could not collect the test file (an import error, a syntax error, no tests)."""


@dataclass
class Side:
    """One way of running the tests: commsched through the renames, or real Horovod in a venv."""

    label: str
    python: str
    launcher: str
    renames: bool
    env: dict[str, str]


def collect(side: Side, test_path: str, pytest_args: Sequence[str]) -> list[str]:
    """The test ids in the file, collected by `side`'s python; CollectionError with pytest's output if none."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import horovod_suite, pytest; "
        "(horovod_suite.install_renames() if sys.argv[2] == 'renames' else None); "
        "sys.exit(pytest.main([sys.argv[3], '--collect-only', '-q', '-p', 'no:cacheprovider', *sys.argv[4:]]))"
    )
    argv = [side.python, "-c", code, str(Path(__file__).resolve().parent)]
    argv += ["renames" if side.renames else "plain", test_path, *pytest_args]
    listing = subprocess.run(argv, env=side.env, capture_output=True, text=True, check=False, timeout=600)
    tests = [line.strip() for line in listing.stdout.splitlines() if "::" in line and " " not in line.strip()]
    if listing.returncode != 0 or not tests:
        output = (listing.stdout + listing.stderr)[-4000:]
        raise CollectionError(
            f"{side.label}: pytest collected no tests from {test_path} (exit status {listing.returncode}):\n{output}"
        )
    return tests


def _launch(options: argparse.Namespace, side: Side, inner: list[str]) -> bool:
    """Runs one launch of the ranks; False when it ran past --timeout and was stopped."""
    argv = _launch_argv(side.launcher, options.ranks, side.python, inner)
    # Its own process group, so a launch stopped at the timeout takes its ranks with it.
    launch = subprocess.Popen(argv, env=side.env, start_new_session=True)
    try:
        launch.wait(timeout=options.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait()
        return False
    return True


def run_side(
    options: argparse.Namespace, side: Side, test_path: str, tests: list[str], report_dir: Path
) -> dict[str, tuple[str, str]]:
    """Test id -> (verdict, why) for every collected test, run as `side` runs them."""
    inner = [str(Path(__file__).resolve()), "--rank-mode", "--stack-dump", str(options.stack_dump)]
    if not side.renames:
        inner.append("--no-renames")
    results: dict[str, tuple[str, str]] = {}
    launches = (
        [(report_dir, tests)]
        if options.one_launch
        else [(report_dir / f"{i:04d}", [test]) for i, test in enumerate(tests)]
    )
    for where, batch in launches:
        where.mkdir(parents=True, exist_ok=True)
        for old in [*where.glob("rank*.log"), *where.glob("rank*.failures")]:
            old.unlink()
        targets = [test_path] if options.one_launch else [f"{test_path}::{batch[0].partition('::')[2]}"]
        extra = ["--", *options.pytest_args] if options.one_launch and options.pytest_args else []
        finished = _launch(options, side, [*inner, "--report-dir", str(where), *targets, *extra])
        found, unfinished = outcomes(where)
        by_name = {test.partition("::")[2]: per_rank for test, per_rank in found.items()}
        for test in batch:
            per_rank = by_name.get(test.partition("::")[2], [])
            result = verdict(per_rank, options.ranks)
            if not finished and result == "failed":
                why = f"timeout: the launch ran past --timeout={options.timeout:g}s; per rank: {per_rank}"
            elif not per_rank:
                why = "no rank reported an outcome"
            else:
                why = "per rank: " + ", ".join(per_rank)
            results[test] = (result, why)
        for line in unfinished:
            print(f"{side.label}: UNFINISHED {line}")
    return results


def _print_side(
    side: Side, results: dict[str, tuple[str, str]], ranks: int, report_dir: Path
) -> Counter[str]:
    for test, (result, why) in sorted(results.items()):
        if result != "passed":
            print(f"{side.label}: {result.upper():8} {test}  ({why})")
    counts = Counter(result for result, _ in results.values())
    print(
        f"horovod_suite: {side.label}: {ranks} ranks ({side.launcher}): {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped; reports in {report_dir}"
    )
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Collects, launches the ranks per test, prints each test's verdict and the counts; 0 when nothing failed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("test_path", help="a Horovod test file, e.g. horovod/test/parallel/test_torch.py")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="mpiexec")
    parser.add_argument(
        "--timeout", type=float, default=180, help="seconds one launch may run before its ranks are stopped"
    )
    parser.add_argument("--report-dir", help="where the ranks' logs go (default: a temporary folder)")
    parser.add_argument(
        "--stack-dump", type=float, default=120, help="seconds a test may run before its stacks are printed"
    )
    parser.add_argument(
        "--reference", metavar="VENV", help="a venv with real Horovod to run the same tests in"
    )
    parser.add_argument("--one-launch", action="store_true", help="the whole file in one launch per side")
    parser.add_argument("--per-test", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-renames", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest on every rank (after --)")
    options = parser.parse_args(argv)
    if options.rank_mode:
        return run_rank(
            options.test_path,
            options.report_dir,
            options.stack_dump,
            options.pytest_args,
            not options.no_renames,
        )

    test_path = str(Path(options.test_path).resolve())
    if not Path(test_path).is_file():
        parser.error(f"{options.test_path} is not a file; pass the path of a Horovod test file")
    sides = [Side("commsched", sys.executable, options.launcher, True, _environment(REPO))]
    if options.reference:
        python = Path(options.reference) / "bin" / "python"
        if not python.exists():
            parser.error(
                f"--reference {options.reference}: no bin/python there; pass a venv with horovod installed"
            )
        sides.append(Side("horovod", str(python), "mpiexec", False, _environment(None)))
    report_root = Path(options.report_dir or tempfile.mkdtemp(prefix="horovod-suite-"))
    try:
        tests = collect(sides[0], test_path, options.pytest_args)
    except CollectionError as error:
        print(f"horovod_suite: ERROR {error}")
        return 2
    results = {}
    for side in sides:
        where = report_root / side.label if options.reference else report_root
        results[side.label] = run_side(options, side, test_path, tests, where)
    counts = {
        side.label: _print_side(side, results[side.label], options.ranks, report_root) for side in sides
    }
    if not options.reference:
        return 1 if counts["commsched"]["failed"] else 0
    gap = [
        test
        for test, (result, _) in sorted(results["horovod"].items())
        if result == "passed" and results["commsched"][test][0] != "passed"
    ]
    for test in gap:
        print(f"HOROVOD-ONLY {test}  (commsched: {results['commsched'][test][1]})")
    print(f"horovod_suite: {len(gap)} tests pass on Horovod and not on commsched")
    return 1 if gap else 0


def _environment(repo: Path | None) -> dict[str, str]:
    """The ranks' environment: one OpenMP thread each, and the repository first on the path for commsched."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if repo is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH", "")]))
    return env


if __name__ == "__main__":
    sys.exit(main())
