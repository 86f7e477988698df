"""QAQ pages: the bit allocation on a hand-made page and its invariants (within the budget, more
weight never fewer bits); keys by range, values by range times attention; every entry within half
its token's step, outliers exact; the byte formula, as ``memory_report`` shows it through
``generate`` and the Engine; QAQ's attention-window scorer; bad parameters refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.codec import layer_shapes
from kvlib.policies.quantization.qaq import PeakRecentAttention, allocate_bits, attention_weights
from kvlib.policies.quantization.uniform import metadata_dtype
from kvlib.policy import LayerView
from kvlib.spec_text import parse_policy
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = torch.device("cpu")


def codec(spec: str, page_size: int, dim: int, dtype: torch.dtype = torch.float32):
    return parse_policy(spec).layer_codecs(layer_shapes(1, 2, dim, dim, page_size, dtype, CPU))[0]


def pages(n: int, page_size: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages whose tokens differ in range, with a few spikes (outliers)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, page_size, dim, generator=generator) * (torch.rand(n, page_size, 1, generator=generator) * 3 + 0.1)
    spikes = torch.rand(x.shape, generator=generator) < 0.02
    return torch.where(spikes, x * 20, x).to(dtype)


@pytest.mark.parametrize(("capacity", "expected"), [(8, [3, 1, 1, 2]), (10, [4, 2, 1, 3]), (4, [1, 1, 1, 1]), (16, [4, 4, 1, 4])])
def test_the_bits_are_qaqs_at_the_tightest_tolerance_that_fits(capacity: int, expected: list[int]) -> None:
    """Weights 7, 1, 0, 3 (widths 1-4): at ``c = 1`` QAQ's ``ceil(log2(W / c + 1))`` gives 3, 1, 1, 2
    (7 bits); the next tighter ``c = 7/15`` asks 4, 2, 1, 3 (10): so 8 token-bits take the first,
    10 the second; 4 leave every token its 1 bit; at 16 even ``c -> 0`` fits (the third token,
    weight 0, never needs more than the fewest)."""
    bits = allocate_bits(torch.tensor([[7.0, 1.0, 0.0, 3.0]]), capacity, (1, 2, 3, 4))
    assert bits.tolist() == [expected]


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(0, 1e4), min_size=2, max_size=16),
    widths=st.sampled_from([(1, 2, 3, 4), (2, 3, 4, 8), (1, 2, 4, 8), (2,)]),
    extra=st.integers(0, 40),
)
def test_allocated_bits_fit_the_budget_and_never_fall_as_weight_grows(weights: list[float], widths: tuple[int, ...], extra: int) -> None:
    weight = torch.tensor([weights])
    capacity = len(weights) * widths[0] + extra
    bits = allocate_bits(weight, capacity, widths)[0]
    assert int(bits.sum()) <= capacity and set(bits.tolist()) <= set(widths)
    order = weight[0].argsort()
    assert bool((bits[order].diff() >= 0).all())


@settings(max_examples=30, deadline=None)
@given(
    average=st.sampled_from([1.0, 2.0, 2.5, 3.0]),
    outliers=st.sampled_from([0.0, 0.01, 0.1]),
    page_size=st.sampled_from([4, 16]),
    dim=st.sampled_from([8, 32, 64]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_entries_are_within_half_their_tokens_step_and_outliers_are_exact(average, outliers, page_size, dim, dtype, seed) -> None:
    qaq = codec(f"qaq(key_bits={average}, value_bits={average}, outliers={outliers})", page_size, dim, dtype)
    x = pages(6, page_size, dim, dtype, seed)
    heads = torch.zeros(6, dtype=torch.int64)
    encoded = qaq.key.encode(x, heads)
    decoded = qaq.key.dequantize(encoded)
    count = math.ceil(outliers / 2 * dim)
    ordered = x.float().sort(-1).values
    low, high = ordered[..., count], ordered[..., dim - 1 - count]
    bits = encoded["bits"].float()
    meta = metadata_dtype(dtype)
    half = (high - low) / (2.0**bits - 1) / 2 * (1 + 4 * torch.finfo(meta).eps) + 4 * torch.finfo(meta).eps * x.float().abs().amax()
    exact = torch.zeros_like(x, dtype=torch.bool)
    if count:
        exact.scatter_(-1, encoded["outlier_index"].long(), True)
        torch.testing.assert_close(decoded[exact], x.float()[exact].to(meta).float(), rtol=0, atol=0)
    error = (decoded - x.float()).abs()
    assert bool((error <= half.unsqueeze(-1))[~exact].all())
    assert int(encoded["bits"].long().sum(-1).max()) <= math.floor(average * page_size)


def test_keys_follow_their_range_and_values_their_range_times_attention() -> None:
    """Four tokens of one range: keys get the same bits whatever the attention; values give the
    tokens with the most attention more bits (and the key rule's bits follow a wider token)."""
    base = torch.linspace(-1, 1, 8)
    x = torch.stack([base, base, base, base * 4]).unsqueeze(0)  # token 3 spans 4x the range
    qaq = codec("qaq(key_bits=2.0, value_bits=2.0, outliers=0.0)", 4, 8)
    attention = torch.tensor([[0.9, 0.01, 0.01, 0.01]])
    encoded = qaq.encode(x, x, torch.zeros(1, dtype=torch.int64), attention)
    keys, values = encoded["key.bits"][0].tolist(), encoded["value.bits"][0].tolist()
    assert keys[0] == keys[1] == keys[2] < keys[3]
    assert values[0] > values[1] == values[2] and values[0] >= values[3]


def test_infinite_scores_count_as_the_pages_extremes_and_nan_as_its_lowest() -> None:
    """Eviction policies keep some tokens whatever the budget (``+inf``) and score invalid slots ``-inf``."""
    weights = attention_weights(torch.tensor([[math.inf, 0.5, -math.inf, 0.25], [math.nan, -2.0, 1.0, math.inf]]))
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5, 0.25, 0.25], [0.0, 0.0, 3.0, 3.0]], dtype=torch.float64))


def test_negative_scores_are_shifted_to_start_at_zero() -> None:
    """An eviction policy's keep-scores may be negative (knorm's): the lowest counts as no attention."""
    x = torch.linspace(-1, 1, 8).expand(1, 4, 8)
    qaq = codec("qaq(value_bits=2.0, outliers=0.0)", 4, 8)
    shifted = qaq.encode(x, x, torch.zeros(1, dtype=torch.int64), torch.tensor([[-5.0, -1.0, -5.0, -4.0]]))
    plain = qaq.encode(x, x, torch.zeros(1, dtype=torch.int64), torch.tensor([[0.0, 4.0, 0.0, 1.0]]))
    assert torch.equal(shifted["value.bits"], plain["value.bits"]) and shifted["value.bits"][0, 1] == shifted["value.bits"].max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_page_bytes_follow_the_formula(dtype: torch.dtype) -> None:
    """Per tensor: the budget's codes ``floor(bits * page_size) * dim / 8``, a bits byte and a
    scale and minimum per token, and 2 ceil(0.005 dim) outliers per token (a channel byte and a
    value); SmolLM2's layout (head dim 64, 16-token pages) at the defaults: 992 bytes, against
    896 for ``kivi(bits=2)`` and 4096 for the page in fp16."""
    meta = torch.empty((), dtype=metadata_dtype(dtype)).element_size()
    qaq = codec("qaq", 16, 64, dtype)
    per_token = 1 + 2 * meta + 2 * (1 + meta)
    assert qaq.page_bytes() == (3 * 16 * 64 // 8 + 16 * per_token) + (2 * 16 * 64 // 8 + 16 * per_token)
    if dtype == torch.float16:
        assert qaq.page_bytes() == 992 < codec("kivi(bits=4)", 16, 64, dtype).page_bytes()


def test_the_scorer_takes_each_tokens_peak_attention_over_its_group_and_window() -> None:
    attention = torch.zeros(1, 4, 3, 5)  # 4 query heads over 2 KV heads, 3 recent queries, 5 slots
    attention[0, 1, 2, 0] = 0.7  # KV head 0's second query head
    attention[0, 0, 0, 0] = 0.2
    attention[0, 3, 1, 4] = 0.5  # KV head 1, at the slot it does not hold
    valid = torch.ones(1, 2, 5, dtype=torch.bool)
    valid[0, 1, 4] = False
    view = LayerView(
        0, 1, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), torch.arange(5).expand(1, 2, 5), valid, recent_attention=attention
    )
    scores = PeakRecentAttention(window=3).score(view)
    torch.testing.assert_close(scores, torch.tensor([[[0.7, 0, 0, 0, 0], [0, 0, 0, 0, 0]]]))  # KV head 1's peak: an invalid slot


def held(cache) -> tuple[int, int, int]:
    """``(pages, codec_metadata, sealed pages)``: what the pools' open and sealed pages hold."""
    pages = metadata = sealed_total = 0
    for pool in cache.store.pools:
        sealed = int(pool.sealed.sum())
        sealed_total += sealed
        pages += (pool.pages_in_use - sealed) * pool.kv_page_bytes + sealed * pool.codec.page_bytes(metadata=False)
        metadata += sealed * pool.codec.page_bytes(metadata=True)
    return pages, metadata, sealed_total


@pytest.mark.parametrize("spec", ["snapkv+qaq(key_bits=2.0)"])  # alone: tests/adapters/cache/test_codecs.py
def test_through_generate_memory_report_shows_the_pages_layout(spec: str) -> None:
    model = build_model("default")
    ids, mask = left_padded([50, 41], seed=9, vocab=DEFAULT_BYTES)
    budget = {"budget": 24} if "snapkv" in spec else {}
    cache, exact = kvlib.make_cache(model, spec, **budget), kvlib.make_cache(model, spec.split("+")[0] if budget else None, **budget)
    run = {"attention_mask": mask, "do_sample": False, "max_new_tokens": 16, "pad_token_id": PAD}
    out = model.generate(ids, **run, **cache_argument(cache))
    model.generate(ids, **run, **cache_argument(exact))
    assert out.shape == (2, ids.shape[1] + 16)
    pages, metadata, sealed = held(cache)
    report, full = cache.memory_report()["by_component"], exact.memory_report()["by_component"]
    assert (report["pages"], report["codec_metadata"]) == (pages, metadata) and sealed > 0
    assert report["pages"] + report["codec_metadata"] < full["pages"]


def test_the_engine_seals_qaq_pages_with_values_by_range() -> None:
    """The Engine seals pages with no salience (values take their range alone): at every step its
    report counts QAQ's page layout, and its peak is below the exact Engine's."""
    model = build_model("default")
    prompts = [torch.randint(3, DEFAULT_BYTES, (length,), generator=torch.Generator().manual_seed(length)).tolist() for length in (40, 53)]
    peaks = {}
    for spec in ("qaq", None):
        engine = kvlib.Engine(model, spec, prefix_cache=False)
        for prompt in prompts:
            engine.add_request(prompt, max_new_tokens=12)
        peak = most_sealed = 0
        while engine.has_unfinished:
            engine.step()
            report = engine.memory_report()["by_component"]
            peak = max(peak, report["pages"] + report["codec_metadata"])
            if spec:
                pages, metadata, sealed = held(engine.kv)
                assert (report["pages"], report["codec_metadata"]) == (pages, metadata)
                most_sealed = max(most_sealed, sealed)
        assert engine.stats()["output_tokens"] == 24
        peaks[spec] = (peak, most_sealed)
    assert peaks["qaq"][1] > 0 and peaks["qaq"][0] < peaks[None][0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("qaq(min_bits=5)", r"min_bits must be one of \(1, 2, 3, 4, 8\)"),
        ("qaq(min_bits=4, max_bits=2)", r"min_bits \(4\) must not exceed max_bits \(2\)"),
        ("qaq(key_bits=6.0)", r"key_bits must lie in \[min_bits, max_bits\] = \[1, 4\]"),
        ("qaq(value_bits=0.5)", r"value_bits must lie in"),
        ("qaq(outliers=0.5)", r"outliers must be a fraction in \[0, 0.5\)"),
        ("qaq(window=0)", "window must be an int >= 1"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy(spec)


def test_head_dims_that_are_not_whole_bytes_are_refused_before_model_work() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"qaq needs head dims that are multiples of 8 \(whole bytes per token\), got 12 \(layer 0\)"):
        kvlib.make_cache(model, "qaq")
