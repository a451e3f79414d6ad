"""Model profiles: parameter tensors in forward order with per-layer compute in FLOPs.

A profile is what ``commsched-bench schedule --model NAME`` replays: each layer
lists the parameters it first uses in the forward pass (name and shape, in that
order) and its forward and backward FLOPs, which become seconds at a device rate
given on the command line. The shipped profiles are computed here from the real
architectures (torchvision VGG-16 and ResNet-50, Hugging Face BERT-base and GPT-2
medium, with their parameter names) rather than typed in, so a shape error shows up
as a wrong parameter count.

FLOP convention: forward = 2 * multiply-accumulates per sample * batch size.
Convolutions count 2*Cin*Cout*k*k*Hout*Wout, linear layers 2*in*out per token,
attention adds the score (QK^T) and context (AV) matmuls, and norm layers one
multiply-add (scale and shift) per element. Activations, pooling and softmax are
not counted. Backward = 2 * forward (gradients for inputs and for weights).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The rate the benchmark CLI assumes unless told otherwise (commsched-bench --device-tflops).
DEFAULT_DEVICE_FLOPS = 100e12
PROFILE_FORMAT = "commsched-model-profile"
PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

Shape = tuple[int, ...]


@dataclass
class LayerProfile:
    """One layer: the parameters it first uses in forward order, and its compute."""

    name: str
    params: list[tuple[str, Shape]]  # parameter name and shape, forward order
    forward_flops: float
    backward_flops: float
    # Measured seconds, set only for recorded profiles; FLOPs are then derived from them.
    forward_s: float | None = None
    backward_s: float | None = None

    def param_count(self) -> int:
        """Number of parameter elements in this layer."""
        return sum(math.prod(shape) for _, shape in self.params)

    def param_bytes(self, dtype_bytes: int = 4) -> int:
        """Gradient bytes of this layer at dtype_bytes per element."""
        return self.param_count() * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form."""
        out: dict[str, Any] = {
            "name": self.name,
            "params": [[n, list(s)] for n, s in self.params],
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
        }
        if self.forward_s is not None:
            out["forward_s"] = self.forward_s
        if self.backward_s is not None:
            out["backward_s"] = self.backward_s
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerProfile:
        """Inverse of to_dict, with a message naming the layer when a field is bad."""
        try:
            params = [(str(n), tuple(int(x) for x in s)) for n, s in d["params"]]
            return cls(
                name=str(d["name"]),
                params=params,
                forward_flops=float(d["forward_flops"]),
                backward_flops=float(d["backward_flops"]),
                forward_s=None if d.get("forward_s") is None else float(d["forward_s"]),
                backward_s=None if d.get("backward_s") is None else float(d["backward_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad layer {d.get('name', '?')!r} in profile: {e!r}") from e


@dataclass
class ModelProfile:
    """A model's layers in forward order, for one training step at batch_size."""

    name: str
    layers: list[LayerProfile]
    batch_size: int
    description: str
    # For recorded profiles: the rate at which the FLOPs reproduce the measured times.
    device_flops: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def parameters(self) -> list[tuple[str, Shape]]:
        """All parameters in forward order."""
        return [p for layer in self.layers for p in layer.params]

    def param_count(self) -> int:
        """Number of parameter elements in the model."""
        return sum(layer.param_count() for layer in self.layers)

    def param_bytes(self, dtype_bytes: int = 4) -> int:
        """Gradient bytes one step produces at dtype_bytes per element."""
        return self.param_count() * dtype_bytes

    def forward_flops(self) -> float:
        """Forward FLOPs of one step (whole batch)."""
        return sum(layer.forward_flops for layer in self.layers)

    def total_flops(self) -> float:
        """Forward plus backward FLOPs of one step (whole batch)."""
        return sum(layer.forward_flops + layer.backward_flops for layer in self.layers)

    def forward_seconds(self, device_flops: float = DEFAULT_DEVICE_FLOPS) -> list[float]:
        """Per-layer forward time, in forward order, at device_flops FLOP/s."""
        _check_rate(device_flops)
        return [layer.forward_flops / device_flops for layer in self.layers]

    def backward_seconds(self, device_flops: float = DEFAULT_DEVICE_FLOPS) -> list[float]:
        """Per-layer backward time, still in forward order, at device_flops FLOP/s."""
        _check_rate(device_flops)
        return [layer.backward_flops / device_flops for layer in self.layers]

    def step_seconds(self, device_flops: float = DEFAULT_DEVICE_FLOPS) -> float:
        """Compute time of one forward plus backward at device_flops FLOP/s."""
        _check_rate(device_flops)
        return self.total_flops() / device_flops

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form."""
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "batch_size": self.batch_size,
            "description": self.description,
            "param_count": self.param_count(),
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.device_flops is not None:
            out["device_flops"] = self.device_flops
        if self.extra:
            out["extra"] = self.extra
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        """Inverse of to_dict; rejects other formats and versions with a clear message."""
        if d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a commsched model profile (format={d.get('format')!r})")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, this commsched reads {PROFILE_VERSION}")
        profile = cls(
            name=str(d["name"]),
            layers=[LayerProfile.from_dict(x) for x in d["layers"]],
            batch_size=int(d["batch_size"]),
            description=str(d.get("description", "")),
            device_flops=None if d.get("device_flops") is None else float(d["device_flops"]),
            extra=dict(d.get("extra", {})),
        )
        if "param_count" in d and int(d["param_count"]) != profile.param_count():
            raise ValueError(
                f"profile {profile.name!r} says {d['param_count']} parameters, its layers hold "
                f"{profile.param_count()}"
            )
        return profile

    def to_json(self) -> str:
        """Serialise to JSON text, one layer per line so diffs of profiles stay readable."""
        d = self.to_dict()
        layers = d.pop("layers")
        head = json.dumps(d, indent=1)[: -len("\n}")]
        body = ",\n".join("  " + json.dumps(layer) for layer in layers)
        return f'{head},\n "layers": [\n{body}\n ]\n}}'

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Parse JSON text written by to_json."""
        return cls.from_dict(json.loads(text))


def _check_rate(device_flops: float) -> None:
    if not device_flops > 0:
        raise ValueError(f"device_flops must be positive FLOP/s, got {device_flops!r}")


class _Builder:
    """Accumulates layers while walking an architecture; shapes follow PyTorch layouts."""

    def __init__(self, batch_size: int) -> None:
        self.batch = batch_size
        self.layers: list[LayerProfile] = []

    def add(self, name: str, params: list[tuple[str, Shape]], fwd_per_sample: float) -> None:
        fwd = float(fwd_per_sample) * self.batch
        self.layers.append(LayerProfile(name, params, fwd, 2.0 * fwd))

    def conv(self, name: str, cin: int, cout: int, k: int, stride: int, pad: int, hw: int, bias: bool) -> int:
        """A square convolution on an hw x hw input; returns the output side."""
        out = (hw + 2 * pad - k) // stride + 1
        params: list[tuple[str, Shape]] = [(f"{name}.weight", (cout, cin, k, k))]
        if bias:
            params.append((f"{name}.bias", (cout,)))
        self.add(name, params, 2 * cin * cout * k * k * out * out)
        return out

    def linear(self, name: str, fin: int, fout: int, tokens: int = 1, conv1d: bool = False) -> None:
        """nn.Linear (weight out x in) or GPT-2's Conv1D (weight in x out), per token."""
        shape = (fin, fout) if conv1d else (fout, fin)
        self.add(name, [(f"{name}.weight", shape), (f"{name}.bias", (fout,))], 2 * fin * fout * tokens)

    def norm(self, name: str, channels: int, elements: int) -> None:
        """BatchNorm or LayerNorm: weight and bias, one multiply-add per element."""
        self.add(name, [(f"{name}.weight", (channels,)), (f"{name}.bias", (channels,))], 2 * elements)

    def embedding(self, name: str, rows: int, dim: int) -> None:
        """A lookup table: large gradient, no multiply-accumulates."""
        self.add(name, [(f"{name}.weight", (rows, dim))], 0)

    def attention_core(self, name: str, seq: int, dim: int) -> None:
        """Scores QK^T and context AV over all heads: 2 * seq * seq * dim MACs per sample."""
        self.add(name, [], 2 * (2 * seq * seq * dim))


_VGG16_CFG: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M"]
_VGG16_CFG += [512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16(batch_size: int = 32, image: int = 224, classes: int = 1000) -> ModelProfile:
    """torchvision VGG-16 (no batch norm) on image x image RGB input."""
    b = _Builder(batch_size)
    cin, hw, idx = 3, image, 0
    for v in _VGG16_CFG:
        if v == "M":
            hw //= 2
            idx += 1
        else:
            hw = b.conv(f"features.{idx}", cin, int(v), 3, 1, 1, hw, bias=True)
            cin = int(v)
            idx += 2  # conv then ReLU
    # AdaptiveAvgPool2d((7, 7)) makes the classifier input 512*7*7 whatever the image size.
    b.linear("classifier.0", cin * 7 * 7, 4096)
    b.linear("classifier.3", 4096, 4096)
    b.linear("classifier.6", 4096, classes)
    return ModelProfile(
        "vgg16",
        b.layers,
        batch_size,
        f"VGG-16 (torchvision), ImageNet {image}x{image}, batch {batch_size}: 13 convs, 3 big fc layers",
    )


def resnet50(batch_size: int = 32, image: int = 224, classes: int = 1000) -> ModelProfile:
    """torchvision ResNet-50 (v1.5, stride in the 3x3 conv), batch-norm tensors kept separate."""
    b = _Builder(batch_size)
    hw = b.conv("conv1", 3, 64, 7, 2, 3, image, bias=False)
    b.norm("bn1", 64, 64 * hw * hw)
    hw = (hw + 2 - 3) // 2 + 1  # 3x3 max pool, stride 2, pad 1
    cin = 64
    for stage, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]):
        for blk in range(blocks):
            p, s, cout = f"layer{stage + 1}.{blk}", stride if blk == 0 else 1, width * 4
            h1 = b.conv(f"{p}.conv1", cin, width, 1, 1, 0, hw, bias=False)
            b.norm(f"{p}.bn1", width, width * h1 * h1)
            h2 = b.conv(f"{p}.conv2", width, width, 3, s, 1, h1, bias=False)
            b.norm(f"{p}.bn2", width, width * h2 * h2)
            h3 = b.conv(f"{p}.conv3", width, cout, 1, 1, 0, h2, bias=False)
            b.norm(f"{p}.bn3", cout, cout * h3 * h3)
            if blk == 0:
                # Bottleneck.forward runs the downsample branch after bn3.
                hd = b.conv(f"{p}.downsample.0", cin, cout, 1, s, 0, hw, bias=False)
                b.norm(f"{p}.downsample.1", cout, cout * hd * hd)
            cin, hw = cout, h3
    b.linear("fc", cin, classes)
    return ModelProfile(
        "resnet50",
        b.layers,
        batch_size,
        f"ResNet-50 v1.5 (torchvision), ImageNet {image}x{image}, batch {batch_size}: "
        "53 convs with separate batch-norm weight/bias tensors, fc",
    )


def bert_base(batch_size: int = 32, seq_len: int = 128) -> ModelProfile:
    """Hugging Face BertModel, bert-base-uncased sizes: embeddings, 12 encoder layers, pooler."""
    d, ffn, layers, vocab, max_pos = 768, 3072, 12, 30522, 512
    b = _Builder(batch_size)
    tokens = seq_len
    # BertEmbeddings.forward looks up word, then token type, then position embeddings.
    b.embedding("embeddings.word_embeddings", vocab, d)
    b.embedding("embeddings.token_type_embeddings", 2, d)
    b.embedding("embeddings.position_embeddings", max_pos, d)
    b.norm("embeddings.LayerNorm", d, d * tokens)
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            b.linear(f"{p}.attention.self.{proj}", d, d, tokens)
        b.attention_core(f"{p}.attention.self.core", seq_len, d)
        b.linear(f"{p}.attention.output.dense", d, d, tokens)
        b.norm(f"{p}.attention.output.LayerNorm", d, d * tokens)
        b.linear(f"{p}.intermediate.dense", d, ffn, tokens)
        b.linear(f"{p}.output.dense", ffn, d, tokens)
        b.norm(f"{p}.output.LayerNorm", d, d * tokens)
    b.linear("pooler.dense", d, d, 1)  # first token only
    return ModelProfile(
        "bert-base",
        b.layers,
        batch_size,
        f"BERT-base (Hugging Face BertModel, uncased vocab), seq {seq_len}, batch {batch_size}: "
        "embeddings, 12 encoder layers (d=768, ffn 3072, 12 heads), pooler",
    )


def gpt2_medium(batch_size: int = 8, seq_len: int = 1024) -> ModelProfile:
    """Hugging Face GPT-2 medium with the LM head tied to the token embedding."""
    d, layers, vocab, ctx = 1024, 24, 50257, 1024
    if seq_len > ctx:
        raise ValueError(f"GPT-2 medium has a context of {ctx}, got seq_len={seq_len}")
    b = _Builder(batch_size)
    t = seq_len
    # wte is first used here and again by the tied LM head at the very end, so its
    # gradient is complete only when backward reaches the embedding, last.
    b.embedding("wte", vocab, d)
    b.embedding("wpe", ctx, d)
    for i in range(layers):
        p = f"h.{i}"
        b.norm(f"{p}.ln_1", d, d * t)
        b.linear(f"{p}.attn.c_attn", d, 3 * d, t, conv1d=True)
        b.attention_core(f"{p}.attn.core", t, d)
        b.linear(f"{p}.attn.c_proj", d, d, t, conv1d=True)
        b.norm(f"{p}.ln_2", d, d * t)
        b.linear(f"{p}.mlp.c_fc", d, 4 * d, t, conv1d=True)
        b.linear(f"{p}.mlp.c_proj", 4 * d, d, t, conv1d=True)
    b.norm("ln_f", d, d * t)
    b.add("lm_head", [], 2 * d * vocab * t)  # weight is wte, listed at its first use
    return ModelProfile(
        "gpt2-medium",
        b.layers,
        batch_size,
        f"GPT-2 medium (Hugging Face), seq {seq_len}, batch {batch_size}: 24 layers, d=1024, "
        "vocab 50257, LM head tied to wte (wte's gradient is ready last, needed first)",
    )


_BUILDERS: dict[str, Callable[..., ModelProfile]] = {
    "vgg16": vgg16,
    "resnet50": resnet50,
    "bert-base": bert_base,
    "gpt2-medium": gpt2_medium,
}


def _key(name: str) -> str:
    # "VGG-16", "vgg_16" and "vgg16" all mean the same model.
    return re.sub(r"[^a-z0-9]", "", name.lower())


_ALIASES = {_key(n): n for n in _BUILDERS}


def list_profiles() -> list[str]:
    """Names get_profile accepts."""
    return list(_BUILDERS)


def get_profile(name: str, batch_size: int | None = None) -> ModelProfile:
    """A shipped profile by name (case-insensitive), at its default or the given batch size."""
    canonical = _ALIASES.get(_key(name))
    if canonical is None:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(list_profiles())}")
    builder = _BUILDERS[canonical]
    return builder() if batch_size is None else builder(batch_size=batch_size)


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile JSON file (shipped, or written by save_profile)."""
    path = Path(path)
    try:
        return ModelProfile.from_json(path.read_text())
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"cannot load model profile {str(path)!r}: {e}") from e


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    """Write a profile as JSON."""
    Path(path).write_text(profile.to_json() + "\n")


def write_shipped_profiles(directory: str | Path = PROFILES_DIR) -> list[Path]:
    """Regenerate the JSON copies of the built-in profiles under directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in list_profiles():
        path = directory / f"{name}.json"
        save_profile(get_profile(name), path)
        paths.append(path)
    return paths


def summary(profile: ModelProfile, device_flops: float = DEFAULT_DEVICE_FLOPS) -> str:
    """A few human-readable lines about a profile."""
    sizes = [math.prod(s) * 4 for _, s in profile.parameters()]
    return (
        f"{profile.name}: {profile.description}\n"
        f"  {profile.param_count():,} parameters in {len(sizes)} tensors "
        f"({profile.param_bytes() / 2**20:.1f} MiB fp32, largest {max(sizes, default=0) / 2**20:.1f} MiB), "
        f"{len(profile.layers)} layers\n"
        f"  {profile.forward_flops() / profile.batch_size / 1e9:.2f} GFLOP forward per sample; "
        f"step {profile.step_seconds(device_flops) * 1e3:.1f} ms at {device_flops / 1e12:g} TFLOP/s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commsched.bench.models``: show profiles or regenerate the shipped JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("names", nargs="*", help="profiles to show (default: all)")
    parser.add_argument("--write", metavar="DIR", nargs="?", const=str(PROFILES_DIR), help="write JSON")
    parser.add_argument("--device-tflops", type=float, default=DEFAULT_DEVICE_FLOPS / 1e12)
    args = parser.parse_args(argv)
    if args.write:
        for path in write_shipped_profiles(args.write):
            print(f"wrote {path}")
        return 0
    for name in args.names or list_profiles():
        print(summary(get_profile(name), args.device_tflops * 1e12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
