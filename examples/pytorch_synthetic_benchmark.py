"""Synthetic-data image benchmark, written as for Horovod: only the import names commsched.

    mpiexec -n 2 python -m mpi4py examples/pytorch_synthetic_benchmark.py --no-cuda
    torchrun --nproc-per-node 2 examples/pytorch_synthetic_benchmark.py
    commsched-run -n 2 examples/pytorch_synthetic_benchmark.py --num-iters 2

Measures training throughput (images per second) of a small ResNet-style network on random
images; every gradient is averaged across ranks by commsched.
"""

from __future__ import annotations

import argparse
import timeit

import commsched.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark")
parser.add_argument(
    "--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce"
)
parser.add_argument(
    "--model", type=str, default="resnet", choices=["resnet", "mlp"], help="model to benchmark"
)
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images")
parser.add_argument(
    "--num-warmup-batches",
    type=int,
    default=10,
    help="number of warm-up batches that don't count towards benchmark",
)
parser.add_argument(
    "--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration"
)
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument(
    "--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction"
)


class Block(nn.Module):
    """A residual block: two 3x3 convolutions with batch normalisation."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels // stride, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = (
            nn.Conv2d(channels // stride, channels, 1, stride, bias=False) if stride > 1 else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(classes: int = 1000) -> nn.Module:
    """A small ResNet: a stem and three stages of residual blocks."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        Block(16, 1),
        Block(32, 2),
        Block(64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def mlp(classes: int = 1000) -> nn.Module:
    """A multi-layer perceptron on the flattened image."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(512), nn.ReLU(), nn.Linear(512, classes))


def main() -> None:
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.backends.cudnn.benchmark = True

    # Set up standard model.
    model = resnet() if args.model == "resnet" else mlp()
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    model(data[:1])  # materialises lazy layers before the parameters are broadcast

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        data, target = data.cuda(), target.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s: str, nl: bool = True) -> None:
        if hvd.rank() != 0:
            return
        print(s, end="\n" if nl else "", flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    device = "GPU" if args.cuda else "CPU"
    log(f"Number of {device}s: {hvd.size()}")

    # Warm-up
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    # Benchmark
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(
        f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}"
    )


if __name__ == "__main__":
    main()
