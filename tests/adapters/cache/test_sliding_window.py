"""Sliding-window layers (Gemma 3's mix: five sliding layers to each global one): the exact cache
generates what ``DynamicCache`` does, token for token, while each sliding layer frees what left
its window; under eviction and codecs generation runs and a sliding layer still never holds more
than its window."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.model_shape import kv_shape
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import GEMMA3_WINDOW, PAD, build_model, left_padded

WINDOW = GEMMA3_WINDOW
SLIDING = [0, 1, 2, 3, 4]
"""The sliding layers of the ``gemma3`` test family; layer 5 is global."""


def _generate(model, cache, ids, mask, **kwargs):
    torch.manual_seed(0)
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        **cache_argument(cache),
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=PAD,
        **kwargs,
    )


class HeldTokens:
    """The most tokens each layer's heads hold right after each of its attention calls (the
    layer's work after attention, eviction and sliding included, has run by then)."""

    def __init__(self, model, cache) -> None:
        self.most: dict[int, int] = {}
        self.handles = [
            module.register_forward_hook(self._hook(cache, module.layer_idx))
            for module in model.modules()
            if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "o_proj")
        ]

    def _hook(self, cache, layer: int):
        def record(*_) -> None:
            held = int(cache.store.physical_lengths(layer, cache.rows).max())
            self.most[layer] = max(self.most.get(layer, 0), held)

        return record

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def test_gemma3_and_mistral_windows_are_read_per_layer():
    assert kv_shape(build_model("gemma3")).windows == (WINDOW,) * 5 + (None,)
    assert kv_shape(build_model("mistral")).windows == (8, 8)  # no layer_types: every layer slides
    assert kv_shape(build_model("llama")).windows == ()
    assert kv_shape(build_model("qwen2")).windows == ()  # use_sliding_window off


@pytest.mark.parametrize(
    "mode",
    [
        dict(do_sample=False, max_new_tokens=24),
        dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=12),
        dict(do_sample=False, num_beams=3, max_new_tokens=8),
    ],
    ids=["greedy", "sampling", "beam"],
)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gemma3_exact_cache_matches_dynamic_cache_and_frees_the_window(mode, attention):
    model = build_model("gemma3", attn_implementation=attention)
    ids, mask = left_padded([9, 30, 41], seed=1)  # one prompt within the window, two past it
    reference = _generate(model, DynamicCache(config=model.config), ids, mask, **mode)
    cache = kvlib.make_cache(model)
    held = HeldTokens(model, cache)
    ours = _generate(model, cache, ids, mask, **mode)
    held.close()
    assert torch.equal(reference.sequences, ours.sequences)
    for ref_scores, our_scores in zip(reference.scores, ours.scores):
        finite = torch.isfinite(ref_scores)
        assert torch.equal(finite, torch.isfinite(our_scores))
        torch.testing.assert_close(our_scores[finite], ref_scores[finite], atol=1e-4, rtol=1e-5)
    assert all(held.most[layer] == WINDOW - 1 for layer in SLIDING)  # DynamicCache's sliding layers keep window - 1
    logical = cache.layers[5].seen
    assert int(cache.store.physical_lengths(5, cache.rows).min()) == logical  # the global layer keeps every token
    report = cache.memory_report()
    assert report["stored_tokens"] == len(cache.rows) * (5 * (WINDOW - 1) + logical)
    assert report["full_equivalent_bytes"] == report["stored_tokens"] * (32 + 32) * 4  # what DynamicCache holds, float32


def test_a_sliding_layer_frees_its_pages():
    """Pages a sliding layer no longer needs go back to the pool: the exact cache of a long prompt
    holds the global layer's pages and a window's worth for each sliding layer."""
    model = build_model("gemma3")
    ids, mask = left_padded([120], seed=2)
    cache = kvlib.make_cache(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
    lengths = [int(cache.store.physical_lengths(layer, cache.rows).max()) for layer in range(6)]
    assert lengths == [WINDOW - 1] * 5 + [120]
    token_bytes = (32 + 32) * 4
    assert cache.memory_report()["by_component"]["pages"] <= token_bytes * (5 * 2 * cache.page_size + 128)  # not 6 * 128 tokens


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "streaming_llm", "kivi(bits=4)", "snapkv+kivi(bits=2)"])
@pytest.mark.parametrize("budget", [0.5, 24])
def test_gemma3_under_eviction_and_codecs_never_holds_more_than_the_window(spec, budget):
    model = build_model("gemma3")
    ids, mask = left_padded([20, 47], seed=3)
    evicts = not spec.startswith("kivi")
    cache = kvlib.make_cache(model, spec, budget=budget if evicts else None)
    held = HeldTokens(model, cache)
    out = _generate(model, cache, ids, mask, do_sample=False, max_new_tokens=20)
    held.close()
    assert out.sequences.shape == (2, ids.shape[1] + 20)
    assert all(held.most[layer] <= WINDOW - 1 for layer in SLIDING), held.most
    if evicts and isinstance(budget, int):
        assert held.most[5] <= budget + cache.page_size  # the global layer holds its cap (a page of slack at most)
    kept = cache.kept_positions(0)  # counted from each row's first real token
    seen = (cache.layers[0].seen - cache.padding.cpu()).view(-1, 1, 1)
    assert bool(((kept < 0) | (kept > seen - WINDOW)).all())  # nothing older than the window survives


def test_mistral_exact_cache_slides_every_layer():
    model = build_model("mistral")
    ids, mask = left_padded([5, 19], seed=4)
    reference = _generate(model, DynamicCache(config=model.config), ids, mask, do_sample=False, max_new_tokens=16)
    cache = kvlib.make_cache(model)
    ours = _generate(model, cache, ids, mask, do_sample=False, max_new_tokens=16)
    assert torch.equal(reference.sequences, ours.sequences)
    assert [int(cache.store.physical_lengths(layer, cache.rows).max()) for layer in range(2)] == [7, 7]


def test_a_sliding_layer_past_its_window_refuses_to_crop():
    model = build_model("gemma3")
    ids, mask = left_padded([40], seed=5)
    cache = kvlib.make_cache(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
    assert not cache.layers[0].is_croppable and cache.layers[5].is_croppable
    with pytest.raises(ValueError, match="slides over a window of 16 tokens"):
        cache.crop(-3)
