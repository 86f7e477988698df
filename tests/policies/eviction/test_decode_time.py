"""The decode-time policies (keyformer, scope, morphkv, rkv) through generate on SmolLM2 and a GPT-2
config: every (layer, head) holds exactly its int budget and the reported bytes are those of the
kept tokens' pages; an ``interval`` between decode compactions; a per-request spec in the Engine."""

from __future__ import annotations

import math

import pytest
import torch

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model

POLICIES = ["keyformer", "scope", "morphkv", "rkv"]
SPECS = {"keyformer": "keyformer(recent=8)", "scope": "scope", "morphkv": "morphkv(window=8)", "rkv": "rkv"}


def assert_budget_and_bytes(cache, budget: int) -> None:
    """Every head of every layer holds ``budget`` tokens, and ``pages`` bytes are its pages' bytes."""
    expected_bytes = stored = 0
    for layer in range(cache.shape.num_layers):
        counts = (cache.kept_positions(layer) >= 0).sum(-1)
        assert (counts == budget).all(), f"layer {layer}: {counts.tolist()}"
        stored += int(counts.sum())
        pages = sum(math.ceil(int(c) / cache.store.page_size) for c in counts.flatten())
        expected_bytes += pages * cache.store.pools[layer].kv_page_bytes
    report = cache.memory_report()
    assert report["stored_tokens"] == stored
    assert report["by_component"]["pages"] == expected_bytes


@pytest.mark.slow  # the real model: the GPT-2 test below checks the same in the default suite; .ci/run runs this after
@pytest.mark.parametrize("name", POLICIES)
def test_smollm2_holds_the_budget_exactly_while_decoding(name, smollm2):
    model = smollm2.model
    ids = torch.randint(100, 20000, (1, 48), generator=torch.Generator().manual_seed(0))
    cache = kvlib.make_cache(model, SPECS[name], budget=24, slack=0)
    with torch.no_grad():
        out = model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert out.shape[1] == 64
    assert_budget_and_bytes(cache, 24)


@pytest.mark.parametrize("name", POLICIES)
def test_gpt2_holds_the_budget_exactly_while_decoding(name):
    model = build_model("gpt2")
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    cache = kvlib.make_cache(model, SPECS[name], budget=12, slack=0)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=10, min_new_tokens=10)
    assert_budget_and_bytes(cache, 12)


@pytest.mark.parametrize("name", POLICIES)
def test_an_interval_lets_heads_grow_between_decode_compactions(name):
    model = build_model("llama")
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = kvlib.make_cache(model, SPECS[name], budget=12, interval=4, slack=0)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=10, min_new_tokens=10)  # 9 decode steps
    for layer in range(cache.shape.num_layers):
        counts = (cache.kept_positions(layer) >= 0).sum(-1)
        assert (counts == 12 + 9 % 4).all()  # compacted at steps 4 and 8, one token since


@pytest.mark.parametrize("name", POLICIES)
def test_a_per_request_spec_in_the_engine_meets_its_budget(name):
    model = build_model("llama")
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = kvlib.Engine(model)
    request = engine.add_request(prompt, max_new_tokens=8, spec=SPECS[name], budget=16)
    other = engine.add_request(prompt[:20], max_new_tokens=8)
    while engine.has_unfinished:
        engine.step()
    assert len(engine.requests[request].output) == 8 and len(engine.requests[other].output) == 8
    cache = kvlib.make_cache(model, SPECS[name], budget=16)
    reference = model.generate(
        torch.tensor([prompt]), **cache_argument(cache), do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0
    )
    assert engine.requests[request].output == reference[0, len(prompt) :].tolist()
