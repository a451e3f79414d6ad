"""The native Gloo transport (commsched._gloo): chosen for COMMSCHED_TRANSPORT=gloo where it was built,
exact for every dtype at 2 and 3 ranks, failing with a named error when a peer leaves; and the Python
transport taking over, with the reason logged, where the extension does not import."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "ranks" / "gloo_native.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
NATIVE_BUILT = importlib.util.find_spec("commsched._gloo") is not None
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="commsched._gloo was not built here")


def run(ranks: int, *arguments: str, python_path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Runs the rank program on `ranks` local ranks (torchrun-style variables) and returns the result."""
    env = clean_rank_env(*python_path, ROOT)
    return subprocess.run(
        local_launch(ranks, str(PROGRAM), *arguments),
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_native
@pytest.mark.parametrize("ranks", [2, 3])
def test_native_path_is_used_and_exact_for_every_dtype(ranks: int) -> None:
    """config()['transport'] stays 'gloo', the native seed carried the traffic, and every result matches numpy."""
    done = run(ranks, "--expect", "native")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(ranks):
        assert f"rank {rank}: OK" in output and "over native" in output, output
    assert "COMMSCHED_TRANSPORT=gloo: native transport (commsched._gloo)" in output, output


@needs_native
def test_a_departed_peer_fails_the_collective_with_a_named_error() -> None:
    """A rank that exits mid-job makes the other's next collective raise naming the Gloo op or the control channel."""
    done = run(2, "--peer-exits")
    output = done.stdout + done.stderr
    assert "rank 0: failed as expected" in output, output


def test_python_transport_takes_over_when_the_extension_does_not_import(tmp_path: Path) -> None:
    """With commsched._gloo unimportable, init() runs the Python transport, logs why, and sums exactly."""
    # A sitecustomize on the ranks' path makes `import commsched._gloo` raise ImportError, as on a
    # machine where the extension was not built.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['commsched._gloo'] = None\n")
    done = run(2, "--expect", "python", python_path=(tmp_path,))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count("OK") == 2 and "over python (commsched._gloo did not import" in output, output
    assert "COMMSCHED_TRANSPORT=gloo: Python transport, because commsched._gloo did not import" in output, (
        output
    )


@needs_native
def test_seed_refuses_an_object_that_is_not_a_backend() -> None:
    """Handing the seed something other than a c10d backend names the group and the fix."""
    import torch  # noqa: F401  (loads the libraries commsched._gloo links)

    from commsched import _gloo

    with pytest.raises(ValueError, match="data group's CPU backend .* is not a c10d Backend"):
        _gloo.Seed(object(), object())


@needs_native
def test_seed_accepts_a_gloo_group_and_reports_its_ranks(tmp_path: Path) -> None:
    """One process, one rank: a gloo group's backend becomes a seed of rank 0 of 1 with zeroed counters."""
    script = (
        "import torch, torch.distributed as dist\n"
        "from commsched import _gloo\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "cpu = torch.device('cpu')\n"
        "control = dist.new_group([0], backend='gloo')\n"
        "seed = _gloo.Seed(dist.group.WORLD._get_backend(cpu), control._get_backend(cpu))\n"
        "print(seed.rank, seed.size, sorted(seed.counters().items()))\n"
        "dist.destroy_process_group()\n"
    )
    env = {**clean_rank_env(ROOT), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 1 [('exchanges', 0), ('launches', 0), ('rings', 0)]" in done.stdout, done.stdout + done.stderr


@needs_native
def test_a_module_built_for_another_torch_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """commsched._gloo built against another torch release is refused with the versions and the fix."""
    import torch

    from commsched import _gloo
    from commsched.transports import gloo

    monkeypatch.setattr(_gloo, "built_for_torch", "0.0.0")
    seed, why = gloo._native_seed(gloo.Groups(data=None, control=None, ranks=[0]))
    assert seed is None
    assert f"built for torch 0.0.0, but torch {torch.__version__} is installed; reinstall commsched" in why
