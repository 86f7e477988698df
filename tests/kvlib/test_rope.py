"""RoPE re-rotation: keys computed for a chunk on its own, moved to the chunk's place in a longer
prompt, equal the keys the model computes there (layer 0, where keys depend on the token and
its position only)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlib.model_shape import kv_shape, rope_of
from kvlib.policy import Rope
from kvlib.rope import rerotate
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model


def layer0_keys(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(cache), use_cache=True)
    return cache.layers[0].keys


@pytest.mark.parametrize("family", ["default", "llama", "qwen2"])
def test_rerotated_layer0_keys_equal_keys_computed_at_the_new_positions(family: str) -> None:
    model = build_model(family)
    shape = kv_shape(model)
    rope = rope_of(model, shape)
    generator = torch.Generator().manual_seed(0)
    vocab = min(model.config.vocab_size, 500)
    chunk = torch.randint(3, vocab, (1, 24), generator=generator)
    before = torch.randint(3, vocab, (1, 37), generator=generator)
    alone = layer0_keys(model, chunk)  # positions 0..23
    placed = layer0_keys(model, torch.cat([before, chunk], 1))[:, :, 37:]  # positions 37..60
    moved = rerotate(alone, 37, rope)
    assert torch.allclose(moved, placed, atol=1e-5), float((moved - placed).abs().max())
    back = rerotate(placed, torch.full((24,), -37), rope)  # and back, per-token shifts
    assert torch.allclose(back, alone, atol=1e-5)


def test_rotation_composes_and_keeps_norms() -> None:
    rope = Rope(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    keys = torch.randn(2, 5, 8)
    twice = rerotate(rerotate(keys, 3, rope), 4, rope)
    assert torch.allclose(twice, rerotate(keys, 7, rope), atol=1e-6)
    assert torch.allclose(twice.norm(dim=-1), keys.norm(dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match="rope covers 8 channels"):
        rerotate(torch.randn(2, 5, 6), 1, rope)
