"""knorm, keydiff and random: scores against straightforward per-token computations."""

from __future__ import annotations

import math

import torch

from kvlib.policies.eviction.keydiff import KeyDiff
from kvlib.policies.eviction.knorm import KNorm
from kvlib.policies.eviction.random import Random
from kvlib.policy import LayerView


def _view(batch=2, heads=3, slots=7, dim=4, seed=0, layer=0) -> LayerView:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, slots, dim, generator=generator)
    valid = torch.ones(batch, heads, slots, dtype=torch.bool)
    valid[0, :, :2] = False  # left padding of row 0
    positions = torch.where(valid, torch.arange(slots) - (~valid).sum(-1, keepdim=True), -1)
    return LayerView(layer, 4, keys, keys.clone(), positions, valid)


def test_knorm_scores_minus_the_key_norm():
    view = _view()
    scores = KNorm().score(view)
    for b in range(2):
        for h in range(3):
            for s in range(7):
                norm = math.sqrt(sum(float(x) ** 2 for x in view.keys[b, h, s]))
                assert math.isclose(float(scores[b, h, s]), -norm, rel_tol=1e-5)


def test_keydiff_scores_minus_the_cosine_to_the_mean_valid_key():
    view = _view(seed=1)
    scores = KeyDiff().score(view)
    for b in range(2):
        for h in range(3):
            valid_keys = [view.keys[b, h, s].tolist() for s in range(7) if view.valid[b, h, s]]
            mean = [sum(column) / len(valid_keys) for column in zip(*valid_keys)]
            for s in range(7):
                key = view.keys[b, h, s].tolist()
                dot = sum(x * y for x, y in zip(key, mean))
                cosine = dot / (math.sqrt(sum(x * x for x in key)) * math.sqrt(sum(y * y for y in mean)))
                assert math.isclose(float(scores[b, h, s]), -cosine, rel_tol=1e-4, abs_tol=1e-6)


def test_random_is_reproducible_per_seed_and_layer_and_uniform():
    view = _view()
    first, again = Random(seed=3).score(view), Random(seed=3).score(view)
    assert torch.equal(first, again)
    assert not torch.equal(first, Random(seed=4).score(view))
    assert not torch.equal(first, Random(seed=3).score(_view(layer=1)))
    assert ((first[view.valid] >= 0) & (first[view.valid] < 1)).all() and (first[~view.valid] == -torch.inf).all()


def test_random_scores_follow_tokens_not_slots():
    """A token keeps its score while stored (so decode-time eviction keeps a random subset, not
    fixed slots), and the scores are spread uniformly."""
    view = _view()
    scores = Random().score(view)
    shifted = LayerView(0, 4, view.keys[..., 1:, :], view.values[..., 1:, :], view.positions[..., 1:], view.valid[..., 1:])
    assert torch.equal(Random().score(shifted), scores[..., 1:])
    positions = torch.arange(20_000).view(1, 1, -1)
    many = LayerView(0, 1, torch.zeros(1, 1, 20_000, 2), torch.zeros(1, 1, 20_000, 2), positions, positions >= 0)
    histogram = torch.histc(Random().score(many).float(), bins=10, min=0, max=1)
    assert (histogram - 2000).abs().max() < 200
