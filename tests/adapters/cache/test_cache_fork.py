"""KVCache.fork: a fork continues exactly as the cache it came from would (pages shared, not
copied), neither sees what the other appends, and caches that cannot be forked are refused."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model


def generate(model, ids: torch.Tensor, cache) -> torch.Tensor:
    return model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("spec", [None, "kivi(bits=4)"])
def test_forks_continue_a_prefix_as_the_original_would_and_apart(family: str, spec: str | None) -> None:
    model = build_model(family)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 97, (1, 37), generator=generator)
    questions = [torch.randint(3, 97, (1, 5), generator=generator) for _ in range(2)]
    base = kvlib.make_cache(model, spec, page_size=4)
    with torch.no_grad():
        model(input_ids=prefix, **cache_argument(base), use_cache=True)
    pages_before = base.memory_report()["by_component"]["pages"]
    tokens_before = base.memory_report()["stored_tokens"]
    forks = [base.fork() for _ in questions]
    assert forks[0].store is base.store and forks[0].get_seq_length() == 37
    assert base.store.memory_bytes()["pages"] == pages_before  # nothing copied yet
    answers = [generate(model, torch.cat([prefix, q], 1), fork) for fork, q in zip(forks, questions)]
    for question, answer in zip(questions, answers):  # each as a fresh cache given the prefix the same way
        fresh = kvlib.make_cache(model, spec, page_size=4)
        with torch.no_grad():
            model(input_ids=prefix, **cache_argument(fresh), use_cache=True)
        assert torch.equal(answer, generate(model, torch.cat([prefix, question], 1), fresh))
    assert base.get_seq_length() == 37 and base.memory_report()["stored_tokens"] == tokens_before
    for layer in range(base.shape.num_layers):
        assert torch.equal(base.kept_positions(layer), torch.arange(37).expand(1, base.shape.num_kv_heads, 37))
    forks[0].reset()  # a fork's reset gives back its own references only
    again = generate(model, torch.cat([prefix, questions[1]], 1), base.fork())
    assert torch.equal(again, answers[1])


def test_a_compressed_cache_forks_with_its_kept_tokens() -> None:
    from kvlib.policies.eviction.kvzip import RepeatPrompt, compress

    model = build_model("llama")
    context = torch.randint(11, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
    compress(model, cache, context, RepeatPrompt(first=(5, 6), later=(8,), suffix=(10,), prefix=2))
    fork = cache.fork()
    for layer in range(cache.shape.num_layers):
        assert torch.equal(fork.kept_positions(layer), cache.kept_positions(layer))
    assert fork.memory_report()["stored_tokens"] == cache.memory_report()["stored_tokens"]


def test_caches_that_cannot_fork_are_refused() -> None:
    model = build_model("llama")
    ids = torch.randint(3, 97, (1, 20))
    with pytest.raises(ValueError, match="holds no tokens yet"):
        kvlib.make_cache(model).fork()
    evicting = kvlib.make_cache(model, "snapkv", budget=8)
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(evicting), use_cache=True)
    with pytest.raises(ValueError, match="no longer evicts; this one runs snapkv"):
        evicting.fork()
    store = kvlib.PrefixStore(model, capacity_bytes=1 << 20)
    primed = kvlib.make_cache(model, reuse=store, prompt=ids)
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(primed), use_cache=True)
    with pytest.raises(ValueError, match="primed from one"):
        primed.fork()
    tiered = kvlib.make_cache(model, "lru(device_mb=1)")
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(tiered), use_cache=True)
    with pytest.raises(ValueError, match="without tiering"):
        tiered.fork()
