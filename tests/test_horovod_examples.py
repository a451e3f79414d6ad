"""The Horovod-style examples (examples/pytorch_*.py, examples/keras_mnist.py) run unchanged but for their
import, on 2 ranks, a few iterations each. Each run goes under one launcher, and together they cover
mpiexec, torchrun and commsched-run: a launcher's own paths are tested in the files on that launcher.

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


@pytest.mark.parametrize(
    ("launcher", "model"),
    [("mpiexec", ["--image-size", "32"]), ("commsched-run", ["--model", "mlp", "--fp16-allreduce"])],
)
def test_pytorch_synthetic_benchmark(launcher: str, model: list[str]) -> None:
    """The default ResNet under mpiexec, the MLP with fp16 compression under commsched-run; the
    totals line names both ranks."""
    pytest.importorskip("torch")
    output = _run(launcher, "pytorch_synthetic_benchmark.py", *BENCHMARK, *model)
    assert re.search(r"Total img/sec on 2 CPU\(s\): \d", output), output[-3000:]


def test_pytorch_mnist() -> None:
    """Two epochs on the digits under torchrun learn well above chance."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _run("torchrun", "pytorch_mnist.py", "--epochs", "2")
    accuracies = [
        float(a) for a in re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", output)
    ]
    assert len(accuracies) == 2 and accuracies[-1] > 30.0, output[-3000:]


def test_keras_mnist() -> None:
    """Three epochs under mpiexec with the broadcast, metric-average and warmup callbacks learn well
    above chance."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    output = _run("mpiexec", "keras_mnist.py", "--epochs", "3")
    assert "finished gradual learning rate warmup" in output, output[-3000:]
    accuracy = re.findall(r"Test accuracy: ([\d.]+)", output)
    assert accuracy and float(accuracy[-1]) > 0.3, output[-3000:]
