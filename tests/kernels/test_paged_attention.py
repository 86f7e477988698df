"""paged_attention equals SDPA over the dense form of the same pages, under the model's mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.kernels.paged_attention import arena_source, paged_attention
from kvlib.kernels.paged_scores import attention_weights


def scattered_pages(lengths: torch.Tensor, page_size: int, dim: int, value_dim: int, dtype, generator):
    """Arenas whose pages are handed out in a shuffled order, a block table over them, and the
    dense ``[batch, kv_heads, max_len, dim]`` keys, values and positions they hold."""
    batch, heads = lengths.shape
    counts = (lengths + page_size - 1) // page_size
    capacity = int(counts.sum()) + 3
    order = torch.randperm(capacity, generator=generator)
    keys = torch.randn(capacity, page_size, dim, generator=generator).to(dtype)
    values = torch.randn(capacity, page_size, value_dim, generator=generator).to(dtype)
    positions = torch.full((capacity, page_size), -1, dtype=torch.int64)
    pages = torch.full((batch, heads, max(int(counts.max()), 1)), -1, dtype=torch.int64)
    longest = max(int(lengths.max()), 1)
    dense_keys = torch.zeros(batch, heads, longest, dim, dtype=dtype)
    dense_values = torch.zeros(batch, heads, longest, value_dim, dtype=dtype)
    dense_positions = torch.full((batch, heads, longest), -1, dtype=torch.int64)
    taken = 0
    for b in range(batch):
        for h in range(heads):
            n = int(lengths[b, h])
            # each head keeps a sorted random subset of the logical positions (as after eviction)
            kept = torch.sort(torch.randperm(n + 5, generator=generator)[:n]).values
            for j in range(int(counts[b, h])):
                page = int(order[taken])
                taken += 1
                pages[b, h, j] = page
                span = slice(j * page_size, min((j + 1) * page_size, n))
                filled = span.stop - span.start
                positions[page, :filled] = kept[span]
                dense_keys[b, h, span] = keys[page, :filled]
                dense_values[b, h, span] = values[page, :filled]
                dense_positions[b, h, span] = kept[span]
    return keys, values, positions, pages, dense_keys, dense_values, dense_positions


def sdpa_reference(query, dense_keys, dense_values, dense_positions, visible, scale):
    """SDPA in float64 over the dense slots, each slot masked by its position's visibility."""
    return reference_weights(query, dense_keys, dense_positions, visible, scale) @ dense_values.double().repeat_interleave(
        query.shape[1] // dense_keys.shape[1], dim=1
    )


def reference_weights(query, dense_keys, dense_positions, visible, scale):
    """Softmax weights in float64 over the dense slots, each slot masked by its position's visibility."""
    batch, query_heads, queries, _ = query.shape
    group = query_heads // dense_keys.shape[1]
    stored = dense_positions >= 0
    columns = dense_positions.clamp(min=0).unsqueeze(2).expand(-1, -1, queries, -1)
    allowed = visible.unsqueeze(1).expand(-1, dense_keys.shape[1], -1, -1).gather(-1, columns) & stored.unsqueeze(2)
    allowed = allowed.repeat_interleave(group, dim=1)
    keys = dense_keys.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing: zeros


def padded_causal_mask(lengths: torch.Tensor, queries: int, window: int | None, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``queries`` logical positions past the longest head (with 5 to spare) and a mask
    over logical positions: causal, random left padding (0-3 tokens) masked out per row, and a
    sliding ``window`` when given. Returns ``(query_positions [queries], visible [batch, queries, logical])``."""
    logical = int(lengths.max()) + 5 + queries
    query_positions = torch.arange(logical - queries, logical)
    padding = torch.randint(0, 4, (lengths.shape[0],), generator=generator)  # left padding, masked out
    columns = torch.arange(logical)
    visible = (columns <= query_positions.view(-1, 1)).unsqueeze(0) & (columns >= padding.view(-1, 1, 1))
    if window is not None:
        visible &= (query_positions.view(-1, 1) - columns < window).unsqueeze(0)
    return query_positions, visible


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4]),
    queries=st.integers(1, 4),
    page_size=st.sampled_from([1, 4, 16]),
    dims=st.sampled_from([(8, 8), (32, 32), (64, 64), (16, 8)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.sampled_from([None, 7]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_sdpa_over_the_dense_pages(batch, kv_heads, group, queries, page_size, dims, dtype, window, seed):
    generator = torch.Generator().manual_seed(seed)
    dim, value_dim = dims
    lengths = torch.randint(0, 40, (batch, kv_heads), generator=generator)
    keys, values, positions, pages, dense_keys, dense_values, dense_positions = scattered_pages(
        lengths, page_size, dim, value_dim, dtype, generator
    )
    _, visible = padded_causal_mask(lengths, queries, window, generator)
    query = torch.randn(batch, kv_heads * group, queries, dim, generator=generator).to(dtype)
    scale = dim**-0.5
    out = paged_attention(query, keys, values, positions, pages, lengths, visible=visible, query_positions=None, scale=scale)
    expected = sdpa_reference(query, dense_keys, dense_values, dense_positions, visible, scale)
    assert out.dtype == dtype and out.shape == (batch, kv_heads * group, queries, value_dim)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3]),
    queries=st.integers(1, 3),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attention_weights_over_pages_equal_softmax_over_the_dense_slots(batch, kv_heads, group, queries, page_size, dtype, causal, seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 40, (batch, kv_heads), generator=generator)
    keys, values, positions, pages, dense_keys, _, dense_positions = scattered_pages(lengths, page_size, 16, 16, dtype, generator)
    query_positions, visible = padded_causal_mask(lengths, queries, None, generator)
    if causal:
        visible = (torch.arange(visible.shape[-1]) <= query_positions.view(-1, 1)).unsqueeze(0).expand(batch, -1, -1)
    query = torch.randn(batch, kv_heads * group, queries, 16, generator=generator).to(dtype)
    weights = attention_weights(
        query,
        arena_source(keys, values, positions),
        pages,
        lengths,
        visible=None if causal else visible,
        query_positions=query_positions if causal else None,
        scale=0.25,
    )
    expected = reference_weights(query, dense_keys, dense_positions, visible, 0.25)
    longest = dense_keys.shape[2]
    assert weights.dtype == torch.float32 and weights.shape == (batch, kv_heads * group, queries, pages.shape[2] * page_size)
    torch.testing.assert_close(weights[..., :longest].double(), expected, atol=1e-5, rtol=1e-4)
    assert not bool(weights[..., longest:].any())


def test_causal_visibility_by_query_positions_equals_the_same_mask_given_whole() -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([[30, 12]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 8, 16, 16, torch.float32, generator)
    query = torch.randn(1, 4, 2, 16, generator=generator)
    query_positions = torch.tensor([20, 34])
    visible = (torch.arange(35) <= query_positions.view(-1, 1)).unsqueeze(0)
    by_positions = paged_attention(
        query, keys, values, positions, pages, lengths, visible=None, query_positions=query_positions, scale=0.25
    )
    by_mask = paged_attention(query, keys, values, positions, pages, lengths, visible=visible, query_positions=None, scale=0.25)
    assert torch.equal(by_positions, by_mask)


def test_softcap_bounds_the_scores_as_tanh_does() -> None:
    generator = torch.Generator().manual_seed(2)
    lengths = torch.tensor([[9]])
    keys, values, positions, pages, dense_keys, dense_values, dense_positions = scattered_pages(lengths, 4, 8, 8, torch.float32, generator)
    query = torch.randn(1, 1, 1, 8, generator=generator) * 10
    out = paged_attention(
        query, keys, values, positions, pages, lengths, visible=None, query_positions=torch.tensor([20]), scale=1.0, softcap=2.0
    )
    scores = 2.0 * torch.tanh((query.double() @ dense_keys.double().transpose(-1, -2)) / 2.0)
    expected = torch.softmax(scores, -1) @ dense_values.double()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_mismatched_heads_and_unsupported_dtypes_are_refused() -> None:
    lengths = torch.tensor([[4, 4]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 4, 8, 8, torch.float32, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        paged_attention(
            torch.randn(1, 3, 1, 8), keys, values, positions, pages, lengths, visible=None, query_positions=torch.tensor([9]), scale=1.0
        )
    with pytest.raises(ValueError, match="pages must be one of"):
        paged_attention(
            torch.randn(1, 2, 1, 8),
            keys.double(),
            values.double(),
            positions,
            pages,
            lengths,
            visible=None,
            query_positions=torch.tensor([9]),
            scale=1.0,
        )
