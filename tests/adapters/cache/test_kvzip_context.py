"""compressed_context: a KVzip-compressed context held whole in a PrefixStore and forked for each
question (answers equal a fresh compression's), bad input refused before model work, and the
deprecated name under kvlib.policies.eviction.kvzip."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.adapters import compressed_context
from kvlib.policies.eviction.kvzip import compress
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model
from tests.policies.eviction.test_kvzip import PROMPT


def test_a_compressed_context_is_held_in_the_prefix_store_and_forked_for_each_question() -> None:
    model = build_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    context = torch.randint(11, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    questions = torch.randint(11, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    store = kvlib.PrefixStore(model, capacity_bytes=1 << 24)
    first = compressed_context(model, store, context, PROMPT, budget=0.25, page_size=4)
    assert len(calls) >= 3 and len(store.contexts) == 1  # prefill, reconstruction, compressed prefill
    answers = []
    for row in range(2):
        calls.clear()
        cache = compressed_context(model, store, context, PROMPT, budget=0.25, page_size=4)
        assert not calls and cache is not first and cache.store is first.store  # a fork: nothing computed
        answers.append(
            model.generate(
                torch.cat([context, questions[row : row + 1]], 1),
                **cache_argument(cache),
                do_sample=False,
                max_new_tokens=5,
                pad_token_id=PAD,
            )
        )
    for row in range(2):  # each answer is what a fresh compression of the context gives that question
        alone = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
        compress(model, alone, context, PROMPT)
        expected = model.generate(
            torch.cat([context, questions[row : row + 1]], 1), **cache_argument(alone), do_sample=False, max_new_tokens=5, pad_token_id=PAD
        )
        assert torch.equal(answers[row], expected)
    assert store.contexts.hits == 2
    calls.clear()
    compressed_context(model, store, context, PROMPT, budget=0.5, page_size=4)  # another budget: another context
    compressed_context(model, store, context[:, 1:], PROMPT, budget=0.25, page_size=4)  # other ids too
    assert calls and len(store.contexts) == 3
    coded = compressed_context(model, store, context, PROMPT, budget=0.25, spec="kvzip+kivi(bits=4)", page_size=4)
    assert coded.codec is not None and len(store.contexts) == 4  # a codec in the spec: another context


def test_compressed_context_refuses_bad_input_before_any_model_work() -> None:
    model = build_model("llama")
    store = kvlib.PrefixStore(model, capacity_bytes=1 << 20)
    context = torch.randint(11, 97, (1, 20))
    with pytest.raises(ValueError, match="another model"):
        compressed_context(build_model("gpt2"), store, context, PROMPT, budget=0.5)
    with pytest.raises(ValueError, match="must be a kvlib.PrefixStore"):
        compressed_context(model, {}, context, PROMPT, budget=0.5)
    with pytest.raises(ValueError, match="make_cache\\(model, 'kvzip', budget"):
        compressed_context(model, store, context, PROMPT, budget=0.5, spec="snapkv")
    assert len(store.contexts) == 0
