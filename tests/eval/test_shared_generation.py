"""A shared prefill gives every configuration what it would get alone: generated tokens, kept
positions and cache bytes equal those of a separate ``generate`` with the configuration's own
cache, for every registered eviction policy, the codecs and compositions; configurations that
cannot share are refused with their reason."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.eval.shared_generation import generate_shared, shares
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

NEW_TOKENS = 6
EVICTIONS = kvlib.available_policies()["eviction"]
CODECS = ["kivi(bits=2)", "svd", "snapkv+kivi(bits=2)"]
"""Codecs and a composition (a few: their kernels compile on first use, which costs seconds)."""


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("llama")


def factory(model: torch.nn.Module, spec: str | None, fraction: float | None):
    if fraction is None:
        return lambda tokens: kvlib.make_cache(model, spec, page_size=4)
    return lambda tokens: kvlib.make_cache(model, spec, budget=max(1, round(fraction * tokens)), page_size=4)


def separate(model: torch.nn.Module, make, ids: torch.Tensor, mask: torch.Tensor):
    cache = make(ids.shape[1])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD
        )
    return out[:, ids.shape[1] :], cache


def assert_shared_equals_separate(model: torch.nn.Module, configs: list[tuple[str | None, float | None]]) -> None:
    ids, mask = left_padded([30, 21], seed=3)
    factories = [factory(model, spec, fraction) for spec, fraction in configs]
    sharing = [shares(model, make) for make in factories]
    assert [s.refusal for s in sharing] == [None] * len(configs)
    needs = sharing[0].needs
    for s in sharing[1:]:
        needs = needs | s.needs
    shared = list(generate_shared(model, ids, mask, factories, needs, max_new_tokens=NEW_TOKENS, pad=PAD))
    for (spec, fraction), make, generation in zip(configs, factories, shared):
        assert generation.error is None, (spec, generation.error)
        tokens, cache = separate(model, make, ids, mask)
        assert torch.equal(generation.tokens, tokens), (spec, fraction)
        for layer in range(cache.shape.num_layers):
            assert torch.equal(generation.cache.kept_positions(layer), cache.kept_positions(layer)), (spec, layer)
        assert generation.cache.memory_report()["by_component"] == cache.memory_report()["by_component"], spec


@pytest.mark.parametrize("policy", EVICTIONS)
def test_every_eviction_policy_shares_a_prefill_exactly(model: torch.nn.Module, policy: str) -> None:
    assert_shared_equals_separate(model, [(policy, 0.3)])


def test_the_full_cache_codecs_and_a_composition_share_a_prefill_exactly(model: torch.nn.Module) -> None:
    assert_shared_equals_separate(model, [(None, None)] + [(spec, 0.3 if "+" in spec else None) for spec in CODECS])


def test_caches_replayed_after_one_another_reuse_its_attention_and_still_equal_separate_runs(model: torch.nn.Module) -> None:
    """The replays share the attention they accumulate from the prompt call (the recorder's memo):
    the same policy at other budgets, inside a composition, and policies whose fields change
    what they accumulate (keyformer's seed) each still equal their separate run."""
    configs = [
        ("h2o(recent=2)", 0.2),
        ("h2o(recent=2)", 0.5),
        ("h2o(recent=2)+kivi(bits=2)", 0.3),
        ("keyformer(recent=2)", 0.3),
        ("keyformer(recent=2,seed=1)", 0.3),  # keeps other positions than seed 0 here
        ("vatp(recent=2)", 0.3),
    ]
    assert_shared_equals_separate(model, configs)


@pytest.fixture(scope="module")
def gemma() -> torch.nn.Module:
    return build_model("gemma3")


def test_sliding_window_layers_past_their_window_share_a_prefill_exactly(gemma: torch.nn.Module) -> None:
    """Gemma 3's layer mix: the prompt (30 tokens) passes the sliding layers' window (16), so the
    source frees what left it; the replays get the whole prompt the call stored."""
    configs = [(None, None), ("snapkv", 0.3), ("h2o(recent=2)", 0.3), ("h2o(recent=2)", 0.6), ("streaming_llm", 0.5)]
    configs += [("kivi(bits=2)", None), ("snapkv+kivi(bits=2)", 0.3)]
    assert_shared_equals_separate(gemma, configs)
