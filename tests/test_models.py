"""Tests for the shipped model profiles and for recording a profile from a torch model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from commsched.bench import models
from commsched.bench.models import LayerProfile, ModelProfile

# Published parameter counts (paper / model card) and the exact counts of the reference
# implementations (torchvision, Hugging Face transformers) the profiles follow.
PUBLISHED = {"vgg16": 138e6, "resnet50": 25.6e6, "bert-base": 110e6, "gpt2-medium": 355e6}
REFERENCE_EXACT = {
    "vgg16": 138_357_544,
    "resnet50": 25_557_032,
    "bert-base": 109_482_240,
    "gpt2-medium": 354_823_168,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name: str) -> None:
    profile = models.get_profile(name)
    assert abs(profile.param_count() - PUBLISHED[name]) / PUBLISHED[name] < 0.01
    assert profile.param_count() == REFERENCE_EXACT[name]
    assert profile.param_bytes() == 4 * profile.param_count()
    assert profile.param_bytes(dtype_bytes=2) == 2 * profile.param_count()


def test_list_and_default_batch_sizes() -> None:
    assert models.list_profiles() == ["vgg16", "resnet50", "bert-base", "gpt2-medium"]
    batches = {n: models.get_profile(n).batch_size for n in models.list_profiles()}
    assert batches == {"vgg16": 32, "resnet50": 32, "bert-base": 32, "gpt2-medium": 8}


def test_get_profile_names_are_forgiving_and_errors_list_choices() -> None:
    assert models.get_profile("VGG-16").name == "vgg16"
    assert models.get_profile("BERT_base").name == "bert-base"
    assert models.get_profile("GPT2-Medium").name == "gpt2-medium"
    with pytest.raises(ValueError, match="vgg16, resnet50, bert-base, gpt2-medium"):
        models.get_profile("alexnet")


def test_vgg16_forward_order() -> None:
    params = models.get_profile("vgg16").parameters()
    assert params[0] == ("features.0.weight", (64, 3, 3, 3))
    assert params[1] == ("features.0.bias", (64,))
    assert params[-2] == ("classifier.6.weight", (1000, 4096))
    assert params[-1] == ("classifier.6.bias", (1000,))
    assert ("classifier.0.weight", (4096, 512 * 7 * 7)) in params
    conv_names = [n for n, s in params if len(s) == 4]
    assert len(conv_names) == 13 and conv_names[-1] == "features.28.weight"


def test_resnet50_keeps_batchnorm_tensors_separate() -> None:
    profile = models.get_profile("resnet50")
    params = profile.parameters()
    assert [n for n, _ in params[:3]] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert params[-1] == ("fc.bias", (1000,))
    small = [n for n, s in params if len(s) == 1]
    assert len(small) == 2 * 53 + 1  # weight and bias of 53 batch norms, plus fc.bias
    # Bottleneck runs its downsample branch after bn3.
    names = [n for n, _ in params]
    assert names.index("layer2.0.bn3.bias") < names.index("layer2.0.downsample.0.weight")
    assert len(params) == 161


def test_bert_base_embeddings_first_and_shapes() -> None:
    profile = models.get_profile("bert-base")
    params = profile.parameters()
    assert params[0] == ("embeddings.word_embeddings.weight", (30522, 768))
    shapes = dict(params)
    assert shapes["embeddings.position_embeddings.weight"] == (512, 768)
    assert shapes["embeddings.token_type_embeddings.weight"] == (2, 768)
    assert shapes["encoder.layer.11.intermediate.dense.weight"] == (3072, 768)
    assert params[-1] == ("pooler.dense.bias", (768,))
    assert sum(1 for n in shapes if n.endswith("attention.self.query.weight")) == 12


def test_gpt2_medium_tied_embedding_is_first_and_only_once() -> None:
    profile = models.get_profile("gpt2-medium")
    params = profile.parameters()
    assert params[0] == ("wte.weight", (50257, 1024))
    assert [n for n, _ in params].count("wte.weight") == 1
    assert sum(1 for n, _ in params if n.endswith("attn.c_attn.weight")) == 24
    head = profile.layers[-1]
    # The head reuses wte: compute but no tensor of its own.
    assert head.name == "lm_head" and head.params == [] and head.forward_flops > 0


def test_flops_follow_the_stated_convention() -> None:
    vgg, resnet = models.get_profile("vgg16"), models.get_profile("resnet50")
    # Widely quoted multiply-accumulates per 224x224 image: 15.5 G and 4.1 G.
    assert vgg.forward_flops() / vgg.batch_size / 2 == pytest.approx(15.47e9, rel=0.02)
    assert resnet.forward_flops() / resnet.batch_size / 2 == pytest.approx(4.1e9, rel=0.03)
    first = vgg.layers[0]
    assert first.forward_flops == 2 * 3 * 64 * 9 * 224 * 224 * 32
    for name in models.list_profiles():
        profile = models.get_profile(name)
        for layer in profile.layers:
            assert layer.backward_flops == 2 * layer.forward_flops
        assert profile.total_flops() == pytest.approx(3 * profile.forward_flops())


def test_transformer_flops_include_attention() -> None:
    bert = models.get_profile("bert-base")
    seq, d, batch = 128, 768, 32
    core = [layer for layer in bert.layers if layer.name.endswith("attention.self.core")]
    assert len(core) == 12
    assert core[0].forward_flops == 2 * 2 * seq * seq * d * batch
    linear_per_token = 12 * 2 * (4 * d * d + 2 * d * 3072)
    assert bert.forward_flops() > linear_per_token * seq * batch


def test_forward_seconds_scale_with_device_rate() -> None:
    profile = models.get_profile("resnet50")
    fwd = profile.forward_seconds(1e12)
    bwd = profile.backward_seconds(1e12)
    assert len(fwd) == len(bwd) == len(profile.layers)
    assert sum(fwd) == pytest.approx(profile.forward_flops() / 1e12)
    assert sum(profile.forward_seconds(2e12)) == pytest.approx(sum(fwd) / 2)
    assert profile.step_seconds(1e12) == pytest.approx(sum(fwd) + sum(bwd))
    with pytest.raises(ValueError):
        profile.forward_seconds(0)


def test_batch_size_override_scales_flops_not_params() -> None:
    a, b = models.get_profile("vgg16"), models.get_profile("vgg16", batch_size=64)
    assert b.batch_size == 64 and b.param_count() == a.param_count()
    assert b.forward_flops() == pytest.approx(2 * a.forward_flops())


@pytest.mark.parametrize("name", ["vgg16", "resnet50", "bert-base", "gpt2-medium"])
def test_json_round_trip_and_shipped_copy(name: str, tmp_path: Path) -> None:
    profile = models.get_profile(name)
    assert ModelProfile.from_json(profile.to_json()) == profile
    path = tmp_path / f"{name}.json"
    models.save_profile(profile, path)
    assert models.load_profile(path) == profile
    # The shipped data file must be what the code computes today.
    assert models.load_profile(models.PROFILES_DIR / f"{name}.json") == profile


def test_load_profile_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a commsched model profile"):
        models.load_profile(bad)
    profile = ModelProfile("x", [LayerProfile("l", [("w", (2, 3))], 1.0, 2.0)], 1, "")
    data = profile.to_dict()
    data["param_count"] = 7
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="says 7 parameters"):
        models.load_profile(bad)
    with pytest.raises(ValueError, match="cannot load"):
        models.load_profile(tmp_path / "missing.json")


def test_models_and_record_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import commsched.bench.models, commsched.bench.record\n"
        "print(commsched.bench.models.get_profile('vgg16').param_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(REFERENCE_EXACT["vgg16"])


# -- record_profile -------------------------------------------------------------

try:
    import torch
    from torch import nn
except ImportError:  # the profile tests above still run
    torch = None  # type: ignore[assignment]
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _shuffled_mlp() -> nn.Module:
    """An MLP whose modules are declared in a different order from their use in forward."""

    class ShuffledMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(32, 4)
            self.hidden = nn.Linear(64, 32)
            self.norm = nn.LayerNorm(64)
            self.inp = nn.Linear(16, 64)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.norm(self.inp(x)))
            return self.out(self.act(self.hidden(h)))

    return ShuffledMLP()


@needs_torch
def test_record_profile_follows_forward_use_not_declaration() -> None:
    from commsched.bench.record import record_profile

    torch.manual_seed(0)
    model = _shuffled_mlp()
    declared = [n for n, _ in model.named_parameters()]
    assert declared[0] == "out.weight"
    profile = record_profile(model, torch.randn(8, 16), "mlp", repeats=2)
    order = [n for n, _ in profile.parameters()]
    assert order == [
        "inp.weight",
        "inp.bias",
        "norm.weight",
        "norm.bias",
        "hidden.weight",
        "hidden.bias",
        "out.weight",
        "out.bias",
    ]
    assert dict(profile.parameters())["inp.weight"] == (64, 16)
    assert profile.param_count() == sum(p.numel() for p in model.parameters())
    assert profile.batch_size == 8
    with_params = [layer for layer in profile.layers if layer.params]
    assert all(layer.forward_s and layer.forward_s > 0 for layer in with_params)
    assert all(layer.backward_s and layer.backward_s > 0 for layer in with_params)
    assert all(layer.forward_flops > 0 and layer.backward_flops > 0 for layer in with_params)
    # FLOPs are the measured seconds at the stated rate, so replay reproduces them.
    layer = with_params[0]
    assert layer.forward_s is not None
    assert layer.forward_flops == pytest.approx(layer.forward_s * models.DEFAULT_DEVICE_FLOPS)
    assert profile.forward_seconds()[0] == pytest.approx(profile.layers[0].forward_s)
    assert ModelProfile.from_json(profile.to_json()) == profile
    assert all(p.grad is None for p in model.parameters())


@needs_torch
def test_record_profile_handles_tied_inplace_and_unused() -> None:
    from commsched.bench.record import record_profile

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 20, bias=False)
            self.emb = nn.Embedding(20, 8)
            self.head.weight = self.emb.weight
            self.mid = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)  # full backward hooks reject this
            self.spare = nn.Linear(2, 2)
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.bn(self.act(self.mid(self.emb(x)))))

    model = Tied()
    running_mean = model.bn.running_mean
    assert running_mean is not None
    before = running_mean.clone()
    profile = record_profile(model, torch.randint(0, 20, (6,)), "tied", repeats=1)
    order = [n for n, _ in profile.parameters()]
    # One tensor, named as named_parameters() names it (head registered it first),
    # placed where forward first uses it (the embedding).
    assert order[0] == "head.weight" and "emb.weight" not in order
    assert order[-2:] == ["spare.weight", "spare.bias"]
    assert profile.layers[-1].name == "(unused in forward)"
    assert torch.equal(running_mean, before)  # recording leaves BN statistics alone
    for layer in profile.layers[:-1]:
        assert layer.backward_s == pytest.approx(2 * (layer.forward_s or 0.0))


def _resnet50() -> nn.Module:
    """torchvision's ResNet-50 written out, so the test needs no torchvision."""

    class _Bottleneck(nn.Module):
        """Bottleneck v1.5: stride in the 3x3 conv, downsample after bn3."""

        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            identity = x if self.downsample is None else self.downsample(x)
            return self.relu(out + identity)

    layers: list[nn.Module] = []
    cin = 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        stage = [_Bottleneck(cin, width, stride)] + [
            _Bottleneck(width * 4, width, 1) for _ in range(blocks - 1)
        ]
        layers.append(nn.Sequential(*stage))
        cin = width * 4
    model = nn.Sequential()
    for name, module in [
        ("conv1", nn.Conv2d(3, 64, 7, 2, 3, bias=False)),
        ("bn1", nn.BatchNorm2d(64)),
        ("relu", nn.ReLU()),
        ("maxpool", nn.MaxPool2d(3, 2, 1)),
        *[(f"layer{i + 1}", s) for i, s in enumerate(layers)],
        ("avgpool", nn.AdaptiveAvgPool2d(1)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(2048, 1000)),
    ]:
        model.add_module(name, module)
    return model


@needs_torch
def test_recorded_resnet50_matches_computed_profile() -> None:
    from commsched.bench.record import record_profile

    # eval() lets a 1x32x32 input through batch norm: the order, not the numbers, is under test.
    model = _resnet50().eval()
    recorded = record_profile(model, torch.randn(1, 3, 32, 32), "resnet50", repeats=1)
    assert recorded.parameters() == models.get_profile("resnet50").parameters()
    assert math.isclose(recorded.param_count(), REFERENCE_EXACT["resnet50"])
