"""shard=True lays out and settles a parameter used outside its own module where the forward first uses it.

MultiheadAttention passes its out_proj's parameters to a functional call, so out_proj never runs as a
module. Such parameters were sent last and settled before the root module, so the next forward waited
at its start for the last all-gather; they now take the place where an op first used them and are
settled in the module that ran that op (one rank over loopback, about 1 s).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")


class _Net(torch.nn.Module):
    """Embedding, one encoder layer (MultiheadAttention with its out_proj), a head; `extra` is used by the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.block = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(8, 32)
        self.extra = torch.nn.Linear(8, 8, bias=False)  # never called: the root uses its weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden @ self.extra.weight
        return self.head(self.block(hidden))


def _train(first_use: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], list[list[str]], Any]:
    """(priorities, buckets settled in the last forward by name, max difference from plain Adam) after 3 steps."""
    import commsched.torch as ct
    from commsched.torch._shard import ShardedOptimizer

    import commsched

    monkeypatch.setattr(ShardedOptimizer, "_first_use", first_use)
    torch.manual_seed(0)
    model = _Net()
    plain_model = copy.deepcopy(model)
    commsched.init(transport="loopback", bucket_bytes=256)
    try:
        optimizer = ct.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.05), model=model, overlap_forward=True, shard=True
        )
        plain = torch.optim.Adam(plain_model.parameters(), lr=0.05)
        settled: list[list[str]] = []
        land = optimizer._land

        def seen_land(bucket: Any) -> None:
            settled.append([m.label for m in bucket.members])
            land(bucket)

        monkeypatch.setattr(optimizer, "_land", seen_land)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(0, 32, (2, 5), generator=generator)
            settled.clear()
            for net, opt in ((model, optimizer), (plain_model, plain)):
                opt.zero_grad()
                net(tokens).square().mean().backward()
                opt.step()
        last_forward = list(settled)
        optimizer.synchronize()
        difference = max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), plain_model.parameters())
        )
        return optimizer.priorities(), last_forward, difference
    finally:
        commsched.shutdown()


def test_functionally_used_parameters_are_placed_and_settled_where_first_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """out_proj sits between in_proj and linear1 in the order (was last), the root's functional weight
    right after the embedding; the forward settles buckets in that order; training equals plain Adam.
    Without the first-use order (as before) those three are last and settled first, at the root."""
    priorities, settled, difference = _train(True, monkeypatch)
    order = sorted(priorities, key=priorities.__getitem__)
    attention = [name for name in order if name.startswith("block.self_attn")]
    assert attention == [
        "block.self_attn.in_proj_weight",
        "block.self_attn.in_proj_bias",
        "block.self_attn.out_proj.weight",
        "block.self_attn.out_proj.bias",
    ], order
    assert order.index("block.self_attn.out_proj.bias") < order.index("block.linear1.weight"), order
    assert order[:2] == ["embed.weight", "extra.weight"], order
    # The root runs first, so the weight it uses is settled before the embedding, the rest in order.
    landed = [name for names in settled for name in names]
    assert landed[0] == "extra.weight" and landed[1:] == sorted(landed[1:], key=priorities.__getitem__), (
        landed
    )
    assert difference <= 1e-6

    root_priorities, root_settled, root_difference = _train(False, monkeypatch)
    root_order = sorted(root_priorities, key=root_priorities.__getitem__)
    assert set(root_order[-3:]) == {
        "block.self_attn.out_proj.weight",
        "block.self_attn.out_proj.bias",
        "extra.weight",
    }, root_order
    assert "block.self_attn.out_proj.weight" in root_settled[0] + root_settled[1] + root_settled[2]
    assert root_difference <= 1e-6
