"""Layers of different KV layouts in one model: MiMo-V2-Flash (its sliding layers have twice the KV
heads of its full ones, and keys wider than values) and Gemma 4 (wider heads on its global layers,
``head_dim`` a per-layer attribute of its config). Each layer's pages, codec and budget follow its
own layout: exact against ``DynamicCache``, with an eviction policy and a codec running too, and
decode steps planned for every layer at once where every layer has the same KV heads."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.model_shape import kv_shape
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.architecture_configs import tiny_model
from tests.adapters.conftest import PAD, left_padded

MODELS = ["mimo_v2_flash", "gemma4_text"]
NEW_TOKENS = 8


def _generate(model: torch.nn.Module, cache: object, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=PAD,
        **cache_argument(cache),
    )


def test_the_shape_is_read_per_layer() -> None:
    mimo = kv_shape(tiny_model("mimo_v2_flash"))  # layer 0 full attention, the others sliding
    assert mimo.layer_kv_heads == (2, 4, 4, 4) and mimo.layer_head_dims == (12,) * 4 and mimo.layer_value_dims == (8,) * 4
    gemma = kv_shape(tiny_model("gemma4_text"))  # sliding, sliding, sliding, global
    assert gemma.layer_head_dims == (16, 16, 16, 32) and gemma.layer_kv_heads == (2, 2, 2, 2)
    assert not mimo.uniform and not gemma.uniform
    with pytest.raises(ValueError, match=r"layers differ in kv_heads \(\[2, 4, 4, 4\]\)"):
        mimo.num_kv_heads  # noqa: B018  (code that assumes one layout is told, not handed layer 0's)


@pytest.mark.parametrize("model_type", MODELS)
def test_exact_against_dynamic_cache(model_type: str) -> None:
    model = tiny_model(model_type)
    shape = kv_shape(model)
    for lengths in ([21], [21, 14]):
        ids, mask = left_padded(lengths, seed=2)
        reference = _generate(model, DynamicCache(config=model.config), ids, mask)
        cache = kvlib.make_cache(model)
        assert torch.equal(_generate(model, cache, ids, mask), reference)
        pools = cache.store.pools
        assert [pool.head_dim for pool in pools] == list(shape.layer_head_dims)
        assert [pool.value_dim for pool in pools] == list(shape.layer_value_dims)
        assert [table.num_heads for table in cache.store.tables] == list(shape.layer_kv_heads)


@pytest.mark.parametrize("model_type", MODELS)
def test_an_eviction_policy_and_a_codec_hold_each_layers_budget(model_type: str) -> None:
    model = tiny_model(model_type)
    shape = kv_shape(model)
    ids, mask = left_padded([40, 33], seed=3)
    budget = 24  # over a page (16 tokens): kept pages are sealed, through the codec
    cache = kvlib.make_cache(model, "snapkv+kivi(bits=4)", budget=budget, slack=0)
    out = _generate(model, cache, ids, mask)
    assert out.shape == (2, 40 + NEW_TOKENS)
    for layer in range(shape.num_layers):
        kept = cache.kept_positions(layer)
        assert kept.shape[1] == shape.layer_kv_heads[layer]
        assert int((kept >= 0).sum(-1).max()) <= budget
    assert cache.memory_report()["by_component"]["codec_metadata"] > 0  # sealed pages went through the codec


@pytest.mark.parametrize("model_type", MODELS)
def test_a_budget_over_the_context_evicts_nothing_and_stays_exact(model_type: str) -> None:
    model = tiny_model(model_type)
    ids, mask = left_padded([21, 14], seed=4)
    reference = _generate(model, DynamicCache(config=model.config), ids, mask)
    for spec in ("snapkv", "streaming_llm"):
        assert torch.equal(_generate(model, kvlib.make_cache(model, spec, budget=1000), ids, mask), reference), spec


@pytest.mark.parametrize(("model_type", "planned"), [("gemma4_text", True), ("mimo_v2_flash", False)])
def test_decode_steps_are_planned_where_every_layer_has_the_same_kv_heads(model_type: str, planned: bool) -> None:
    model = tiny_model(model_type)
    ids, _ = left_padded([20], seed=5)
    reference = _generate(model, DynamicCache(config=model.config), ids, torch.ones_like(ids))
    cache = kvlib.make_cache(model)
    plans = []
    model.register_forward_hook(lambda module, args, out: plans.append(cache.planned is not None))
    assert torch.equal(_generate(model, cache, ids, torch.ones_like(ids)), reference)
    assert plans[0] is False and set(plans[1:]) == {planned}  # the prompt call is never planned
