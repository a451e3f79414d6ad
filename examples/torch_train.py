"""Train a small CNN on scikit-learn's digits with commsched's PyTorch plug-in.

    mpiexec -n 2 python -m mpi4py examples/torch_train.py --device cpu    # MPI transport
    torchrun --nproc-per-node 2 examples/torch_train.py         # one GPU per rank: NCCL
    python examples/torch_train.py --overlap-forward            # one process works too

Each rank trains on its shard of every global batch; the averaged gradients make all
ranks take the same step, so the printed loss and accuracy match a one-process run.
With --device cuda (the default when PyTorch sees a GPU) each rank uses the GPU of its
local rank and its gradients go through commsched's NCCL transport; with --device cpu
over MPI (mpiexec) or Gloo (torchrun).
"""

from __future__ import annotations

import argparse
import time

import commsched.torch as ct
import torch
import torch.nn.functional as F

import commsched


class DigitsNet(torch.nn.Module):
    """Two 3x3 convolutions and two fully connected layers for 8x8 grey images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = torch.nn.Linear(64 * 4 * 4, 256)
        self.fc2 = torch.nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (ships with the package), scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "the digits data set comes with scikit-learn: pip install scikit-learn, or pass --data synthetic"
        ) from None

    digits = load_digits()
    return torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0, torch.tensor(digits.target)


def _synthetic() -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy copies of ten fixed 8x8 patterns: a learnable stand-in where scikit-learn is missing."""
    generator = torch.Generator().manual_seed(1234)
    patterns = torch.rand(10, 1, 8, 8, generator=generator)
    y = torch.arange(1800) % 10
    x = (patterns[y] + 0.35 * torch.randn(1800, 1, 8, 8, generator=generator)).clamp(0, 1)
    return x, y


def load(seed: int, source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The data set (digits or synthetic), shuffled and split 80/20."""
    x, y = _digits() if source == "digits" else _synthetic()
    y = y.to(torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--policy", choices=["priority", "fifo"], default="priority")
    parser.add_argument(
        "--overlap-forward", action="store_true", help="apply each update as soon as it is reduced"
    )
    parser.add_argument("--compression", choices=["fp16", "bf16"], default=None)
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model trains (default: cuda when PyTorch sees a GPU)",
    )
    parser.add_argument(
        "--data", choices=["digits", "synthetic"], default="digits", help="synthetic needs no scikit-learn"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    commsched.init(policy=args.policy, device=args.device)
    rank, size = commsched.rank(), commsched.size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", commsched.local_rank())
        torch.cuda.set_device(device)
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {size} ranks")
    per_rank = args.batch_size // size

    torch.manual_seed(rank)  # different on purpose: broadcast_parameters makes them equal
    model = DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ct.broadcast_parameters(model.state_dict(), root_rank=0)
    ct.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = ct.DistributedOptimizer(
        optimizer, model=model, overlap_forward=args.overlap_forward, compression=args.compression
    )

    x_train, y_train, x_test, y_test = (t.to(device) for t in load(seed=0, source=args.data))
    steps = len(x_train) // args.batch_size
    if rank == 0:
        mode = "overlap" if args.overlap_forward else "barrier"
        transport = commsched.config()["transport"]
        print(f"{size} rank(s) on {args.device}, {transport}, policy={args.policy}, {mode} mode")
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch)).to(device)
        model.train()
        started, total = time.perf_counter(), torch.zeros(1, device=device)
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            mine = batch[rank * per_rank : (rank + 1) * per_rank]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()
            optimizer.step()
            total += loss.detach()  # no host sync per step
        if args.overlap_forward:
            # Finish the last updates before evaluating; barrier mode's step() has already waited,
            # and a synchronize() there would make the next step() warn.
            optimizer.synchronize()
        elapsed = time.perf_counter() - started
        mean_loss = ct.allreduce(total / steps, name=f"loss.{epoch}").item()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(
                f"epoch {epoch + 1}: loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  "
                f"{steps * args.batch_size / elapsed:,.0f} samples/s  {1e3 * elapsed / steps:.1f} ms/step"
            )
    if rank == 0:
        counters = commsched.stats()
        print(f"commsched: {counters['launches']} launches, {counters['fused_launches']} fused")
    commsched.shutdown()


if __name__ == "__main__":
    main()
