"""The drop-in cache on every causal-LM model type transformers ships, walked from its config
mapping: a tiny random-weight model of each (:mod:`tests.adapters.cache.architecture_configs`),
greedy ``generate`` with ``DynamicCache(config=...)`` against ``kvlib.make_cache(model)``, a single
prompt and a left-padded batch. Each model type is exact, or refused before any work with the
one-line ``ValueError`` pinned in :data:`REFUSED`; a new refusal, a crash or one wrong token fails
its own case, named by the model type, so a transformers release that adds a model is checked the
day kvlib upgrades.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.architecture_configs import tiny_config, tiny_model
from tests.adapters.conftest import PAD, left_padded

CAUSAL_LM_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
"""Every model type with a causal-LM class in the installed transformers."""

NEW_TOKENS = 5
PROMPTS = ([12], [12, 7])
"""A single prompt and a left-padded batch, in tokens; longer than the configs' sliding window."""

SKIPPED: dict[str, str] = {
    "gemma3n": "its vision tower is a timm model and timm is not installed (gemma3n_text walks its decoder)",
    "gemma4_assistant": "a drafter whose every layer reads the target model's KV (KV sharing across models): it cannot generate alone",
    "gemma4_unified_assistant": "a drafter whose every layer reads the target model's KV (KV sharing across models): it cannot generate alone",
    "musicgen": "the mapping builds MusicgenForCausalLM from MusicgenConfig, which it does not take (it takes the decoder sub-config)",
    "musicgen_melody": "the mapping builds MusicgenMelodyForCausalLM from MusicgenMelodyConfig, which it does not take (it takes the decoder sub-config)",
}
"""Model types that cannot be built and run from their config class here, each with the reason."""

NO_ATTENTION = "has no attention layer"
OWN_CACHE = "keeps a cache of its own kind"
NO_CACHE = "takes no transformers cache"
REFUSED: dict[str, str] = {
    "deepseek_v4": "has compressed_sparse_attention, heavily_compressed_attention layers",
    "falcon_mamba": NO_ATTENTION,
    "mamba": NO_ATTENTION,
    "mamba2": NO_ATTENTION,
    "minimax": OWN_CACHE,
    "xlstm": OWN_CACHE,
    "openai-gpt": NO_CACHE,
    "reformer": NO_CACHE,
    "rwkv": NO_CACHE,
    "xlnet": NO_CACHE,
    "mllama": "has cross-attention layers",
    "blt": "its config lacks num_hidden_layers",
}
"""Model types ``make_cache`` refuses, and what the refusal says: why kvlib cannot hold their cache."""


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


@pytest.mark.parametrize("model_type", [model_type for model_type in CAUSAL_LM_TYPES if model_type not in SKIPPED])
def test_generate_is_exact_or_refused(model_type: str) -> None:
    """Every model type but those :data:`SKIPPED` lists (not walked, not skipped: a skip for a
    reason other than a missing CUDA device fails CI's ``--strict-skips``)."""
    if model_type in REFUSED:
        _assert_refused(model_type, REFUSED[model_type])
        return
    model = tiny_model(model_type)
    prompts = [left_padded(lengths, seed=1) for lengths in PROMPTS]
    with torch.no_grad():
        references = [_generate(model, DynamicCache(config=model.config), ids, mask) for ids, mask in prompts]
        for (ids, mask), reference in zip(prompts, references):
            ours = _generate(model, kvlib.make_cache(model), ids, mask)
            assert torch.equal(ours, reference), f"{model_type}, batch of {ids.shape[0]}: {ours.tolist()} != {reference.tolist()}"


def _assert_refused(model_type: str, reason: str) -> None:
    """``make_cache`` raises a one-line ``ValueError`` naming the model and ``reason``, before any
    work: the model (built on the meta device: nothing to compute) never runs, its attention
    implementation is untouched."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    implementation = model.config._attn_implementation
    forwards: list[int] = []
    model.register_forward_hook(lambda module, args, out: forwards.append(1))
    with pytest.raises(ValueError, match=reason) as refusal:
        kvlib.make_cache(model)
    assert "\n" not in str(refusal.value) and type(model).__name__ in str(refusal.value)
    assert forwards == [] and model.config._attn_implementation == implementation


def test_the_pinned_lists_name_model_types_transformers_has() -> None:
    listed = set(SKIPPED) | set(REFUSED)
    assert listed <= set(CAUSAL_LM_TYPES), sorted(listed - set(CAUSAL_LM_TYPES))
    assert not set(SKIPPED) & set(REFUSED)
