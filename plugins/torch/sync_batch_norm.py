"""SyncBatchNorm: batch normalisation whose statistics cover the batch of every rank.

In training, each rank's per-channel sum, sum of squares and element count are summed over
ranks by one commsched allreduce, so every rank normalises with the mean and variance of the
whole global batch; backward sums the two per-channel gradient terms the same way. The input
gradient is then the one of the sum of every rank's loss (as in Horovod and PyTorch); weight
and bias gradients stay local, for DistributedOptimizer to average. In eval mode, or on one
rank, it is plain batch normalisation.
"""

from __future__ import annotations

from typing import Any

from commsched.torch import collectives as _ops

import commsched
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def _channel_sums(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over every dimension but the channels (dimension 1)."""
    return tensor.transpose(0, 1).reshape(tensor.shape[1], -1).sum(dim=1)


def _per_channel(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-channel values shaped to broadcast against `like` (N, C, ...)."""
    return values.reshape(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        # Statistics in float64: a sum of squares minus a squared mean cancels badly in float32.
        wide = x.detach().to(torch.float64)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64)
        stats = torch.cat([_channel_sums(wide), _channel_sums(wide * wide), count])
        _ops.allreduce_(stats, op="sum", name=None)
        channels = x.shape[1]
        total = float(stats[-1])
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            unbiased = var * (total / max(total - 1, 1))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean_x, invstd_x = mean.to(x.dtype), invstd.to(x.dtype)
        normalised = (x - _per_channel(mean_x, x)) * _per_channel(invstd_x, x)
        ctx.save_for_backward(normalised, weight, invstd_x)
        ctx.total = total
        ctx.has_bias = bias is not None
        out = normalised
        if weight is not None:
            out = out * _per_channel(weight, x)
        if bias is not None:
            out = out + _per_channel(bias, x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        normalised, weight, invstd = ctx.saved_tensors
        channels = grad.shape[1]
        sum_dy = _channel_sums(grad)
        sum_dy_norm = _channel_sums(grad * normalised)
        sums = torch.cat([sum_dy, sum_dy_norm]).to(torch.float64)
        _ops.allreduce_(sums, op="sum", name=None)
        mean_dy = (sums[:channels] / ctx.total).to(grad.dtype)
        mean_dy_norm = (sums[channels:] / ctx.total).to(grad.dtype)
        scale = invstd if weight is None else invstd * weight
        grad_x = (
            grad - _per_channel(mean_dy, grad) - normalised * _per_channel(mean_dy_norm, grad)
        ) * _per_channel(scale, grad)
        grad_weight = sum_dy_norm if weight is not None else None
        grad_bias = sum_dy if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the global batch of every rank (Horovod's hvd.SyncBatchNorm)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)  # type: ignore[arg-type]

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of at least 2 dimensions (N, C, ...), got {input.dim()}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalises with the statistics of every rank's batch in training, running statistics in eval."""
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        ranks = commsched.size() if commsched.is_initialized() else 1
        if not self.training or ranks == 1:
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch,
                momentum,
                self.eps,
            )
        return _SyncBatchNormFunction.apply(  # type: ignore[no-any-return]
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            momentum,
        )
