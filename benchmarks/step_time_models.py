"""The models benchmarks/gpu_step_time.py times: torchvision's ResNet-50 and ViT-B/16 (or replicas with
their parameter tensors when torchvision is missing) and transformers' GPT-2, each with a fixed
synthetic batch and its loss."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from typing import Any


def _resnet(blocks: tuple[int, ...], width: int, classes: int) -> Any:
    """torchvision's ResNet-50 layout (v1.5, stride in the 3x3 conv) at any depth and width."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, planes: int, stride: int) -> None:
            super().__init__()
            cout = planes * 4
            self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: Any) -> Any:
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            identity = x if self.downsample is None else self.downsample(x)
            return self.relu(out + identity)

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = width
            for index, (count, stride) in enumerate(zip(blocks, (1, 2, 2, 2))):
                planes = width << index
                stage = [Bottleneck(cin, planes, stride)]
                stage += [Bottleneck(planes * 4, planes, 1) for _ in range(count - 1)]
                setattr(self, f"layer{index + 1}", nn.Sequential(*stage))
                cin = planes * 4
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet()


def _vit(image: int, patch: int, layers: int, heads: int, hidden: int, mlp: int, classes: int) -> Any:
    """torchvision's VisionTransformer layout (class token, learned positions, pre-norm blocks)."""
    import torch
    from torch import nn

    class EncoderBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
            self.self_attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
            self.dropout = nn.Dropout(0.0)
            self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
            self.mlp = nn.Sequential(
                nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden), nn.Dropout(0.0)
            )

        def forward(self, x: Any) -> Any:
            y = self.ln_1(x)
            y, _ = self.self_attention(y, y, y, need_weights=False)
            x = x + self.dropout(y)
            return x + self.mlp(self.ln_2(x))

    class Encoder(nn.Module):
        def __init__(self, length: int) -> None:
            super().__init__()
            self.pos_embedding = nn.Parameter(torch.empty(1, length, hidden).normal_(std=0.02))
            self.dropout = nn.Dropout(0.0)
            self.layers = nn.Sequential(*[EncoderBlock() for _ in range(layers)])
            self.ln = nn.LayerNorm(hidden, eps=1e-6)

        def forward(self, x: Any) -> Any:
            return self.ln(self.layers(self.dropout(x + self.pos_embedding)))

    class VisionTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv_proj = nn.Conv2d(3, hidden, patch, patch)
            self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
            self.encoder = Encoder((image // patch) ** 2 + 1)
            self.heads = nn.Sequential()
            self.heads.add_module("head", nn.Linear(hidden, classes))

        def forward(self, x: Any) -> Any:
            x = self.conv_proj(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
            return self.heads(self.encoder(x)[:, 0])

    return VisionTransformer()


def resnet50_replica() -> Any:
    """ResNet-50 with torchvision's 161 parameter tensors (25,557,032 elements), for when torchvision is missing."""
    return _resnet((3, 4, 6, 3), 64, 1000)


def vit_b_16_replica() -> Any:
    """ViT-B/16 with torchvision's 152 parameter tensors (86,567,656 elements), for when torchvision is missing."""
    return _vit(224, 16, 12, 12, 768, 3072, 1000)


def package_version(package: str) -> str | None:
    """The installed version of `package`, or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(model: str) -> str:
    """Why `model` cannot run here ('' when it can)."""
    if model == "gpt2" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed: the GPT-2 row is skipped (pip install transformers; no download needed)"
    return ""


def build(model: str, quick: bool, device: Any) -> tuple[Any, Callable[[Any], Any], str]:
    """(module on `device`, loss(net) on a fixed synthetic batch through net (it or its DDP), its source)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(1)
    if model == "gpt2":
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except Exception as error:  # installed but broken (built for another torch, say)
            raise Unavailable(
                f"transformers cannot be imported here: {type(error).__name__}: {error}"
            ) from error

        if quick:
            config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
            batch, tokens = 2, 32
        else:
            config = GPT2Config()
            batch, tokens = 8, 512
        module = GPT2LMHeadModel(config).to(device)
        ids = torch.randint(0, config.vocab_size, (batch, tokens), generator=generator).to(device)
        source = f"transformers {package_version('transformers')} GPT2LMHeadModel(GPT2Config"
        source += "(n_layer=2, n_embd=64))" if quick else "())"
        return module, lambda net: net(input_ids=ids, labels=ids, use_cache=False).loss, source
    if quick:
        if model == "resnet50":
            module, source = _resnet((1, 1, 1, 1), 8, 10), "replica, blocks 1-1-1-1, width 8"
        else:
            module, source = _vit(32, 8, 2, 4, 64, 128, 10), "replica, 2 layers, width 64, patch 8"
        batch, image, classes = 4, 32, 10
    else:
        batch, image, classes = (64 if model == "resnet50" else 32), 224, 1000
        module, why = None, "torchvision is not installed"
        if importlib.util.find_spec("torchvision") is not None:
            try:
                import torchvision

                module = getattr(torchvision.models, model)(weights=None)
                source = f"torchvision {torchvision.__version__}"
            except Exception as error:  # noqa: BLE001 - a torchvision built for another torch fails here
                why = f"torchvision failed: {type(error).__name__}: {str(error)[:200]}"
        if module is None:
            module = resnet50_replica() if model == "resnet50" else vit_b_16_replica()
            source = f"replica with torchvision's parameter tensors ({why})"
    module = module.to(device)
    x = torch.randn(batch, 3, image, image, generator=generator).to(device)
    y = torch.randint(0, classes, (batch,), generator=generator).to(device)
    return module, lambda net: F.cross_entropy(net(x), y), source


class Unavailable(Exception):
    """A model this machine cannot build (its package is missing or broken): a skipped row, not a failure."""


def parameter_tensors(module: Any) -> int:
    """Trainable parameter tensors (tied ones once), what a bucket layout has to cover."""
    return sum(1 for p in module.parameters() if p.requires_grad)
