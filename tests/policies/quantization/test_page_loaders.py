"""The paged-attention kernel over coded pages (sealed pages decoded inside it, open ones read
raw) equals SDPA over the pool's own decoded pages, for every quantization codec."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import layer_shapes
from kvlib.spec_text import parse_policy
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig
from tests.kernels.test_paged_attention import sdpa_reference

CODECS = [
    "kivi(bits=2)",
    "kivi(bits=4, group=4)",
    "kivi(bits=8)",
    "kivi(bits=3, group=4)",
    "kv_bits(key_bits=3, value_bits=2)",
    "kv_bits(key_bits=4, value_bits=2)",
    "kv_bits(key_bits=8, value_bits=4, group=8)",
    "int8",
    "fp8",
    "gear",
    "gear(bits=2, rank=2, outliers=0.05, group=4)",
    "gear(bits=8, rank=0)",
    "gear(outliers=0)",
    "rotated(bits=2)",
    "rotated(bits=4, group=4)",
    "rotated(bits=8, seed=3)",
    "rotated(bits=3)",
    "mixed",
    "mixed(high_bits=4, low_bits=2, salient=0.5, group=4)",
    "mixed(high_bits=8, low_bits=4, salient=1.0)",
    "mixed(high_bits=4, low_bits=4, salient=0.0)",
    "mixed(high_bits=3, low_bits=2, salient=0.5)",
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Accumulation order, and the output's rounding to the query's dtype (as the kernel's own test)."""


def coded_store(spec: str, kv_heads: int, dims: tuple[int, int], page_size: int, dtype: torch.dtype) -> PagedStore:
    """A one-layer store whose sealed pages are encoded by ``spec``'s codec."""
    shapes = layer_shapes(1, kv_heads, dims[0], dims[1], page_size, dtype, torch.device("cpu"))
    codecs = parse_policy(spec).layer_codecs(shapes)
    return PagedStore(
        StoreConfig(1, kv_heads, dims[0], value_dim=dims[1], page_size=page_size, dtype=dtype, codecs=codecs, read_cache=False)
    )


def fill(store: PagedStore, batch: int, generator: torch.Generator) -> list[int]:
    """Sequences of ragged lengths (rows by their appends, heads by a compaction), full pages sealed."""
    pool = store.pools[0]
    heads = store.tables[0].lengths.shape[1]
    seqs = [store.new_sequence() for _ in range(batch)]

    def tokens(rows: int, count: int, dim: int) -> torch.Tensor:
        # channels with their own offsets and scales, as keys' outlier channels
        scale = torch.rand(dim, generator=generator) * 4 + 0.1
        offset = torch.randn(dim, generator=generator) * 3
        return (torch.randn(rows, heads, count, dim, generator=generator) * scale + offset).to(store.dtype)

    for count, rows in (
        (int(torch.randint(1, 30, (1,), generator=generator)), batch),
        (int(torch.randint(0, 20, (1,), generator=generator)), 1),
    ):
        if count:
            store.append(0, seqs[:rows], tokens(rows, count, pool.head_dim), tokens(rows, count, pool.value_dim))
    lengths = store.physical_lengths(0, seqs)
    keep = torch.full((batch, heads, int(lengths.max())), -1, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            n = int(lengths[b, h])
            kept = torch.sort(torch.randperm(n, generator=generator)[: int(torch.randint(0, n + 1, (1,), generator=generator))]).values
            keep[b, h, : kept.numel()] = kept
    if bool(torch.rand(1, generator=generator) < 0.7):
        store.compact(0, seqs, keep)
    store.seal(0, seqs)
    return seqs


def decoded_reference(store: PagedStore, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense ``(keys, values, positions)`` ``[batch, kv_heads, longest, dim]`` of ``seqs``, in
    float32 as the pool decodes them (its codec's ``decode_into`` a float32 buffer: no rounding
    to the compute dtype, which the kernel does not do either); open pages raw; positions -1 past
    each head's length."""
    pool, table = store.pools[0], store.tables[0]
    keys = torch.zeros(pool.capacity, pool.page_size, pool.head_dim)
    values = torch.zeros(pool.capacity, pool.page_size, pool.value_dim)
    sealed = pool.sealed.nonzero().squeeze(-1)
    if sealed.numel():
        pool.codec.decode_into(pool.encoded, sealed, pool.page_heads[sealed], keys, values, sealed)
    opened = (pool.raw_row >= 0).nonzero().squeeze(-1)
    keys[opened], values[opened] = pool.keys[pool.raw_row[opened]].float(), pool.values[pool.raw_row[opened]].float()
    lengths = store.physical_lengths(0, seqs)
    batch, heads = lengths.shape
    pages = table.pages[store._rows(seqs)][:, :, : -(-max(int(lengths.max()), 1) // pool.page_size)].clamp(min=0)
    dense = lambda arena: arena[pages].flatten(2, 3)  # noqa: E731  [batch, heads, slots, ...]
    positions = torch.where(torch.arange(pages.shape[2] * pool.page_size) < lengths.unsqueeze(-1), dense(pool.positions), -1)
    return dense(keys), dense(values), positions


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from(CODECS),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    queries=st.integers(1, 3),
    page_size=st.sampled_from([4, 8, 16]),
    dims=st.sampled_from([(8, 8), (16, 16), (32, 32), (16, 8)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.sampled_from([None, 9]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_over_coded_pages_equals_sdpa_over_their_decoded_reference(
    spec, batch, kv_heads, group, queries, page_size, dims, dtype, window, seed
) -> None:
    generator = torch.Generator().manual_seed(seed)
    store = coded_store(spec, kv_heads, dims, page_size, dtype)
    seqs = fill(store, batch, generator)
    paged = store.paged_layer(0, seqs)
    assert paged is not None
    logical = int(store.logical_lengths(0, seqs).max()) + queries
    query_positions = torch.arange(logical - queries, logical)
    padding = torch.randint(0, 4, (batch,), generator=generator)
    columns = torch.arange(logical)
    visible = (columns <= query_positions.view(-1, 1)).unsqueeze(0) & (columns >= padding.view(-1, 1, 1))
    if window is not None:
        visible &= (query_positions.view(-1, 1) - columns < window).unsqueeze(0)
    query = torch.randn(batch, kv_heads * group, queries, dims[0], generator=generator).to(dtype)
    scale = dims[0] ** -0.5
    out = paged.attend(query, visible=visible, query_positions=None, scale=scale)
    expected = sdpa_reference(query, *decoded_reference(store, seqs), visible, scale)
    assert out.dtype == dtype and out.shape == (batch, kv_heads * group, queries, dims[1])
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("spec", ["int8", "kivi(bits=4)"])
def test_open_pages_are_read_exactly_and_sealed_pages_as_decoded(spec: str) -> None:
    """One key per page that matches the query: the output is that page's value row, raw where
    the page is open and the pool's float32 decode where it is sealed."""
    store = coded_store(spec, 1, (16, 16), 4, torch.float32)
    seq = store.new_sequence()
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.zeros(1, 1, 6, 16), torch.randn(1, 1, 6, 16, generator=generator)
    store.append(0, [seq], keys, values)
    store.seal(0, [seq])  # page 0 (tokens 0-3) sealed, page 1 (tokens 4-5) open
    paged = store.paged_layer(0, [seq])
    decoded = store.read(0, [seq], mirror=False).values[0, 0]
    for token in (1, 5):
        visible = torch.zeros(1, 1, 6, dtype=torch.bool)
        visible[0, 0, token] = True
        out = paged.attend(torch.ones(1, 1, 1, 16), visible=visible, query_positions=None, scale=1.0)
        torch.testing.assert_close(out[0, 0, 0], decoded[token], atol=1e-6, rtol=1e-6)
    assert torch.equal(decoded[5], values[0, 0, 5])


@pytest.mark.parametrize("spec", ["svd(rank=4)", "think(keep=0.5)"])
def test_codecs_without_a_page_loader_are_read_densely(spec: str) -> None:
    store = coded_store(spec, 1, (16, 16), 4, torch.float32)
    seq = store.new_sequence()
    store.append(0, [seq], torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16))
    assert store.paged_layer(0, [seq]) is None
