"""Makes the tests' helper modules (mpirun.py, fake_cuda.py) importable; fixtures for the fake NCCL and one
loopback rank."""

import ctypes
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The files that take longest (a minute or more on 2 cores). Under pytest-xdist they go out first, so
# that no worker is left running one of them alone while the others have finished.
LONGEST_FILES = (
    "test_faults.py",
    "test_elastic.py",
    "test_elastic_torchrun.py",
    "test_torch_shard.py",
    "test_checkpoint_ranks.py",
    "test_join.py",
    "test_tf_ranks.py",
    "test_torch_ranks.py",
    "test_process_sets.py",
)


# Cells of a matrix whose path another cell of the default run already takes (the same transport
# under another launcher, the same check at another rank count) carry @pytest.mark.full: they
# run with COMMSCHED_TEST_FULL=1 (mpirun.full_matrix()), so that the default run fits the CI's
# time on 2 cores.
from mpirun import FULL_VARIABLE, full_matrix


def pytest_configure(config: pytest.Config) -> None:
    """Registers the `full` marker."""
    config.addinivalue_line(
        "markers", f"full: a cell another cell covers the path of; runs only with {FULL_VARIABLE}=1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips `full` cells unless asked for; under pytest-xdist, moves the longest files to the front
    (each file keeps its own order)."""
    if not full_matrix():
        skip = pytest.mark.skip(
            reason=f"a cell of the full matrix: {FULL_VARIABLE}=1 scripts/test.sh runs it"
        )
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(skip)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: position for position, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


# COMMSCHED_TEST_CPU_LOG=FILE appends one JSON line per test: its wall time and the CPU time of the
# test's own process and of every process it started and waited for (ranks, launchers, compilers).
# The suite fills its cores, so CPU time, not wall time, says what a test costs the CI's run.
CPU_LOG = os.environ.get("COMMSCHED_TEST_CPU_LOG", "")


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Logs the test's wall and CPU time when COMMSCHED_TEST_CPU_LOG names a file."""
    if not CPU_LOG:
        yield
        return
    start = (time.monotonic(), _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN))
    yield
    row = {
        "test": item.nodeid,
        "wall": time.monotonic() - start[0],
        "cpu_self": _cpu_seconds(resource.RUSAGE_SELF) - start[1],
        "cpu_children": _cpu_seconds(resource.RUSAGE_CHILDREN) - start[2],
    }
    with open(CPU_LOG, "a") as log:
        log.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def fake_nccl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ctypes.CDLL]:
    """The fake libnccl/libcudart of tests/fake_cuda.py, built once; its handle keeps it (and its log) loaded."""
    import fake_cuda

    library = fake_cuda.build(tmp_path_factory.mktemp("fake_nccl"))
    if library is None:
        pytest.skip("needs a C compiler")
    return library, ctypes.CDLL(str(library))


@pytest.fixture
def nccl_env(fake_nccl: tuple[Path, ctypes.CDLL], monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """A single-rank process whose NCCL and CUDA runtime are the fake, with an empty call log."""
    library, handle = fake_nccl
    for name in list(os.environ):
        if name.startswith(("COMMSCHED_", "PMI_", "OMPI_", "PMIX_")) or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("FAKE_NCCL_VERSION", raising=False)
    monkeypatch.setenv("COMMSCHED_NCCL_LIBRARY", str(library))
    monkeypatch.setenv("COMMSCHED_CUDART_LIBRARY", str(library))
    handle.fake_reset()
    handle.fake_set_main_thread()
    return handle


@pytest.fixture
def fake(fake_nccl: tuple[Path, ctypes.CDLL]) -> Iterator[ctypes.CDLL]:
    """The session's fake library with prototypes declared, an empty log and no per-operation delay; later
    tests find this thread back on device 0."""
    import fake_cuda

    handle = fake_cuda.declare(fake_nccl[1])
    handle.fake_reset()
    handle.fake_set_main_thread()
    fake_cuda.set_delay_us(handle, 0)
    yield handle
    fake_cuda.set_delay_us(handle, 0)
    handle.cudaSetDevice(0)


@pytest.fixture
def new_stream(fake: ctypes.CDLL) -> Iterator[Callable[[], int]]:
    """Makes streams with cudaStreamCreateWithFlags and destroys them after the test (other tests expect
    their first stream to be logged as "own")."""
    made: list[int] = []

    def make() -> int:
        stream = ctypes.c_void_p()
        assert fake.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
        made.append(stream.value)
        return stream.value

    yield make
    for stream in made:
        assert fake.cudaStreamDestroy(stream) == 0


@pytest.fixture
def one_rank() -> Iterator[None]:
    """commsched on one rank (the loopback transport) for the test, shut down after it."""
    import commsched

    commsched.init(transport="loopback")
    try:
        yield
    finally:
        commsched.shutdown()


@pytest.fixture
def no_commsched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No commsched running and no COMMSCHED_* variable set before the test (what it uses starts it);
    shut down after it."""
    import commsched

    for name in list(os.environ):
        if name.startswith("COMMSCHED_"):
            monkeypatch.delenv(name)
    if commsched.is_initialized():
        commsched.shutdown()
    try:
        yield
    finally:
        commsched.shutdown()
