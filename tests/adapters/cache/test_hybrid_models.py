"""Hybrid models: layers with a recurrent or convolution state (Mamba, gated delta, short
convolutions), and ``"hybrid"`` layers holding both that state and attention KV. The cache keeps
each state as ``DynamicCache(config=...)`` does (transformers' own ``LinearAttentionLayer``) while
the attention layers live in kvlib's pages, and every policy applies to those: budgets count the
attention layers only. Exactness of each model against ``DynamicCache`` is the architecture
walk's (:mod:`tests.adapters.cache.test_architecture_walk`); here, what the policies and the
cache's row operations do on them."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

import kvlib
from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.adapters.cache.state_layers import HybridCacheLayer
from kvlib.model_shape import kv_shape
from kvlib.transformers_compat import DummyLayer, cache_argument
from tests.adapters.cache.architecture_configs import tiny_model
from tests.adapters.conftest import PAD, left_padded

HYBRIDS = ["falcon_h1", "jamba", "qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h", "zamba2"]
"""One of each kind: attention and Mamba in one layer (Falcon-H1, Zamba2), Mamba and attention
layers (Jamba, Granite 4, Nemotron-H, with MoE-only layers), gated delta (Qwen3-Next), short
convolutions (LFM2)."""
POLICIES = ["snapkv", "streaming_llm", "kivi(bits=4)"]
NEW_TOKENS = 6
BUDGET = 10


def _generate(model: torch.nn.Module, cache: object, ids: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
    options = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    return model.generate(input_ids=ids, attention_mask=mask, **cache_argument(cache), **{**options, **kwargs})


@pytest.mark.parametrize("model_type", ["falcon_h1", "jamba", "nemotron_h"])
def test_each_model_layer_keeps_what_dynamic_cache_keeps_there(model_type: str) -> None:
    model = tiny_model(model_type)
    shape = kv_shape(model)
    cache = kvlib.make_cache(model)
    reference = DynamicCache(config=model.config)
    assert len(cache.layers) == len(reference.layers) == shape.num_model_layers
    for ours, theirs in zip(cache.layers, reference.layers):
        if isinstance(theirs, LinearAttentionLayer) and hasattr(theirs, "keys"):  # attention and a state in one layer
            assert isinstance(ours, HybridCacheLayer)
        elif isinstance(theirs, LinearAttentionLayer):
            assert type(ours) is LinearAttentionLayer
        elif isinstance(theirs, DummyLayer):
            assert isinstance(ours, DummyLayer)
        else:
            assert isinstance(ours, KVCacheLayer)
    assert [layer.layer_idx for layer in cache.kv_layers] == list(range(shape.num_layers))  # the store's layers: attention only


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_policies_run_on_the_attention_layers(model_type: str, policy: str) -> None:
    model = tiny_model(model_type)
    shape = kv_shape(model)
    ids, mask = left_padded([30, 23], seed=6)
    evicts = policy != "kivi(bits=4)"
    cache = kvlib.make_cache(model, policy, budget=BUDGET, slack=0) if evicts else kvlib.make_cache(model, policy)
    out = _generate(model, cache, ids, mask)
    assert out.shape == (2, 30 + NEW_TOKENS)
    report = cache.memory_report()
    assert report["by_component"]["unpaged_state"] > 0
    for layer in range(shape.num_layers):  # budgets are per attention layer: state layers hold no tokens
        stored = int((cache.kept_positions(layer) >= 0).sum(-1).max())
        if evicts:
            assert stored <= BUDGET
        elif shape.window(layer) is None:
            assert stored == 30 + NEW_TOKENS - 1  # every token but the last generated one, whose KV no call computed
    if not evicts:
        assert report["by_component"]["codec_metadata"] > 0


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_a_budget_over_the_context_evicts_nothing_and_stays_exact(model_type: str) -> None:
    model = tiny_model(model_type)
    ids, mask = left_padded([21, 14], seed=7)
    reference = _generate(model, DynamicCache(config=model.config), ids, mask)
    assert torch.equal(_generate(model, kvlib.make_cache(model, "snapkv", budget=1000), ids, mask), reference)


@pytest.mark.parametrize("model_type", ["jamba", "zamba2"])
def test_beam_search_moves_the_recurrent_state_with_its_row(model_type: str) -> None:
    model = tiny_model(model_type)
    ids, mask = left_padded([15, 11], seed=8)
    reference = _generate(model, DynamicCache(config=model.config), ids, mask, num_beams=3)
    assert torch.equal(_generate(model, kvlib.make_cache(model), ids, mask, num_beams=3), reference)


def test_a_reset_cache_starts_again_from_an_empty_state() -> None:
    model = tiny_model("jamba")
    ids, mask = left_padded([15], seed=9)
    cache = kvlib.make_cache(model)
    first = _generate(model, cache, ids, mask)
    cache.reset()
    assert torch.equal(_generate(model, cache, ids, mask), first)


def test_prefix_reuse_and_forks_refuse_a_recurrent_state() -> None:
    model = tiny_model("jamba")
    store = kvlib.PrefixStore(model, capacity_bytes=2**20)
    ids, _ = left_padded([20], seed=10)
    with pytest.raises(ValueError, match="recurrent-state layers .*linear_attention.* cannot be resumed"):
        kvlib.make_cache(model, reuse=store, prompt=ids)
    cache = kvlib.make_cache(model)
    _generate(model, cache, ids, torch.ones_like(ids))
    with pytest.raises(ValueError, match="keep state outside the pages"):
        cache.fork()
