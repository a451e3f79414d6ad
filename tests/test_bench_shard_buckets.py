"""The sharded replay buckets gradients as `shard=True` does in training (commsched.bench.replay)."""

from __future__ import annotations

import pytest
import torch
from commsched.torch import _shard_layout

from commsched.bench import models
from commsched.bench.replay import TimedLayer, cut_params, shard_buckets
from commsched.bench.schedule import timed_layers


def _training_buckets(layers: list[TimedLayer], limit: int, ranks: int) -> list[list[int]]:
    """Each bucket's piece sizes as shard=True lays them out (every parameter in forward order)."""
    params = [torch.empty(count) for layer in layers for _, count in layer.params]
    entries = [(p, f"p{i}", i, 0) for i, p in enumerate(params)]
    plans = _shard_layout.plan(entries, list(range(len(params))), limit, ranks)
    return [[piece[5] for piece in bucket] for bucket in plans]


@pytest.mark.parametrize(("model", "ranks"), [("resnet50", 2), ("bert-base", 3), ("vgg16", 2)])
@pytest.mark.parametrize("limit", [0, 64 << 10, 1 << 20])
def test_replay_cuts_the_buckets_training_cuts(model, ranks, limit):
    layers = timed_layers(models.get_profile(model), 100.0, 16.0)
    cut = cut_params(layers, limit, ranks)
    counts = [count for layer in cut for _, count in layer.params]
    replayed = [[counts[p] for p in bucket] for bucket in shard_buckets(cut, limit)]
    assert replayed == _training_buckets(layers, limit, ranks)
    # No limit: one bucket; else small parameters share buckets.
    assert len(replayed) == 1 if limit == 0 else any(len(bucket) > 1 for bucket in replayed)
    biggest = max(4 * count for layer in layers for _, count in layer.params)
    if limit:  # no bucket over the limit: the biggest parameters went as pieces
        assert max(4 * sum(bucket) for bucket in replayed) <= limit
        assert (len(counts) > sum(len(layer.params) for layer in layers)) == (biggest > limit)


def test_buckets_off_sends_each_parameter_alone():
    layers = [TimedLayer("a", 0.0, 0.0, [("w", 100), ("b", 10)]), TimedLayer("c", 0.0, 0.0, [("w", 1000)])]
    assert shard_buckets(layers, -1) == [[0], [1], [2]]
    assert shard_buckets(layers, 500) == [[0, 1], [2]]


def test_cut_params_replays_big_parameters_as_partition_pieces():
    layers = timed_layers(models.get_profile("vgg16"), 100.0, 16.0)
    cut = cut_params(layers, 64 << 10, 3)
    for whole, pieces in zip(layers, cut):
        assert sum(count for _, count in pieces.params) == sum(count for _, count in whole.params)
        assert all(count <= (64 << 10) // 4 for _, count in pieces.params)
        step = (64 << 10) // 4 // 3 * 3  # a multiple of the 3 ranks: no padding
        for name, count in whole.params:
            if 4 * count > 64 << 10:
                sizes = [c for n, c in pieces.params if n.startswith(name + ".")]
                assert sizes == [step] * (count // step) + ([count % step] if count % step else [])
    biggest = max(count for layer in layers for _, count in layer.params)
    assert len(shard_buckets(cut, 64 << 10)) >= biggest // ((64 << 10) // 4)
    assert cut_params(layers, 0) == layers
