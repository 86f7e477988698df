"""attend_pages_torch (and attention_weights_torch) equals the numba kernel and float64 SDPA over the dense form of the same
pages; on CUDA (skipped without a GPU) too, and an exact cache there decodes over the pages as
DynamicCache does. On the CPU the torch path is also run through the cache by choosing it for
the CPU (``PAGED_KERNELS``), which exercises the wiring a CUDA device uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvlib
from kvlib import devices
from kvlib.devices import PagedKernel
from kvlib.kernels.arena_sources import arena_source_for
from kvlib.kernels.paged_attention import PageSource, arena_source, paged_attention
from kvlib.kernels.paged_attention_torch import (
    PAGES_PER_BLOCK,
    WORKSPACE_BYTES,
    TorchPageSource,
    attend_pages_torch,
    attention_weights_torch,
    block_pages,
)
from kvlib.kernels.paged_scores import attention_weights
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.test_paged_decode import count_dense_reads
from tests.adapters.conftest import PAD, build_model, left_padded
from tests.kernels.test_paged_attention import TOLERANCE, padded_causal_mask, scattered_pages, sdpa_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def compare_with_references(device, batch, kv_heads, group, queries, page_size, dims, dtype, window, softcap, pages_per_block, seed):
    """Scattered pages on ``device`` (block table, lengths and mask left on the CPU): the torch
    path against the numba kernel (CPU copies) and, without softcap, float64 SDPA."""
    generator = torch.Generator().manual_seed(seed)
    dim, value_dim = dims
    lengths = torch.randint(0, 40, (batch, kv_heads), generator=generator)
    lengths[0, 0] = 0 if seed % 3 == 0 else lengths[0, 0]  # a head that holds nothing
    keys, values, positions, pages, dense_keys, dense_values, dense_positions = scattered_pages(
        lengths, page_size, dim, value_dim, dtype, generator
    )
    _, visible = padded_causal_mask(lengths, queries, window, generator)
    query = torch.randn(batch, kv_heads * group, queries, dim, generator=generator).to(dtype)
    scale = dim**-0.5
    options = dict(visible=visible, query_positions=None, scale=scale, softcap=softcap)
    out = attend_pages_torch(
        query.to(device),
        keys.to(device),
        values.to(device),
        positions.to(device),
        pages,
        lengths,
        pages_per_block=pages_per_block,
        **options,
    )
    assert out.device.type == torch.device(device).type
    assert out.dtype == dtype and out.shape == (batch, kv_heads * group, queries, value_dim)
    out = out.cpu().double()
    tolerance = TOLERANCE[dtype]
    kernel = paged_attention(query, keys, values, positions, pages, lengths, **options)
    torch.testing.assert_close(out, kernel.double(), atol=tolerance, rtol=tolerance)
    if softcap is None:
        expected = sdpa_reference(query, dense_keys, dense_values, dense_positions, visible, scale)
        torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    weights = attention_weights_torch(
        query.to(device), keys.to(device), positions.to(device), pages, lengths, pages_per_block=pages_per_block, **options
    )
    expected_weights = attention_weights(query, arena_source(keys, values, positions), pages, lengths, **options)
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=1e-5, rtol=1e-4)


SHAPES = dict(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4]),
    queries=st.integers(1, 4),
    page_size=st.sampled_from([1, 4, 16]),
    dims=st.sampled_from([(8, 8), (32, 32), (16, 8)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.sampled_from([None, 7]),
    softcap=st.sampled_from([None, 5.0]),
    pages_per_block=st.sampled_from([1, 2, 32]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=25, deadline=None)
@given(**SHAPES)
def test_torch_path_equals_the_kernel_and_sdpa_over_the_dense_pages(**case):
    compare_with_references("cpu", **case)


@needs_cuda
@settings(max_examples=25, deadline=None)
@given(**SHAPES)
def test_torch_path_on_cuda_equals_the_kernel_and_sdpa_over_the_dense_pages(**case):
    compare_with_references("cuda", **case)


@pytest.mark.parametrize("pages_per_block", [1, 3, 32])
def test_causal_visibility_by_query_positions_equals_the_same_mask_given_whole(pages_per_block) -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([[30, 12]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 8, 16, 16, torch.float32, generator)
    query = torch.randn(1, 4, 2, 16, generator=generator)
    query_positions = torch.tensor([20, 34])
    visible = (torch.arange(35) <= query_positions.view(-1, 1)).unsqueeze(0)
    common = dict(scale=0.25, pages_per_block=pages_per_block)
    by_positions = attend_pages_torch(
        query, keys, values, positions, pages, lengths, visible=None, query_positions=query_positions, **common
    )
    by_mask = attend_pages_torch(query, keys, values, positions, pages, lengths, visible=visible, query_positions=None, **common)
    assert torch.equal(by_positions, by_mask)


def test_default_blocks_take_a_short_context_in_one_step_and_bound_a_long_ones_workspace() -> None:
    assert block_pages(batch=1, kv_heads=3, rows=3, page_size=16, dims=128, used=128) == 128  # 2k tokens: one step
    long = block_pages(batch=16, kv_heads=4, rows=3, page_size=16, dims=128, used=4096)
    assert PAGES_PER_BLOCK <= long < 4096
    assert long * 16 * 4 * 16 * (128 + 3) * 4 <= WORKSPACE_BYTES
    assert block_pages(batch=64, kv_heads=32, rows=8, page_size=16, dims=256, used=4096) == PAGES_PER_BLOCK  # the floor
    assert block_pages(batch=1, kv_heads=1, rows=1, page_size=16, dims=8, used=0) == PAGES_PER_BLOCK


@pytest.mark.parametrize("pages_per_block", [1, 2])
def test_default_block_size_equals_small_blocks(pages_per_block) -> None:
    generator = torch.Generator().manual_seed(6)
    lengths = torch.tensor([[37, 5], [0, 21]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 4, 8, 8, torch.float32, generator)
    query = torch.randn(2, 4, 1, 8, generator=generator)
    options = dict(visible=None, query_positions=torch.tensor([40]), scale=0.5)
    default = attend_pages_torch(query, keys, values, positions, pages, lengths, **options)
    small = attend_pages_torch(query, keys, values, positions, pages, lengths, pages_per_block=pages_per_block, **options)
    torch.testing.assert_close(default, small, atol=1e-6, rtol=1e-5)
    weights = attention_weights_torch(query, keys, positions, pages, lengths, **options)
    small_weights = attention_weights_torch(query, keys, positions, pages, lengths, pages_per_block=pages_per_block, **options)
    torch.testing.assert_close(weights, small_weights, atol=1e-6, rtol=1e-5)


def test_unwritten_slots_never_reach_the_output() -> None:
    """Slots past a head's length and pages no table names may hold any bits (``torch.empty``)."""
    generator = torch.Generator().manual_seed(4)
    lengths = torch.tensor([[9, 0], [4, 17]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 4, 8, 8, torch.float32, generator)
    options = dict(visible=None, query_positions=torch.tensor([40]), scale=0.5, pages_per_block=2)
    query = torch.randn(2, 2, 1, 8, generator=generator)
    clean = attend_pages_torch(query, keys, values, positions, pages, lengths, **options)
    unwritten = positions < 0
    keys[unwritten], values[unwritten] = float("nan"), float("nan")
    out = attend_pages_torch(query, keys, values, positions, pages, lengths, **options)
    assert torch.equal(out, clean)
    assert torch.equal(out[0, 1], torch.zeros(1, 8))  # a head that holds nothing: zeros


def test_mismatched_heads_missing_visibility_and_empty_blocks_are_refused() -> None:
    lengths = torch.tensor([[4, 4]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 4, 8, 8, torch.float32, torch.Generator().manual_seed(3))
    steps = torch.tensor([9])
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        attend_pages_torch(torch.randn(1, 3, 1, 8), keys, values, positions, pages, lengths, visible=None, query_positions=steps, scale=1.0)
    with pytest.raises(ValueError, match="needs the model's mask"):
        attend_pages_torch(torch.randn(1, 2, 1, 8), keys, values, positions, pages, lengths, visible=None, query_positions=None, scale=1.0)
    with pytest.raises(ValueError, match="pages_per_block must be >= 1"):
        attend_pages_torch(
            torch.randn(1, 2, 1, 8),
            keys,
            values,
            positions,
            pages,
            lengths,
            visible=None,
            query_positions=steps,
            scale=1.0,
            pages_per_block=0,
        )


def test_each_device_gets_its_kernels_page_source(monkeypatch) -> None:
    keys, values, positions = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.int64)
    assert isinstance(arena_source_for(keys, values, positions), PageSource)
    monkeypatch.setitem(devices.PAGED_KERNELS, "cpu", (PagedKernel.TORCH,))
    assert isinstance(arena_source_for(keys, values, positions), TorchPageSource)
    monkeypatch.delitem(devices.PAGED_KERNELS, "cpu")
    assert arena_source_for(keys, values, positions) is None


def decode_over_pages_equals_dynamic_cache(device: str) -> kvlib.KVCache:
    """An exact cache's greedy decode on ``device``: no dense read, no mirror, DynamicCache's tokens."""
    model = build_model("llama").to(device)
    ids, mask = left_padded([9, 17, 30], seed=5)
    ids, mask = ids.to(device), mask.to(device)
    reference = model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(DynamicCache(config=model.config)),
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_logits=True,
    )
    cache = kvlib.make_cache(model)
    assert not cache.read_cache
    dense_reads, out = count_dense_reads(cache, model, ids, mask)
    assert dense_reads == 0  # the prefill attends over its own tensors, decode steps over the pages
    assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(out.logits, reference.logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.memory_report()["by_component"]["read_cache"] == 0
    return cache


def test_an_exact_cache_decodes_through_the_torch_path_where_it_is_chosen(monkeypatch) -> None:
    monkeypatch.setitem(devices.PAGED_KERNELS, "cpu", (PagedKernel.TORCH,))
    cache = decode_over_pages_equals_dynamic_cache("cpu")
    assert isinstance(cache.store.pools[0].page_source(), TorchPageSource)


@pytest.mark.parametrize("spec", ["streaming_llm", "h2o", "snapkv", "knorm"])
def test_an_evicting_cache_decodes_through_the_torch_path_as_through_the_kernel(spec: str, monkeypatch) -> None:
    """A budget held while decoding: attention and the compaction's attention weights come from
    the torch path; tokens and kept positions equal the numba kernel's run."""
    model = build_model("llama")
    ids, mask = left_padded([12, 40], seed=7, vocab=model.config.vocab_size)
    options = dict(attention_mask=mask, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=PAD)
    by_kernel = kvlib.make_cache(model, spec, budget=16)
    expected = model.generate(ids, **cache_argument(by_kernel), **options)
    monkeypatch.setitem(devices.PAGED_KERNELS, "cpu", (PagedKernel.TORCH,))
    by_torch = kvlib.make_cache(model, spec, budget=16)
    assert torch.equal(model.generate(ids, **cache_argument(by_torch), **options), expected)
    assert isinstance(by_torch.store.pools[0].page_source(), TorchPageSource)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(by_torch.kept_positions(layer), by_kernel.kept_positions(layer))


def test_coded_pools_read_densely_where_the_torch_path_is_chosen(monkeypatch) -> None:
    monkeypatch.setitem(devices.PAGED_KERNELS, "cpu", (PagedKernel.TORCH,))
    model = build_model("default")
    ids, mask = left_padded([20], seed=6, vocab=model.config.vocab_size)
    cache = kvlib.make_cache(model, "kivi(bits=4)")
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=3, pad_token_id=PAD)
    assert cache.store.pools[0].page_source() is None  # numba's loaders only: attention reads a dense copy


@needs_cuda
def test_an_exact_cache_on_cuda_decodes_over_the_pages_as_dynamic_cache() -> None:
    cache = decode_over_pages_equals_dynamic_cache("cuda")
    assert cache.store.device.type == "cuda"
    assert isinstance(cache.store.pools[0].page_source(), TorchPageSource)
