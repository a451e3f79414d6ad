"""The sharded replay buckets gradients as `shard=True` does in training (commsched.bench.replay)."""

from __future__ import annotations

import pytest
import torch
from commsched.torch import _shard_layout

from commsched.bench import models
from commsched.bench.replay import TimedLayer, cut_params, shard_buckets
from commsched.bench.schedule import timed_layers


def _training_buckets(layers: list[TimedLayer], limit: int) -> list[list[int]]:
    params = [torch.empty(count) for layer in layers for _, count in layer.params]
    entries = [(p, f"p{i}", i, 0) for i, p in enumerate(params)]
    return [
        [entry[2] for entry in bucket]
        for bucket in _shard_layout.plan(entries, list(range(len(params))), limit)
    ]


@pytest.mark.parametrize("model", ["resnet50", "bert-base"])
@pytest.mark.parametrize("limit", [0, 64 << 10, 1 << 20])
def test_replay_cuts_the_buckets_training_cuts(model, limit):
    layers = timed_layers(models.get_profile(model), 100.0, 16.0)
    replayed = shard_buckets(layers, limit)
    assert replayed == _training_buckets(layers, limit)
    assert len(replayed) < sum(len(layer.params) for layer in layers) or limit == 0


def test_buckets_off_sends_each_parameter_alone():
    layers = [TimedLayer("a", 0.0, 0.0, [("w", 100), ("b", 10)]), TimedLayer("c", 0.0, 0.0, [("w", 1000)])]
    assert shard_buckets(layers, -1) == [[0], [1], [2]]
    assert shard_buckets(layers, 500) == [[0, 1], [2]]


def test_cut_params_replays_big_parameters_as_partition_pieces():
    layers = timed_layers(models.get_profile("vgg16"), 100.0, 16.0)
    cut = cut_params(layers, 64 << 10)
    for whole, pieces in zip(layers, cut):
        assert sum(count for _, count in pieces.params) == sum(count for _, count in whole.params)
        assert all(count <= (64 << 10) // 4 for _, count in pieces.params)
    biggest = max(count for layer in layers for _, count in layer.params)
    assert len(shard_buckets(cut, 64 << 10)) >= biggest // ((64 << 10) // 4)
    assert cut_params(layers, 0) == layers
