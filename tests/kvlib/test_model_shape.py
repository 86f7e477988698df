"""Attention shapes: compressed-KV models are refused by ``make_cache`` and ``Engine`` before anything
is built or run; multi-head latent attention is served densely by ``make_cache`` (its latent paged)
and refused by the Engine; key and value heads of different sizes are held as they are."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    MiMoV2FlashConfig,
    MiMoV2FlashForCausalLM,
    MiniCPM3Config,
    MiniCPM3ForCausalLM,
)

import kvlib
from kvlib.model_shape import kv_shape, model_context
from kvlib.storage.store.paged_store import PagedStore
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, VOCAB, build_model

MLA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    pad_token_id=PAD,
)
MOE_SIZES = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
MOE = dict(MOE_SIZES, first_k_dense_replace=1)
UNSUPPORTED = {
    "deepseek_v4": (
        lambda: DeepseekV4ForCausalLM(
            DeepseekV4Config(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                head_dim=32,
                q_lora_rank=16,
                o_lora_rank=16,
                index_head_dim=16,
                index_n_heads=4,
                pad_token_id=PAD,
                **MOE_SIZES,
            )
        ),
        "has heavily_compressed_attention layers, whose cache keeps compressed KV",
    ),
}
"""Small random models kvlib cannot cache: how to build each, and what its refusal must say."""


@pytest.fixture
def nothing_built(monkeypatch):
    """Counts paged stores built and prefix stores opened while the test runs."""
    built: list[str] = []
    paged_init, prefix_init = PagedStore.__init__, kvlib.PrefixStore.__init__
    monkeypatch.setattr(PagedStore, "__init__", lambda self, *a, **k: built.append("paged") or paged_init(self, *a, **k))
    monkeypatch.setattr(kvlib.PrefixStore, "__init__", lambda self, *a, **k: built.append("prefix") or prefix_init(self, *a, **k))
    return built


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_attention_is_refused_before_any_work(name: str, nothing_built: list[str]) -> None:
    build, message = UNSUPPORTED[name]
    torch.manual_seed(0)
    model = build()
    implementation = model.config._attn_implementation
    forwards: list[int] = []
    model.register_forward_hook(lambda module, args, out: forwards.append(1))
    with pytest.raises(ValueError, match=message):
        kvlib.make_cache(model)
    with pytest.raises(ValueError, match=message):
        kvlib.Engine(model, page_budget_bytes=2**20)
    assert nothing_built == [] and forwards == []
    assert model.config._attn_implementation == implementation  # kvlib's attention was never attached


MLA_MODELS = {
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**MLA, **MOE, n_group=1, topk_group=1)),
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(**MLA, **MOE)),
    "minicpm3": lambda: MiniCPM3ForCausalLM(MiniCPM3Config(**MLA)),
}


@pytest.mark.parametrize("name", sorted(MLA_MODELS))
def test_multi_head_latent_attention_pages_the_latent_and_is_served_densely(name: str) -> None:
    torch.manual_seed(0)
    model = MLA_MODELS[name]().eval()
    shape = kv_shape(model)
    assert shape.latent and shape.layer_kv_heads == (1, 1) and shape.layer_head_dims == (16, 16) and shape.layer_value_dims == (8, 8)
    prompts = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))
    reference = model.generate(prompts, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model)
    assert torch.equal(model.generate(prompts, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD), reference)
    assert cache.store.pools[0].head_dim == 16 and cache.memory_report()["by_component"]["pages"] > 0
    with pytest.raises(ValueError, match="expands into keys and values itself, so kvlib serves its cache densely"):
        kvlib.make_cache(model, "snapkv", budget=8)
    with pytest.raises(ValueError, match="the engine attends over packed pages .* multi-head latent attention"):
        kvlib.Engine(model, page_budget_bytes=2**20)


def mimo() -> torch.nn.Module:
    """A small random MiMo-V2-Flash: keys of 12 channels per head, values of 8, all layers full attention."""
    torch.manual_seed(0)
    config = MiMoV2FlashConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        v_head_dim=8,
        layer_types=["full_attention"] * 2,
        use_sliding_window=False,
        pad_token_id=PAD,
        **MOE_SIZES,
    )
    return MiMoV2FlashForCausalLM(config).eval()


def test_key_and_value_heads_of_different_sizes_are_held_exactly() -> None:
    model = mimo()
    shape = kv_shape(model)
    assert (shape.num_kv_heads, shape.head_dim, shape.value_dim) == (2, 12, 8)
    prompts = torch.randint(3, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    reference = model.generate(prompts, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model)
    assert torch.equal(model.generate(prompts, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD), reference)
    assert cache.store.pools[0].value_dim == 8
    engine = kvlib.Engine(model, max_batch_tokens=32)
    assert engine.generate(prompts.tolist(), max_new_tokens=6) == reference[:, 37:].tolist()


def test_the_context_is_what_the_config_declares() -> None:
    assert [model_context(build_model(family)) for family in ("llama", "gpt2", "default")] == [2048, 128, 1024]
    undeclared = types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda decoder: types.SimpleNamespace()))
    assert model_context(undeclared) is None  # a config without max_position_embeddings
