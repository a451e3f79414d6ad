"""The Horovod-style examples (examples/pytorch_*.py, examples/keras_mnist.py) run unchanged but for their
import, on 2 ranks under mpiexec and under torchrun or commsched-run, a few iterations each.

The digits examples must learn: the test accuracy they print (averaged over ranks with
hvd.allreduce) is well above chance (10%).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch, mpiexec

from commsched.run import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BENCHMARK = [
    "--num-iters",
    "2",
    "--num-batches-per-iter",
    "1",
    "--num-warmup-batches",
    "1",
    "--batch-size",
    "4",
]


def _have_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec() is not None


def _run(launcher: str, script: str, *args: str) -> str:
    """Runs examples/<script> on 2 ranks with `launcher`; returns its output, asserting success."""
    program = str(EXAMPLES / script)
    if launcher == "mpiexec":
        if not _have_mpi():
            pytest.skip("needs mpiexec and mpi4py")
        argv = [mpiexec() or "mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", program, *args]
    elif launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), program, *args]
    else:
        argv = local_launch(2, program, *args)
    env = clean_rank_env(ROOT)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run(
        argv, check=False, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


@pytest.mark.parametrize("launcher", ["mpiexec", "commsched-run"])
def test_pytorch_synthetic_benchmark(launcher: str) -> None:
    """Both models; the totals line names both ranks."""
    pytest.importorskip("torch")
    output = _run(launcher, "pytorch_synthetic_benchmark.py", *BENCHMARK, "--image-size", "32")
    assert re.search(r"Total img/sec on 2 CPU\(s\): \d", output), output[-3000:]
    output = _run(
        launcher, "pytorch_synthetic_benchmark.py", *BENCHMARK, "--model", "mlp", "--fp16-allreduce"
    )
    assert re.search(r"Total img/sec on 2 CPU\(s\): \d", output), output[-3000:]


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_pytorch_mnist(launcher: str) -> None:
    """Two epochs on the digits learn well above chance."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _run(launcher, "pytorch_mnist.py", "--epochs", "2")
    accuracies = [
        float(a) for a in re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", output)
    ]
    assert len(accuracies) == 2 and accuracies[-1] > 30.0, output[-3000:]


@pytest.mark.parametrize("launcher", ["mpiexec", "commsched-run"])
def test_keras_mnist(launcher: str) -> None:
    """Three epochs with the broadcast, metric-average and warmup callbacks learn well above chance."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    output = _run(launcher, "keras_mnist.py", "--epochs", "3")
    assert "finished gradual learning rate warmup" in output, output[-3000:]
    accuracy = re.findall(r"Test accuracy: ([\d.]+)", output)
    assert accuracy and float(accuracy[-1]) > 0.3, output[-3000:]
