"""KVCache on CUDA: exact against DynamicCache and eviction still correct (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("family", ["llama", "stories"])
def test_generate_on_cuda_matches_dynamic_cache(family):
    model = build_model(family).cuda()
    ids, mask = left_padded([7, 13, 19], seed=30)
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    reference = model.generate(ids, **cache_argument(DynamicCache(config=model.config)), **kwargs)
    cache = kvlib.make_cache(model)
    assert torch.equal(model.generate(ids, **cache_argument(cache), **kwargs), reference)
    assert cache.store.device.type == "cuda"


def test_streaming_llm_on_cuda_equals_cpu():
    ids, mask = left_padded([24, 31], seed=31)
    outputs = []
    for device in ("cpu", "cuda"):
        model = build_model("stories").to(device)
        cache = kvlib.make_cache(model, "streaming_llm", budget=16)
        out = model.generate(
            ids.to(device), attention_mask=mask.to(device), **cache_argument(cache), do_sample=False, max_new_tokens=10, pad_token_id=PAD
        )
        outputs.append((out.cpu(), cache.kept_positions(0)))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])
