"""Exactness of KVCache with no spec: every generation mode equals DynamicCache, token for token.

Each reference runs first, on the model as the user built it (plain SDPA or eager, DynamicCache);
then ``make_cache`` attaches kvlib and the same call runs with the kvlib cache.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, assert_same_logits, build_model, left_padded

pytestmark = pytest.mark.smoke  # the adapter's contract with transformers: CI runs it on the oldest release too


def _generate(model, cache_factory, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return model.generate(
        **cache_argument(cache_factory(model)),
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=PAD,
        **kwargs,
    )


def _dynamic(model):
    return DynamicCache(config=model.config)


def _assert_same(reference, ours) -> None:
    assert torch.equal(reference.sequences, ours.sequences)
    for ref_scores, our_scores in zip(reference.scores, ours.scores):
        finite = torch.isfinite(ref_scores)
        assert torch.equal(finite, torch.isfinite(our_scores))
        # the exact cache's decode steps attend over the pages with kvlib's kernel, not SDPA's:
        # float32 rounding of another summation order, relative to the scores' size
        torch.testing.assert_close(our_scores[finite], ref_scores[finite], atol=1e-4, rtol=1e-5)


MODES = {
    "greedy": dict(do_sample=False, max_new_tokens=12),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=12),
    "beam": dict(do_sample=False, num_beams=3, max_new_tokens=8),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_matches_dynamic_cache_on_a_left_padded_batch(family, mode):
    model = build_model(family)
    ids, mask = left_padded([7, 13, 19], seed=1)
    reference = _generate(model, _dynamic, input_ids=ids, attention_mask=mask, **MODES[mode])
    ours = _generate(model, kvlib.make_cache, input_ids=ids, attention_mask=mask, **MODES[mode])
    assert model.config._attn_implementation == "kvlib_sdpa"
    _assert_same(reference, ours)


def test_single_prompt_greedy_logits_match_within_1e_5(family):
    model = build_model(family)
    ids, _ = left_padded([21], seed=2)
    reference = _generate(model, _dynamic, input_ids=ids, do_sample=False, max_new_tokens=16)
    ours = _generate(model, kvlib.make_cache, input_ids=ids, do_sample=False, max_new_tokens=16)
    _assert_same(reference, ours)


def test_eager_attention_matches_and_stays_eager(family):
    model = build_model(family, attn_implementation="eager")
    ids, mask = left_padded([6, 12, 18], seed=3)
    reference = _generate(model, _dynamic, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    ours = _generate(model, kvlib.make_cache, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert model.config._attn_implementation == "kvlib_eager"
    _assert_same(reference, ours)


@pytest.mark.parametrize("family", ["llama", "gpt2", "default"])
def test_assisted_generation_crops_like_dynamic_cache(family):
    model = build_model(family)
    assistant = build_model(family)
    with torch.no_grad():  # a different draft model, so some drafts are rejected and the cache is cropped
        for parameter in assistant.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    ids, _ = left_padded([15], seed=4)
    kwargs = dict(input_ids=ids, do_sample=False, max_new_tokens=20, assistant_model=assistant)
    reference = _generate(model, _dynamic, **kwargs)
    ours = _generate(model, kvlib.make_cache, **kwargs)
    assert torch.equal(reference.sequences, ours.sequences)


def test_prompt_lookup_decoding_matches():
    model = build_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    kwargs = dict(input_ids=ids, do_sample=False, max_new_tokens=12, prompt_lookup_num_tokens=3)
    reference = _generate(model, _dynamic, **kwargs)
    ours = _generate(model, kvlib.make_cache, **kwargs)
    assert torch.equal(reference.sequences, ours.sequences)


def _prefill(model, cache, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **cache_argument(cache))


def _next_logits(model, cache, token, mask):
    with torch.no_grad():
        return model(input_ids=token, attention_mask=mask, **cache_argument(cache)).logits


@pytest.mark.parametrize("operation", ["repeat", "select", "reorder"])
def test_batch_operations_match_dynamic_cache(operation):
    model = build_model("llama")
    ids, mask = left_padded([5, 9, 12], seed=5)
    index = {"repeat": None, "select": torch.tensor([2, 0]), "reorder": torch.tensor([1, 1, 0])}[operation]
    logits = []
    for cache in (DynamicCache(config=model.config), kvlib.make_cache(model)):
        _prefill(model, cache, ids, mask)
        if operation == "repeat":
            cache.batch_repeat_interleave(2)
            rows = torch.arange(3).repeat_interleave(2)
        elif operation == "select":
            cache.batch_select_indices(index)
            rows = index
        else:
            cache.reorder_cache(index)
            rows = index
        step_mask = torch.cat([mask[rows], torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        token = torch.full((len(rows), 1), 11)
        logits.append(_next_logits(model, cache, token, step_mask))
    assert_same_logits(logits[0], logits[1])


def test_reset_then_reuse_with_another_batch_equals_a_fresh_cache():
    model = build_model("default")
    cache = kvlib.make_cache(model)
    first, _ = left_padded([10], seed=6)
    model.generate(first, **cache_argument(cache), do_sample=False, max_new_tokens=5, pad_token_id=PAD)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_report()["by_component"]["pages"] == 0
    ids, mask = left_padded([4, 9], seed=7)
    again = model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    fresh = model.generate(
        ids, attention_mask=mask, **cache_argument(kvlib.make_cache(model)), do_sample=False, max_new_tokens=6, pad_token_id=PAD
    )
    assert torch.equal(again, fresh)


def test_crop_then_continue_equals_never_having_seen_the_tokens():
    model = build_model("llama")
    ids, _ = left_padded([12], seed=8)
    cropped, fresh = kvlib.make_cache(model), kvlib.make_cache(model)
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(cropped))
        cropped.crop(-4)
        model(input_ids=ids[:, :8], **cache_argument(fresh))
        token = torch.tensor([[9]])
        assert cropped.get_seq_length() == 8
        after_crop = model(input_ids=token, **cache_argument(cropped)).logits
        never_seen = model(input_ids=token, **cache_argument(fresh)).logits
    assert_same_logits(after_crop, never_seen)  # the reads' memory layouts differ: SDPA may round differently
    with pytest.raises(ValueError, match="negative int"):
        cropped.crop(3)


def test_memory_report_counts_what_is_held():
    model = build_model("default")
    cache = kvlib.make_cache(model, page_size=8)
    ids, _ = left_padded([20], seed=9)
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(cache))
    report = cache.memory_report()
    shape = cache.shape
    element = 4
    assert report["full_equivalent_bytes"] == shape.num_layers * shape.num_kv_heads * 20 * (shape.head_dim + shape.value_dim) * element
    pages_per_head = 3  # 20 tokens in pages of 8
    assert report["by_component"]["pages"] == shape.num_layers * shape.num_kv_heads * pages_per_head * 8 * 2 * shape.head_dim * element
    assert report["total_bytes"] == sum(report["by_component"].values()) == report["by_tier"]["device"]
    assert report["stored_tokens"] == report["logical_tokens"] == shape.num_layers * shape.num_kv_heads * 20
    assert kvlib.make_cache(model).memory_report()["total_bytes"] == 0


def test_attach_touches_only_the_given_model():
    model, other = build_model("llama"), build_model("llama")
    kvlib.make_cache(model)
    assert model.config._attn_implementation == "kvlib_sdpa"
    assert other.config._attn_implementation == "sdpa"
    ids, _ = left_padded([9], seed=10)
    reference = build_model("llama").generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    assert torch.equal(other.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=PAD), reference)
    assert kvlib.attach(model) is model and model.config._attn_implementation == "kvlib_sdpa"


def test_a_cache_refuses_a_second_thread_in_one_line_and_is_handed_over_by_reset() -> None:
    """A cache used by two threads at once wrote wrong output with no error (as DynamicCache
    does); kvlib records the thread of its first model call and refuses another, before any work.
    A cache made in one thread may be used by another; after reset() any thread may take it."""
    model = build_model("llama")
    ids, _ = left_padded([12])
    reference = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    outcome: dict[str, object] = {}

    def generate(cache: kvlib.KVCache) -> torch.Tensor:
        return model.generate(ids, **cache_argument(cache), max_new_tokens=5, do_sample=False, pad_token_id=PAD)

    def in_thread(action) -> object:
        def run() -> None:
            try:
                outcome["result"] = action()
            except Exception as error:  # noqa: BLE001 - the test reads what the thread got
                outcome["result"] = error

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return outcome["result"]

    made_here = kvlib.make_cache(model)
    assert torch.equal(in_thread(lambda: generate(made_here)), reference)  # made here, used there: fine
    cache = kvlib.make_cache(model)
    assert torch.equal(generate(cache), reference)  # this thread's now
    for action in (lambda: generate(cache), lambda: cache.crop(-1), lambda: model(ids[:, -1:], **cache_argument(cache)), cache.reset):
        refused = in_thread(action)
        assert isinstance(refused, RuntimeError) and "a cache serves one thread at a time" in str(refused) and "\n" not in str(refused)
    assert cache.get_seq_length() == ids.shape[1] + 4  # the refused calls changed nothing
    cache.reset()  # handed over
    assert torch.equal(in_thread(lambda: generate(cache)), reference)
