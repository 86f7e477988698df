"""Models that do more with what ``cache.update`` returns than attend over it: never silently wrong.

JetMoE repeats the returned keys and values, DiffLlama splits the values and attends twice, Doge
builds a per-head mask from the returned values, Gemma 3n's last layers attend over the keys and
values an earlier layer stored (KV sharing, no ``update`` of their own). kvlib checks each layer's
first call (a prefill, whose ``update`` returns every token) and from then on returns every stored
token to such a model, as ``DynamicCache`` does: greedy ``generate`` equals ``DynamicCache``'s, alone
and left-padded. Eviction applies where the model keeps the returned tokens' slots (DiffLlama,
Gemma 3n: equal to ``DynamicCache`` with the evicted positions masked, step by step) and is refused
in one line before any token is generated where it does not (JetMoE, Doge). A plain model keeps the
fast path (decode steps planned, ``update`` returning the new tokens only)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kvlib
from tests.adapters.conftest import PAD, build_model, left_padded

VOCAB = 97
NEW_TOKENS = 16
MODELS = {
    "jetmoe": dict(kv_channels=16, num_local_experts=2, num_experts_per_tok=2),
    "diffllama": {},
    "doge": dict(keep_window_size=8),
    "gemma3n_text": dict(
        num_hidden_layers=6,
        num_kv_shared_layers=2,
        laurel_rank=8,
        altup_num_inputs=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=16,
        activation_sparsity_pattern=[0.0] * 6,
        intermediate_size=[128] * 6,
    ),
}
"""Each model type's config changes beyond :func:`tiny`'s common sizes."""


def tiny(model_type: str, **changes) -> torch.nn.Module:
    """A seeded random-weight ``model_type`` decoder: 4 layers of width 64, 4 query and 2 KV heads."""
    config = AutoConfig.for_model(model_type)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tokens = dict(vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    for name, value in {**sizes, **tokens, **MODELS[model_type], **changes}.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def greedy(model, cache, ids, mask=None) -> torch.Tensor:
    return model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD
    )


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_exact_against_dynamic_cache(model_type: str) -> None:
    """Greedy tokens equal ``DynamicCache``'s, for one prompt and a left-padded batch; the cache
    says why it returns every token."""
    model = tiny(model_type)
    batch = left_padded([30, 23], seed=2, vocab=VOCAB)
    for ids, mask in [(batch[0][:1], None), batch]:
        expected = greedy(model, DynamicCache(config=model.config), ids, mask)
        cache = kvlib.make_cache(model)
        assert torch.equal(greedy(model, cache, ids, mask), expected)
        assert cache.dense_returns is not None


@pytest.mark.parametrize("model_type, what", [("jetmoe", "changes the keys or values"), ("doge", "builds an attention mask")])
def test_eviction_is_refused_where_the_returned_slots_are_not_kept(model_type: str, what: str) -> None:
    """A model that remixes the returned heads or builds its own mask over them cannot be evicted
    from exactly: refused at the prompt's call, naming what the model does and the policy."""
    model = tiny(model_type)
    ids = left_padded([30], seed=2, vocab=VOCAB)[0]
    with pytest.raises(ValueError, match=rf"{what}.*cannot apply streaming_llm"):
        greedy(model, kvlib.make_cache(model, "streaming_llm", budget=20), ids)


def masked_reference(model, ids: torch.Tensor, tokens: torch.Tensor, cap: int, sinks: int) -> list[torch.Tensor]:
    """``DynamicCache`` logits of the prompt's last token, then of each of ``tokens`` (``[1, n]``,
    fed in turn), each decode step seeing only what StreamingLLM keeps under a held cap of ``cap``
    tokens: the first ``sinks`` positions and the newest ``cap - sinks`` (its own included)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids, cache=cache, use_cache=True).logits[:, -1]]
        for token in tokens.split(1, dim=1):
            length = cache.get_seq_length() + 1
            position = torch.arange(length)
            seen = (position < sinks) | (position > length - 1 - (cap - sinks))
            mask = torch.zeros(1, 1, 1, length).masked_fill_(~seen, torch.finfo(torch.float32).min)
            steps.append(
                model(token, attention_mask=mask, cache=cache, position_ids=torch.tensor([[length - 1]]), use_cache=True).logits[:, -1]
            )
    return steps


@pytest.mark.parametrize("model_type", ["diffllama", "gemma3n_text"])
def test_eviction_where_the_returned_slots_are_kept(model_type: str) -> None:
    """DiffLlama (values split in two halves, attention run twice) and Gemma 3n (two layers
    sharing the keys and values of earlier ones; every layer full attention here, so a 4-D mask
    describes each step) under ``streaming_llm`` at a held cap: each decode step's logits equal
    ``DynamicCache``'s, fed the same tokens, with the positions StreamingLLM dropped masked out."""
    full = {"layer_types": ["full_attention"] * 6} if model_type == "gemma3n_text" else {}
    model = tiny(model_type, **full)
    ids = left_padded([30], seed=4, vocab=VOCAB)[0]
    cap, sinks = 20, 4
    cache = kvlib.make_cache(model, f"streaming_llm(sinks={sinks})", budget=cap)
    out = model.generate(
        ids,
        cache=cache,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = masked_reference(model, ids, out.sequences[:, ids.shape[1] : -1], cap, sinks)
    assert len(expected) == len(out.logits) == NEW_TOKENS
    for ours, theirs in zip(out.logits, expected):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert cache.dense_returns is not None
    assert int(cache.memory_report()["stored_tokens"]) <= cap * cache.shape.num_layers * cache.shape.num_kv_heads


def test_a_plain_model_keeps_the_fast_path() -> None:
    """Llama attends over exactly what ``update`` returns: after the prompt's call checked every
    layer, decode steps are planned for every layer and ``update`` returns the new token only."""
    model = build_model("llama")
    ids, mask = left_padded([20, 13], seed=1, vocab=model.config.vocab_size)
    cache = kvlib.make_cache(model)
    returned: list[int] = []
    update = cache.update

    def counting(key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = update(key_states, value_states, layer_idx, *args, **kwargs)
        returned.append(keys.shape[2])
        return keys, values

    cache.update = counting
    greedy(model, cache, ids, mask)
    layers = cache.shape.num_layers
    assert returned[:layers] == [20] * layers and set(returned[layers:]) == {1}
    assert cache.dense_returns is None and all(layer.checked for layer in cache.layers)
