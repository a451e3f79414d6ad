"""Train a small CNN on scikit-learn's digits with commsched's PyTorch plug-in.

    mpiexec -n 2 python examples/torch_train.py                 # MPI transport
    torchrun --nproc-per-node 2 examples/torch_train.py         # Gloo, no MPI needed
    python examples/torch_train.py --overlap-forward            # one process works too

Each rank trains on its shard of every global batch; the averaged gradients make all
ranks take the same step, so the printed loss and accuracy match a one-process run.
"""

from __future__ import annotations

import argparse
import time

import commsched.torch as ct
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

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


def load(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set (ships with scikit-learn), scaled to [0, 1] and split 80/20."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
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
    args = parser.parse_args()

    torch.set_num_threads(1)
    commsched.init(policy=args.policy)
    rank, size = commsched.rank(), commsched.size()
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {size} ranks")
    per_rank = args.batch_size // size

    torch.manual_seed(rank)  # different on purpose: broadcast_parameters makes them equal
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ct.broadcast_parameters(model.state_dict(), root_rank=0)
    ct.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = ct.DistributedOptimizer(
        optimizer, model=model, overlap_forward=args.overlap_forward, compression=args.compression
    )

    x_train, y_train, x_test, y_test = load(seed=0)
    steps = len(x_train) // args.batch_size
    if rank == 0:
        mode = "overlap" if args.overlap_forward else "barrier"
        print(f"{size} rank(s), {commsched.config()['transport']}, policy={args.policy}, {mode} mode")
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        model.train()
        started, total = time.perf_counter(), 0.0
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            mine = batch[rank * per_rank : (rank + 1) * per_rank]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()
            optimizer.step()
            total += loss.item()
        optimizer.synchronize()  # overlap mode: finish the last updates before evaluating
        elapsed = time.perf_counter() - started
        mean_loss = ct.allreduce(torch.tensor([total / steps]), name=f"loss.{epoch}").item()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(
                f"epoch {epoch + 1}: loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  "
                f"{steps * args.batch_size / elapsed:,.0f} samples/s  {1e3 * elapsed / steps:.1f} ms/step"
            )
    commsched.shutdown()


if __name__ == "__main__":
    main()
