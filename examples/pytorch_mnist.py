"""MNIST-style training on scikit-learn's 8x8 digits, written as for Horovod: only the import names commsched.

    mpiexec -n 2 python -m mpi4py examples/pytorch_mnist.py --epochs 3
    torchrun --nproc-per-node 2 examples/pytorch_mnist.py
    commsched-run -n 2 examples/pytorch_mnist.py --epochs 1

Each rank trains on its part of the training set (DistributedSampler); gradients are averaged
by commsched, and the test loss and accuracy are averaged over ranks with hvd.allreduce.
"""

from __future__ import annotations

import argparse

import commsched.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.data.distributed

try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit("the digits data set comes with scikit-learn: pip install scikit-learn") from None
from torch import nn, optim

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="input batch size for training")
parser.add_argument(
    "--test-batch-size", type=int, default=200, metavar="N", help="input batch size for testing"
)
parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.2, metavar="LR", help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument(
    "--log-interval", type=int, default=10, metavar="N", help="batches to wait before logging status"
)
parser.add_argument(
    "--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce"
)
parser.add_argument(
    "--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction"
)
parser.add_argument(
    "--gradient-predivide-factor",
    type=float,
    default=1.0,
    help="apply gradient predivide factor in optimizer",
)


class Net(nn.Module):
    """Two convolutions and two fully connected layers for 8x8 grey images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=2)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(self.conv2_drop(self.conv2(x)))
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def digits(train: bool) -> torch.utils.data.TensorDataset:
    """The first 1500 digits for training, the rest for testing, scaled to [0, 1]."""
    images, labels = load_digits(return_X_y=True)
    part = slice(0, 1500) if train else slice(1500, None)
    x = torch.tensor(images[part] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    return torch.utils.data.TensorDataset(x, torch.tensor(labels[part]))


def main() -> None:
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset = digits(train=True)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )

    test_dataset = digits(train=False)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    def train(epoch: int) -> None:
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                    f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}",
                    flush=True,
                )

    def metric_average(val: float, name: str) -> float:
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test() -> None:
        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                # get the index of the max log-probability
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).cpu().float().sum().item()

        # Horovod: use test_sampler to determine the number of examples in this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")

        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print(
                f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n",
                flush=True,
            )

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()


if __name__ == "__main__":
    main()
