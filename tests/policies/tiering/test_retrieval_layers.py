"""The page retrieval policies that keep state per layer (``louiskv``, ``specache``, ``tailorkv``,
``leoam``) key it by the ``layer_idx`` given to ``select_pages``, with no ``sparse`` call before:
two layers' decode steps interleaved on one object choose, and leave, what each layer's steps on
an object of its own do."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvlib.policies.tiering.leoam import LeoAM
from kvlib.policies.tiering.louiskv import LouisKV
from kvlib.policies.tiering.specache import SpeCache
from kvlib.policies.tiering.tailorkv import TailorKV
from kvlib.policy import PageRetrieval


def layer_state(policy: PageRetrieval, layer: int) -> object:
    """What ``policy`` keeps for ``layer``, in a form ``==`` compares."""
    if isinstance(policy, LouisKV):
        last = policy.last[layer]
        return policy.retrievals[layer], last.chosen.tolist(), last.since.tolist(), last.seen.tolist(), last.query.tolist()
    if isinstance(policy, SpeCache):
        return policy.speculated[layer].chosen.tolist(), policy.speculated[layer].pages_used.tolist()
    if isinstance(policy, TailorKV):
        return policy.dense[layer]
    assert isinstance(policy, LeoAM)
    return policy.steps[layer], policy.fetched[layer], policy.judged[layer]


@pytest.mark.parametrize(
    "make",
    [
        lambda: LouisKV(top_k=2, threshold=0.6, dense_layers=0),
        lambda: SpeCache(top_k=2, dense_layers=0),
        lambda: TailorKV(top_k=2, dense_share=0.5),
        lambda: LeoAM(top_k=3, chunk_pages=2, desert=2.0, dense_layers=0),
    ],
    ids=["louiskv", "specache", "tailorkv", "leoam"],
)
def test_per_layer_state_follows_the_layer_given_to_select_pages(make: Callable[[], PageRetrieval]) -> None:
    heads, group, dim, pages, layers = 2, 2, 4, 16, (1, 4)
    generator = torch.Generator().manual_seed(11)
    centre = torch.randn(len(layers), 1, heads, pages, dim, generator=generator)
    width = torch.rand(len(layers), 1, heads, pages, dim, generator=generator)
    scale = {1: 0.01, 4: 4.0}  # layer 1's pages nearly alike (tailorkv: dense), layer 4's far apart (sparse)
    bounds = {layer: ((centre[i] - width[i]) * scale[layer], (centre[i] + width[i]) * scale[layer]) for i, layer in enumerate(layers)}
    base = {layer: torch.randn(1, heads * group, 1, dim, generator=generator) for layer in layers}
    used = {1: torch.tensor([[5, 7]]), 4: torch.tensor([[9, 3]])}
    shared, alone = make(), {layer: make() for layer in layers}
    for step in range(6):
        for layer in layers if step % 2 == 0 else layers[::-1]:  # the layers' calls interleaved, in both orders
            used[layer] = used[layer] + torch.tensor([[step % 2, (step + layer) % 2]])
            query = base[layer] + 0.8 * torch.randn(1, heads * group, 1, dim, generator=generator)
            key_min, key_max = bounds[layer]
            chosen = shared.select_pages(layer, query, key_min, key_max, used[layer])
            assert torch.equal(chosen, alone[layer].select_pages(layer, query, key_min, key_max, used[layer])), (step, layer)
            assert layer_state(shared, layer) == layer_state(alone[layer], layer), (step, layer)
    if isinstance(shared, TailorKV):
        assert shared.dense == {1: True, 4: False}  # the two layers were told apart
