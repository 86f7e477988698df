"""keyformer: the seeded Gumbel noise against a pure-integer splitmix64, the Gumbel softmax and its
temperature schedule against a plain computation from the logits, bad parameters refused."""

from __future__ import annotations

import math

import pytest
import torch

from kvlib.policies.eviction.keyformer import Keyformer, gumbel_noise
from tests.policies.eviction.recent_view import assert_ranks_like, recent_view

MASK = (1 << 64) - 1


def splitmix(x: int) -> int:
    """splitmix64's finalizer on an unsigned 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def noise_reference(seed: int, layer: int, head: int, query: int, key: int) -> float:
    """The documented noise, in Python integers: top 53 bits of splitmix64(splitmix64(seed) + layer
    + head * H + query * Q + key * K), plus a half, over 2**53, through -log(-log(u))."""
    x = (splitmix(seed & MASK) + layer + head * 0x9E3779B97F4A7C15 + query * 0xD1B54A32D192ED03 + key * 0x8CB92BA72F3D8DD7) & MASK
    uniform = ((splitmix(x) >> 11) + 0.5) / 2.0**53
    return -math.log(-math.log(uniform))


def test_noise_is_the_documented_function_of_seed_layer_head_and_positions():
    query_positions = torch.tensor([[0, 5, -1], [7, 8, 9]])
    key_positions = torch.tensor([[[0, 3, -1, 4]], [[1, 2, 6, 9]]])
    noise = gumbel_noise(11, 3, query_positions, key_positions, heads=2)
    assert noise.shape == (2, 2, 3, 4)
    for b in range(2):
        for h in range(2):
            for i in range(3):
                for s in range(4):
                    expected = noise_reference(11, 3, h, int(query_positions[b, i]), int(key_positions[b, 0, s]))
                    assert abs(float(noise[b, h, i, s]) - expected) < 1e-5 * max(1.0, abs(expected))
    assert not torch.equal(noise, gumbel_noise(12, 3, query_positions, key_positions, heads=2))


def test_noise_is_standard_gumbel():
    noise = gumbel_noise(0, 0, torch.arange(400).view(1, -1), torch.arange(300).view(1, 1, -1), heads=1).double()
    assert abs(float(noise.mean()) - 0.5772) < 0.01 and abs(float(noise.std()) - math.pi / math.sqrt(6)) < 0.01


@pytest.mark.parametrize("prompt_length", [3, 6])
def test_received_attention_is_the_gumbel_softmax_of_the_logits_with_a_rising_temperature(prompt_length):
    policy = Keyformer(tau_init=1.0, tau_end=3.0, steps=4, seed=5)
    generator = torch.Generator().manual_seed(prompt_length)
    query_positions = torch.tensor([[2, 3, 4, 5, 6, 9]])
    key_positions = torch.arange(10).view(1, 1, 10)
    logits = torch.randn(1, 2, 6, 10, generator=generator) * 3
    visible = key_positions.unsqueeze(2) <= query_positions.view(1, 1, -1, 1)
    weights = torch.softmax(logits.masked_fill(~visible, -torch.inf), dim=-1)
    got = policy.attention_received(weights, query_positions, key_positions, torch.tensor([prompt_length]), layer_idx=2)
    for h in range(2):
        for i, at in enumerate(query_positions[0].tolist()):
            step = min(max(at - prompt_length + 1, 0), 4)  # the first generated token's query is step 1
            tau = 1.0 + step * (3.0 - 1.0) / 4
            seen = [s for s in range(10) if s <= at]
            noisy = torch.tensor([(float(logits[0, h, i, s]) + noise_reference(5, 2, h, at, s)) / tau for s in seen], dtype=torch.float64)
            expected = torch.zeros(10, dtype=torch.float64)
            expected[seen] = torch.softmax(noisy, dim=0)
            torch.testing.assert_close(got[0, h, i].double(), expected, rtol=1e-4, atol=1e-6)


def test_scores_are_the_accumulated_score_under_the_recent_window():
    view = recent_view(1, seed=4)
    view.accumulated_attention = torch.rand(view.valid.shape, generator=torch.Generator().manual_seed(4))
    scores = Keyformer(recent=3).score(view)
    expected = {(b, h, s): float(view.accumulated_attention[b, h, s]) for b, h, s in view.valid.nonzero().tolist()}
    assert_ranks_like(scores, view, 3, expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"recent": -1}, "recent must be >= 0"),
        ({"tau_init": 0.0}, "tau_init must be > 0"),
        ({"tau_init": 2.0, "tau_end": 1.0}, "tau_end must be >= tau_init"),
        ({"steps": 0}, "steps must be >= 1"),
    ],
)
def test_bad_parameters_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Keyformer(**options)
