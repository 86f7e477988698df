"""tova: the last query's attention, averaged over each KV group's query heads."""

from __future__ import annotations

import torch

from kvlib.policies.eviction.tova import TOVA
from kvlib.strategy import LayerView


def test_tova_averages_the_last_row_over_each_group():
    batch, kv_heads, groups, queries, slots = 2, 2, 3, 4, 6
    generator = torch.Generator().manual_seed(0)
    attention = torch.softmax(torch.randn(batch, kv_heads * groups, queries, slots, generator=generator), dim=-1)
    keys = torch.zeros(batch, kv_heads, slots, 2)
    valid = torch.ones(batch, kv_heads, slots, dtype=torch.bool)
    view = LayerView(0, 1, keys, keys, torch.arange(slots).expand(batch, kv_heads, slots), valid, attention=attention)
    scores = TOVA().score(view)
    for b in range(batch):
        for h in range(kv_heads):
            for s in range(slots):
                expected = sum(float(attention[b, h * groups + j, -1, s]) for j in range(groups)) / groups
                assert abs(float(scores[b, h, s]) - expected) < 1e-6
    assert TOVA.needs == frozenset({"attention"})
