"""Shared-prefix attention (kvlib.kernels.shared_prefix): the split of a block table keeps every
row's tokens exactly once and reads shared full pages once per group; attention through the split
equals attention over the whole tables (the numba kernel, float64 dense attention, and the Triton
kernels in Triton's interpreter on the CPU); the partial attentions' log-sum-exps are exact and
merge exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.kernels.paged_attention import arena_source
from kvlib.kernels.paged_attention_torch import torch_arena_source
from kvlib.kernels.shared_prefix import MAX_GROUP_ROWS, MIN_SAVED_READS, PrefixSharing, attend_shared, merge_parts, share_prefixes
from tests.kernels.test_paged_attention import TOLERANCE


class Batch:
    """A decode batch over scattered pages: rows drawn from a few prompts (``families``), each
    attaching the first ``shared[b]`` full pages of its family's prompt by reference, then
    holding ``own[b]`` tokens of its own in fresh pages. Token ``i`` of a row is at position
    ``i``; the row's query comes after all of them."""

    def __init__(self, families, shared, own, kv_heads, page_size, dims, dtype, generator) -> None:
        dim, value_dim = dims
        self.page_size = page_size
        prompt_pages = [max([s for f, s in zip(families, shared) if f == family] + [0]) for family in range(max(families) + 1)]
        capacity = kv_heads * (sum(prompt_pages) + sum(-(-o // page_size) for o in own)) + 4
        order = torch.randperm(capacity, generator=generator).tolist()
        self.keys = torch.randn(capacity, page_size, dim, generator=generator).to(dtype)
        self.values = torch.randn(capacity, page_size, value_dim, generator=generator).to(dtype)
        self.positions = torch.full((capacity, page_size), -1, dtype=torch.int64)
        prompt = [[[order.pop() for _ in range(count)] for _ in range(kv_heads)] for count in prompt_pages]
        for heads in prompt:
            for ids in heads:
                for j, page in enumerate(ids):
                    self.positions[page] = torch.arange(j * page_size, (j + 1) * page_size)
        rows = []
        for family, attached, extra in zip(families, shared, own):
            heads = []
            for h in range(kv_heads):
                ids = prompt[family][h][:attached]
                for j in range(-(-extra // page_size)):
                    page = order.pop()
                    start = (attached + j) * page_size
                    self.positions[page] = torch.arange(start, start + page_size)
                    ids.append(page)
                heads.append(ids)
            rows.append(heads)
        width = max(1, max(len(ids) for heads in rows for ids in heads))
        self.pages = torch.full((len(rows), kv_heads, width), -1, dtype=torch.int64)
        for b, heads in enumerate(rows):
            for h, ids in enumerate(heads):
                self.pages[b, h, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self.lengths = torch.tensor([[s * page_size + o] * kv_heads for s, o in zip(shared, own)], dtype=torch.int64)
        self.query_positions = torch.tensor([int(self.lengths.max()) + 3])

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each (row, head)'s keys and values in slot order ``[batch, kv_heads, slots, dim]`` and
        whether each slot is stored."""
        ids = self.pages.clamp(min=0)
        batch, heads, width = ids.shape
        slots = torch.arange(width * self.page_size)
        stored = slots < self.lengths.unsqueeze(-1)
        keys = self.keys[ids].reshape(batch, heads, width * self.page_size, -1)
        values = self.values[ids].reshape(batch, heads, width * self.page_size, -1)
        return keys, values, stored


def reference(query: torch.Tensor, batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over each row's whole table, and each query's log-sum-exp."""
    keys, values, stored = batch.dense()
    group = query.shape[1] // keys.shape[1]
    scores = (query.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~stored.repeat_interleave(group, 1).unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ values.double().repeat_interleave(group, 1), lse


BATCHES = dict(
    families=st.lists(st.integers(0, 2), min_size=2, max_size=8),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    page_size=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)


def draw_batch(data, families, kv_heads, page_size, dims, dtype, seed) -> Batch:
    shared = data.draw(st.lists(st.integers(0, 6), min_size=len(families), max_size=len(families)))
    own = data.draw(st.lists(st.integers(1, 2 * page_size + 3), min_size=len(families), max_size=len(families)))
    return Batch(families, shared, own, kv_heads, page_size, dims, dtype, torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(**BATCHES)
def test_the_split_keeps_every_rows_tokens_once_and_reads_shared_pages_once(families, kv_heads, group, page_size, seed, data) -> None:
    batch = draw_batch(data, families, kv_heads, page_size, (8, 8), torch.float32, seed)
    sharing = share_prefixes(batch.pages, batch.lengths, page_size)
    full = batch.lengths.min(1).values // page_size
    shares_any = any(
        int(full[a].clamp(max=full[b])) > 0 and torch.equal(batch.pages[a, :, 0], batch.pages[b, :, 0])
        for a in range(len(families))
        for b in range(a)
    )
    assert (sharing is not None) == shares_any
    if sharing is None:
        return
    prefix_of = _prefix_pages(sharing, page_size)
    saved = 0
    for b in range(len(families)):
        shared_pages = prefix_of.get(b, torch.zeros(kv_heads, 0, dtype=torch.int64))
        own = sharing.suffix_pages[b][:, : -(-int(sharing.suffix_lengths[b].max()) // page_size)]
        whole = torch.cat([shared_pages, own], dim=1)
        assert torch.equal(whole, batch.pages[b][:, : whole.shape[1]])  # the row's pages, in order, each once
        assert bool((batch.pages[b][:, whole.shape[1] :] == -1).all())
        assert torch.equal(sharing.suffix_lengths[b] + shared_pages.shape[1] * page_size, batch.lengths[b])
        assert shared_pages.shape[1] <= int(full[b])  # only full pages are shared
    for shared in sharing.groups:
        for members, held in zip(shared.members, shared.lengths):
            rows = members.unique()
            assert len(rows) >= 2 and bool((held > 0).all())
            saved += (len(rows) - 1) * int(held.sum())
    assert sharing.tokens_read() == int(batch.lengths.sum()) - saved
    assert sharing.shared_rows == len(prefix_of)
    again = share_prefixes(batch.pages, batch.lengths, page_size, like=sharing)  # another layer's groups kept where they hold
    assert again.tokens_read() == sharing.tokens_read() and torch.equal(again.place, sharing.place)
    copied = batch.pages.clone()
    copied[sharing.runs[0][0][-1], :, 0] = copied.max() + 1  # a copy-on-write of one row's first page: its group no longer holds
    fresh, kept = share_prefixes(copied, batch.lengths, page_size), share_prefixes(copied, batch.lengths, page_size, like=sharing)
    assert (fresh is None) == (kept is None) and (fresh is None or fresh.tokens_read() == kept.tokens_read())


def _prefix_pages(sharing: PrefixSharing, page_size: int) -> dict[int, torch.Tensor]:
    """Each grouped row's shared pages ``[kv_heads, n]``, by batch row (padding rows of a group not counted)."""
    pages, place, start = {}, sharing.place.tolist(), 0
    for shared in sharing.groups:
        width = shared.members.shape[1]
        for index, members in enumerate(shared.members.tolist()):
            ids = shared.pages[index][:, : int(shared.lengths[index, 0]) // page_size]
            assert bool((ids >= 0).all()) and bool((shared.pages[index][:, ids.shape[1] :] == -1).all())
            for slot, row in enumerate(members):
                if place[row] == start + index * width + slot:
                    pages[row] = ids
        start += shared.members.numel()
    return pages


def test_rows_sharing_a_long_prefix_split_from_a_weaker_wider_group() -> None:
    """Four rows share 1 page; two pairs of them share 6: two groups of 6 pages save 12 page reads
    per head where one group of all four on 1 page saves 3."""
    batch = Batch([0, 0, 1, 1], [6, 6, 6, 6], [3, 5, 2, 9], 2, 4, (8, 8), torch.float32, torch.Generator().manual_seed(0))
    batch.pages[2:, :, 0] = batch.pages[0, :, 0]  # the second prompt begins with the first one's page
    sharing = share_prefixes(batch.pages, batch.lengths, 4)
    assert len(sharing.groups) == 1 and sorted(sorted(rows) for rows in sharing.groups[0].members.tolist()) == [[0, 1], [2, 3]]
    assert sharing.groups[0].lengths.tolist() == [[24, 24], [24, 24]]
    assert sharing.tokens_read() == int(batch.lengths.sum()) - 2 * 2 * 24


def test_a_group_of_more_than_max_group_rows_attends_in_parts() -> None:
    """20 rows sharing 3 pages: two parts of 10 rows, each reading the shared pages once; the
    attention still equals attention over the whole tables."""
    rows = 20
    batch = Batch([0] * rows, [3] * rows, list(range(1, rows + 1)), 2, 4, (8, 8), torch.float32, torch.Generator().manual_seed(2))
    sharing = share_prefixes(batch.pages, batch.lengths, 4)
    (shared,) = sharing.groups
    assert MAX_GROUP_ROWS == 16 and shared.members.shape == (2, 16) and sharing.shared_rows == rows
    assert sorted(len(set(members)) for members in shared.members.tolist()) == [10, 10]
    assert sharing.tokens_read() == int(batch.lengths.sum()) - 2 * 9 * 12 * 2  # (10 - 1) rows x 12 tokens x 2 heads, per part
    query = torch.randn(rows, 4, 1, 8, generator=torch.Generator().manual_seed(3))
    source = arena_source(batch.keys, batch.values, batch.positions)
    out = attend_shared(source, query, sharing, query_positions=batch.query_positions, scale=0.3)
    whole = source.attend(query, batch.pages, batch.lengths, visible=None, query_positions=batch.query_positions, scale=0.3)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)


def test_a_split_saving_fewer_reads_than_asked_is_not_made() -> None:
    """Two pairs of rows sharing 6 pages of 4 tokens in 2 heads save 2 x 6 x 4 x 2 = 96 reads: a
    split is made when asked to save at most that, not when asked for more."""
    batch = Batch([0, 0, 1, 1], [6, 6, 6, 6], [3, 5, 2, 9], 2, 4, (8, 8), torch.float32, torch.Generator().manual_seed(0))
    made = share_prefixes(batch.pages, batch.lengths, 4, min_saved=96)
    assert made is not None and int(batch.lengths.sum()) - made.tokens_read() == 96
    assert share_prefixes(batch.pages, batch.lengths, 4, min_saved=97) is None
    assert MIN_SAVED_READS > 96  # the Engine's default leaves so small a saving unsplit


def test_no_shared_full_page_no_split() -> None:
    batch = Batch([0, 1, 2], [3, 3, 3], [2, 2, 2], 1, 4, (8, 8), torch.float32, torch.Generator().manual_seed(1))
    assert share_prefixes(batch.pages, batch.lengths, 4) is None
    one_open_page = torch.tensor([[[5]], [[5]]])  # two rows holding 3 tokens of one page: not full, not shared
    assert share_prefixes(one_open_page, torch.tensor([[3], [3]]), 4) is None
    assert share_prefixes(batch.pages[:1], batch.lengths[:1], 4) is None


@settings(max_examples=30, deadline=None)
@given(dims=st.sampled_from([(8, 8), (16, 8), (32, 32)]), dtype=st.sampled_from([torch.float32, torch.bfloat16]), **BATCHES)
def test_attention_through_the_split_equals_attention_over_the_whole_tables(
    families, kv_heads, group, page_size, seed, data, dims, dtype
) -> None:
    batch = draw_batch(data, families, kv_heads, page_size, dims, dtype, seed)
    sharing = share_prefixes(batch.pages, batch.lengths, page_size)
    if sharing is None:
        return
    query = torch.randn(len(families), kv_heads * group, 1, dims[0], generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    scale = dims[0] ** -0.5
    source = arena_source(batch.keys, batch.values, batch.positions)
    out = attend_shared(source, query, sharing, query_positions=batch.query_positions, scale=scale)
    assert out.dtype == dtype and out.shape == (len(families), kv_heads * group, 1, dims[1])
    whole = source.attend(query, batch.pages, batch.lengths, visible=None, query_positions=batch.query_positions, scale=scale)
    tolerance = 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), whole.double(), atol=tolerance, rtol=tolerance)
    expected, _ = reference(query, batch, scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@settings(max_examples=20, deadline=None)
@given(**BATCHES)
def test_partial_attention_gives_the_exact_log_sum_exp(families, kv_heads, group, page_size, seed, data) -> None:
    batch = draw_batch(data, families, kv_heads, page_size, (16, 16), torch.float32, seed)
    query = torch.randn(len(families), kv_heads * group, 1, 16, generator=torch.Generator().manual_seed(seed))
    expected, lse = reference(query, batch, 0.25)
    options = dict(visible=None, query_positions=batch.query_positions, scale=0.25)
    for source in (arena_source(batch.keys, batch.values, batch.positions), torch_arena_source(batch.keys, batch.values, batch.positions)):
        out, sums = source.attend_parts(query, batch.pages, batch.lengths, **options)
        assert out.dtype == sums.dtype == torch.float32 and sums.shape == query.shape[:3]
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sums.double(), lse, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 12), cut=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_merging_two_parts_equals_softmax_over_their_union(tokens, cut, seed) -> None:
    """Any split of a query's tokens in two (either part possibly empty) merges to attention over all."""
    generator = torch.Generator().manual_seed(seed)
    scores, values = torch.randn(3, tokens, generator=generator).double() * 4, torch.randn(3, tokens, 5, generator=generator).double()
    cut = min(cut, tokens)

    def part(span: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s, v = scores[:, span], values[:, span]
        weights = torch.softmax(s, -1).nan_to_num(0.0) if s.shape[1] else s
        return (weights.unsqueeze(1) @ v).squeeze(1) if s.shape[1] else torch.zeros(3, 5).double(), torch.logsumexp(s, -1)

    merged = merge_parts(*part(slice(0, cut)), *part(slice(cut, tokens)))
    expected = (torch.softmax(scores, -1).unsqueeze(1) @ values).squeeze(1) if tokens else torch.zeros(3, 5).double()
    torch.testing.assert_close(merged, expected)


triton_kernels = pytest.importorskip(
    "kvlib.kernels.paged_attention_triton", reason="the Triton kernels need triton (the dev extra installs it)"
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the Triton kernels run: the GPU, else the CPU under Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET``)."""


@settings(max_examples=8, deadline=None)
@given(
    families=st.lists(st.integers(0, 1), min_size=2, max_size=5),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2]),
    page_size=st.sampled_from([4, 8]),
    splits=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_triton_kernels_give_the_parts_and_the_split_attention(families, kv_heads, group, page_size, splits, seed, data) -> None:
    """The Triton kernels' partial attention (both the one-split path and the split merge) equals
    the numba kernel's, output and log-sum-exp; attention through the split over a Triton source
    equals attention over the whole tables."""
    batch = draw_batch(data, families, kv_heads, page_size, (16, 16), torch.float32, seed)
    query = torch.randn(len(families), kv_heads * group, 1, 16, generator=torch.Generator().manual_seed(seed))
    options = dict(visible=None, query_positions=batch.query_positions, scale=0.25)
    numba = arena_source(batch.keys, batch.values, batch.positions)
    triton = triton_kernels.triton_arena_source(*(t.to(DEVICE) for t in (batch.keys, batch.values, batch.positions)))
    out, sums = triton_kernels.attend_parts_triton(query.to(DEVICE), triton, batch.pages, batch.lengths, splits=splits, **options)
    expected, expected_sums = numba.attend_parts(query, batch.pages, batch.lengths, **options)
    assert out.dtype == sums.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums.cpu(), expected_sums, atol=1e-5, rtol=1e-5)
    sharing = share_prefixes(batch.pages, batch.lengths, page_size)
    if sharing is not None:
        shared = attend_shared(triton, query.to(DEVICE), sharing, query_positions=batch.query_positions, scale=0.25)
        whole = numba.attend(query, batch.pages, batch.lengths, **options)
        torch.testing.assert_close(shared.cpu(), whole, atol=1e-5, rtol=1e-5)
