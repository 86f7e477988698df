"""Every registered eviction policy runs through generate, meets its budget exactly, frees pages,
and (when its scores do not depend on the batch) gives a left-padded row what it gives alone."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policy import BudgetRequest
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

BUDGET = 12
BATCH_INDEPENDENT = {"streaming_llm", "knorm", "keydiff", "tova", "expected_attention", "lagkv", "h2o", "vatp", "random"}


@pytest.mark.parametrize("family", ["default", "gpt2"])
@pytest.mark.parametrize("name", kvlib.available_policies()["eviction"])
def test_policy_through_generate(family, name):
    model = build_model(family)
    lengths = [20, 27, 33]
    ids, mask = left_padded(lengths, seed=40)
    cache = kvlib.make_cache(model, name, budget=BUDGET, slack=0)
    batched = model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=8, pad_token_id=PAD)
    layers = cache.shape.num_layers
    allocation = cache.evictor.allocation
    for layer in range(layers):  # the policy's allocation (uniform, or its own default) met exactly
        counts = (cache.kept_positions(layer) >= 0).sum(-1)
        request = BudgetRequest(layer, layers, torch.full((len(lengths),), BUDGET), counts)
        if allocation.needs_scores:  # a split by scores (adaptive): the layer's total is what is fixed
            assert torch.equal(counts.sum(-1), allocation.layer_tokens(request))
        else:
            assert torch.equal(counts, allocation.caps(request))
    full = kvlib.make_cache(model)
    model.generate(ids, attention_mask=mask, **cache_argument(full), do_sample=False, max_new_tokens=8, pad_token_id=PAD)
    assert cache.memory_report()["by_component"]["pages"] < full.memory_report()["by_component"]["pages"]
    if name not in BATCH_INDEPENDENT:
        return
    for row, length in enumerate(lengths):
        alone_cache = kvlib.make_cache(model, name, budget=BUDGET, slack=0)
        alone = model.generate(
            ids[row : row + 1, ids.shape[1] - length :], **cache_argument(alone_cache), do_sample=False, max_new_tokens=8, pad_token_id=PAD
        )
        assert torch.equal(batched[row, ids.shape[1] :], alone[0, length:])
        assert torch.equal(cache.kept_positions(0)[row], alone_cache.kept_positions(0)[0])
