"""KVCache on CUDA: exact against DynamicCache and eviction still correct (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("family", ["llama", "default"])
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
        model = build_model("default").to(device)
        cache = kvlib.make_cache(model, "streaming_llm", budget=16)
        out = model.generate(
            ids.to(device), attention_mask=mask.to(device), **cache_argument(cache), do_sample=False, max_new_tokens=10, pad_token_id=PAD
        )
        outputs.append((out.cpu(), cache.kept_positions(0)))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def teacher_forced_logprobs(model: torch.nn.Module, cache, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """float32 log-probabilities ``[steps, vocab]`` of a prefill of ``prompt`` and then one forward
    per token of ``continuation`` (fed whatever the model predicts), on the model's device."""
    device = next(model.parameters()).device
    steps = []
    with torch.inference_mode():
        out = model(input_ids=prompt.to(device), **cache_argument(cache), use_cache=True)
        steps.append(out.logits[0, -1])
        for token in continuation:
            out = model(input_ids=token.view(1, 1).to(device), **cache_argument(cache), use_cache=True)
            steps.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(steps).float(), dim=-1).cpu()


DEVICE_SPECS = [
    "kivi(bits=4)",
    "kivi(bits=2)",
    "int8",
    "fp8",
    "rotated(bits=4)",
    "rotated(bits=2)",
    "rotated(bits=3)",
    "gear",
    "mixed(high_bits=4, low_bits=2, salient=0.5)",
    "snapkv(window=8)",
    "kivi(bits=4)+lru(device_mb=0.002)",
    "quest(top_k=1000, dense_layers=0, placement='lru(device_mb=0.002)')",
    "shadowkv(pages=100, window=1, outliers=1, dense_layers=0, device_mb=0.002)",
]
"""Codecs, an eviction policy, a tiered codec and two page retrievals choosing every page (the
tiny ``device_mb`` puts pages on the host)."""


@pytest.mark.parametrize("spec", DEVICE_SPECS)
def test_coded_and_evicting_caches_on_cuda_match_the_cpu(spec):
    """The same prompt and continuation through a cache with ``spec`` on each device: the
    next-token distributions agree (codes may round differently at a boundary, so not bit for
    bit) and the cache holds the same bytes on each tier."""
    generator = torch.Generator().manual_seed(40)
    prompt = torch.randint(3, 500, (1, 70), generator=generator)
    continuation = torch.randint(3, 500, (12,), generator=generator)
    results = {}
    for device in ("cpu", "cuda"):
        model = build_model("default").to(device)
        cache = kvlib.make_cache(model, spec, budget=40) if spec.startswith("snapkv") else kvlib.make_cache(model, spec)
        logprobs = teacher_forced_logprobs(model, cache, prompt, continuation)
        report = cache.memory_report()
        results[device] = (logprobs, (report["total_bytes"], report["by_tier"]))
    (cpu, cpu_bytes), (cuda, cuda_bytes) = results["cpu"], results["cuda"]
    assert (cpu - cuda).abs().max() < 0.05
    assert cpu_bytes == cuda_bytes


def test_engine_on_cuda_generates_what_it_generates_on_the_cpu():
    generator = torch.Generator().manual_seed(41)
    prompts = [torch.randint(3, 500, (length,), generator=generator).tolist() for length in (9, 37, 21)]
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = kvlib.Engine(build_model("default").to(device), page_size=8)
        outputs[device] = engine.generate(prompts, max_new_tokens=8)
    assert outputs["cuda"] == outputs["cpu"]
