"""Mixed-precision pages: salient tokens (the page's highest scores) within half a high-bit step,
the others within half a low-bit step; the byte formula; salience handed by the store at seal
time lands on the right pages; ZipCache's normalized attention score; bad parameters refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.codec import layer_shapes
from kvlib.kernels.packing import packed_size
from kvlib.policies.quantization.mixed import MixedPrecision
from kvlib.policies.quantization.mixed_codec import salient_slots
from kvlib.policies.quantization.salience import NormalizedAttention
from kvlib.policies.quantization.uniform import metadata_dtype
from kvlib.policy import LayerView
from kvlib.spec_text import parse_policy
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = torch.device("cpu")


def codec(spec: str, page_size: int, dims: tuple[int, int], dtype: torch.dtype):
    return parse_policy(spec).layer_codecs(layer_shapes(1, 2, dims[0], dims[1], page_size, dtype, CPU))[0]


def pages(n: int, page_size: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages with per-channel offsets and scales (as real keys have)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, page_size, dim, generator=generator) * (torch.rand(dim, generator=generator) * 3 + 0.1)
    return (x + torch.randn(dim, generator=generator) * 2).to(dtype)


def half_steps(x: torch.Tensor, bits: torch.Tensor, per_channel: bool, group: int, meta: torch.dtype) -> torch.Tensor:
    """Half the quantization step of every element of float32 ``x [n, size, dim]`` whose token has
    ``bits [n, size]`` (keys: the channel's span over the page; values: the token group's span),
    widened by the metadata dtype's rounding and the compute dtype's."""
    n, size, dim = x.shape
    if per_channel:
        span = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)).expand(n, size, dim)
    else:
        grouped = x.view(n, size, dim // group, group)
        span = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)).expand_as(grouped).reshape(n, size, dim)
    levels = (2.0 ** bits.float() - 1).unsqueeze(-1)
    return span / levels / 2 * (1 + 4 * torch.finfo(meta).eps) + 4 * torch.finfo(meta).eps * x.abs().amax()


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([(8, 2), (4, 2), (8, 4), (4, 4), (2, 2)]),
    salient=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
    page_size=st.sampled_from([4, 16]),
    dims=st.sampled_from([(8, 8), (64, 64), (16, 32)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_salient_tokens_are_within_half_a_high_step_and_the_rest_half_a_low_step(bits, salient, page_size, dims, dtype, seed) -> None:
    high_bits, low_bits = bits
    mixed = codec(f"mixed(high_bits={high_bits}, low_bits={low_bits}, salient={salient}, group=8)", page_size, dims, dtype)
    keys, values = pages(5, page_size, dims[0], dtype, seed), pages(5, page_size, dims[1], dtype, seed + 1)
    salience = torch.randn(5, page_size, generator=torch.Generator().manual_seed(seed))
    heads = torch.zeros(5, dtype=torch.int64)
    encoded = mixed.encode(keys, values, heads, salience)
    assert encoded.keys() == mixed.fields.keys()
    for name, tensor in encoded.items():
        assert tensor.shape[1:] == mixed.fields[name].shape and tensor.dtype == mixed.fields[name].dtype
    count = round(salient * page_size)
    chosen = salience.topk(count, dim=1).indices.sort(dim=1).values
    if count:
        assert torch.equal(encoded["key.salient"].long(), chosen) and torch.equal(encoded["value.salient"].long(), chosen)
    high = torch.zeros(5, page_size, dtype=torch.bool).scatter_(1, chosen, True)
    token_bits = torch.where(high, high_bits, low_bits)
    keys_out, values_out = mixed.decode(encoded, heads)
    meta = metadata_dtype(dtype)
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    for x, out, per_channel in ((keys, keys_out, True), (values, values_out, False)):
        assert out.dtype == dtype and out.shape == x.shape
        x = x.float()
        bound = half_steps(x, token_bits, per_channel, min(8, x.shape[-1]), meta) + rounding * x.abs()
        assert bool(((out.float() - x).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits, salient", [((8, 2), 0.25), ((4, 2), 0.5), ((8, 2), 0.1), ((4, 4), 0.0), ((8, 4), 1.0)])
def test_page_bytes_follow_the_formula(bits: tuple[int, int], salient: float, dtype: torch.dtype) -> None:
    high_bits, low_bits = bits
    page_size, dim, group = 16, 64, 32
    mixed = codec(f"mixed(high_bits={high_bits}, low_bits={low_bits}, salient={salient})", page_size, (dim, dim), dtype)
    count = round(salient * page_size)
    codes = packed_size(count * dim, high_bits) + packed_size((page_size - count) * dim, low_bits)
    key_metadata, value_metadata = 2 * 2 * dim, 2 * 2 * page_size * (dim // group)  # scale and minimum in fp16 or bf16
    assert mixed.page_bytes(metadata=False) == 2 * (count + codes)
    assert mixed.page_bytes(metadata=True) == key_metadata + value_metadata
    kivi = codec(f"kivi(bits={low_bits})", page_size, (dim, dim), dtype)
    assert mixed.page_bytes(metadata=True) == kivi.page_bytes(metadata=True)  # KIVI's metadata, no more


def test_the_default_8_2_at_a_quarter_holds_fewer_bytes_than_kivi_4_on_smollm2s_layout() -> None:
    mixed = codec("mixed(high_bits=8, low_bits=2, salient=0.25)", 16, (64, 64), torch.bfloat16)
    assert mixed.page_bytes() == 1288 < codec("kivi(bits=4)", 16, (64, 64), torch.bfloat16).page_bytes() == 1408


def test_salient_slots_are_the_highest_scores_ascending_nan_lowest_and_ties_to_the_earlier_slot() -> None:
    salience = torch.tensor([[0.5, float("nan"), 2.0, 0.5, -torch.inf, 1.0]])
    assert salient_slots(salience, 3).tolist() == [[0, 2, 5]]
    assert salient_slots(salience, 0).shape == (1, 0)


def test_without_salience_the_page_codec_takes_the_lowest_norm_keys() -> None:
    mixed = codec("mixed(salient=0.25)", 8, (8, 8), torch.float32)
    keys = torch.ones(1, 8, 8) * torch.tensor([5.0, 0.1, 3.0, 4.0, 0.2, 6.0, 7.0, 8.0]).view(1, 8, 1)
    encoded = mixed.encode(keys, keys.clone(), torch.zeros(1, dtype=torch.int64))
    assert encoded["key.salient"].tolist() == [[1, 4]]


def test_the_store_hands_each_sealed_page_its_tokens_scores() -> None:
    """Scores of a layer's stored slots (``[batch, heads, slots]``, as reads lay them out) reach
    the pages that hold those slots: each sealed page's salient tokens are its highest-scored."""
    page_size, heads = 4, 2
    shapes = layer_shapes(1, heads, 8, 8, page_size, torch.float32, CPU)
    store = PagedStore(
        StoreConfig(1, heads, 8, page_size=page_size, codecs=MixedPrecision(salient=0.5).layer_codecs(shapes), read_cache=False)
    )
    seqs = [store.new_sequence(), store.new_sequence()]
    store.append(0, seqs, torch.randn(2, heads, 11, 8), torch.randn(2, heads, 11, 8))
    scores = torch.randn(2, heads, 11, generator=torch.Generator().manual_seed(3))
    calls = []
    assert store.seal(0, seqs, lambda: calls.append(1) or scores) == 2 * heads * 2
    assert calls == [1]
    pool, table = store.pools[0], store.tables[0]
    for b, seq in enumerate(seqs):
        for h in range(heads):
            for p in range(2):
                page = int(table.pages[seq, h, p])
                expected = scores[b, h, p * page_size : (p + 1) * page_size].topk(2).indices.sort().values
                assert pool.encoded["key.salient"][page].long().tolist() == expected.tolist()
    assert store.seal(0, seqs, lambda: calls.append(1) or scores) == 0 and calls == [1]  # nothing to seal: no scores asked for


def test_normalized_attention_divides_by_the_queries_that_saw_each_token() -> None:
    positions = torch.tensor([[[0, 1, 2, 3, -1]]])
    valid = positions >= 0
    accumulated = torch.tensor([[[4.0, 3.0, 1.0, 1.0, 0.0]]])
    view = LayerView(0, 1, torch.zeros(1, 1, 5, 0), torch.zeros(1, 1, 5, 0), positions, valid, accumulated_attention=accumulated)
    scores = NormalizedAttention().score(view)
    assert scores[0, 0, :4].tolist() == [1.0, 1.0, 0.5, 1.0] and scores[0, 0, 4] == -torch.inf


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"high_bits": 5}, "high_bits must be one of"),
        ({"low_bits": 1}, "low_bits must be one of"),
        ({"high_bits": 2, "low_bits": 4}, "must not exceed"),
        ({"salient": 1.5}, "salient must be a fraction"),
        ({"group": 0}, "group must be"),
    ],
)
def test_invalid_parameters_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)


def sealed_salient_slots(cache) -> list[torch.Tensor]:
    """Each layer's sealed pages' salient slots (``[pages, count]``)."""
    return [pool.encoded["key.salient"][pool.sealed] for pool in cache.store.pools]


@pytest.mark.parametrize("eviction", kvlib.available_policies()["eviction"])
def test_mixed_composes_with_every_eviction_policy(eviction: str) -> None:
    """Under eviction the policy's scores decide salience: the cache holds no scorer of its own."""
    model = build_model("gpt2")
    ids, mask = left_padded([40, 33], seed=8)
    cache = kvlib.make_cache(model, f"{eviction}+mixed(high_bits=8, low_bits=2, salient=0.25)", budget=24)
    assert cache.evictor.policy.name == eviction
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    assert all(slots.shape[0] > 0 and slots.shape[1] == 4 for slots in sealed_salient_slots(cache))


def test_streaming_llms_scores_make_a_pages_newest_tokens_salient() -> None:
    """StreamingLLM scores by recency (sinks aside): each sealed page past the sinks keeps its newest tokens high."""
    model = build_model("gpt2")
    ids, mask = left_padded([64], seed=3)
    cache = kvlib.make_cache(model, "streaming_llm(sinks=0)+mixed(salient=0.25)", budget=1.0)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=1, pad_token_id=PAD)
    for slots in sealed_salient_slots(cache):
        assert (slots.long() == torch.tensor([12, 13, 14, 15])).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_alone_zipcaches_normalized_attention_decides_and_nothing_is_evicted(family: str, dtype: torch.dtype) -> None:
    model = build_model(family).to(dtype)
    ids, mask = left_padded([40, 33], seed=7)
    cache = kvlib.make_cache(model, "mixed(high_bits=4, low_bits=2, salient=0.5)")
    assert isinstance(cache.evictor.policy, NormalizedAttention) and cache.evictor.budget is None
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    assert out.shape == (2, ids.shape[1] + 12)
    assert cache.kept_positions(0).shape[-1] == 40 + 11  # every token kept (the last one generated is never stored)
    assert all(slots.shape[0] > 0 for slots in sealed_salient_slots(cache))


def test_a_kivi_cache_holds_no_scorer() -> None:
    assert kvlib.make_cache(build_model("gpt2"), "kivi").evictor is None
