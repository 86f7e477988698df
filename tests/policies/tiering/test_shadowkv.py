"""``shadowkv``'s page choice and placement ranking, on tensors: every decode step attends over each
head's window, its outliers and its ``pages`` best-scored others (all of them when they cover the
head), ascending and ``-1``-padded; the placement ranks outliers above the window above the rest,
choosing the outliers the step's choice chooses; bad parameters are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.tiering.shadowkv import OUTLIER_SCORE, ShadowKV, landmark_spread, outlier_pages
from kvlib.policy import LayerView


def summaries(batch: int, heads: int, pages: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(batch, heads, pages, dim, generator=generator)
    width = torch.rand(batch, heads, pages, dim, generator=generator) * 3
    return centre - width, centre + width


@settings(max_examples=60, deadline=None)
@given(
    pages=st.integers(0, 4),
    window=st.integers(1, 3),
    outliers=st.integers(0, 3),
    held=st.lists(st.integers(1, 12), min_size=2, max_size=2),
    group=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_each_step_reads_the_window_the_outliers_and_the_best_others(pages, window, outliers, held, group, seed) -> None:
    policy = ShadowKV(pages=pages, window=window, outliers=outliers)
    heads, dim = 2, 4
    key_min, key_max = summaries(1, heads, max(held), dim, seed)
    query = torch.randn(1, heads * group, 1, dim, generator=torch.Generator().manual_seed(seed + 1))
    used = torch.tensor([held])
    chosen = policy.select_pages(0, query, key_min, key_max, used)
    assert chosen.shape == (1, heads, min(window + outliers + pages, max(held)))
    spread = landmark_spread(key_min, key_max)
    for head, count in enumerate(held):
        picked = chosen[0, head]
        real = picked[picked >= 0]
        assert torch.equal(real, real.sort().values) and real.unique().numel() == real.numel()
        assert bool((picked[real.numel() :] == -1).all()) and bool((real < count).all())
        assert real.numel() == min(count, window + outliers + pages)  # every page when they cover the head
        newest = set(range(max(0, count - window), count))
        assert newest <= set(real.tolist())
        older = torch.arange(max(held)) < count - window
        if outliers and bool(older.any()):  # the widest older page is always read
            widest = int(spread[0, head].masked_fill(~older, float("-inf")).argmax())
            assert widest in real.tolist()


def test_the_best_scored_page_beyond_window_and_outliers_is_the_one_the_query_points_at() -> None:
    dim = 4
    key_min = torch.full((1, 1, 6, dim), -0.1)
    key_max = torch.full((1, 1, 6, dim), 0.1)
    key_min[0, 0, 2, 0] = key_max[0, 0, 2, 0] = 5.0  # page 2's landmark lies along the query
    query = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, dim)
    chosen = ShadowKV(pages=1, window=1, outliers=0).select_pages(0, query, key_min, key_max, torch.tensor([[6]]))
    assert chosen.tolist() == [[[2, 5]]]


def test_outlier_pages_are_the_widest_older_ones() -> None:
    spread = torch.tensor([[3.0, 9.0, 1.0, 7.0, 8.0]])
    older = torch.tensor([[True, True, True, True, False]])
    assert outlier_pages(spread, older, 2).tolist() == [[False, True, False, True, False]]
    assert outlier_pages(spread, older, 9).tolist() == older.tolist()
    assert not outlier_pages(spread, older, 0).any()


def test_landmark_spread_is_zero_for_a_page_of_one_key_and_grows_with_its_width() -> None:
    key = torch.tensor([1.0, -2.0, 0.5])
    assert landmark_spread(key, key) == 0
    assert landmark_spread(key - 0.1, key + 0.1) < landmark_spread(key - 1, key + 1)


def test_ranking_puts_outliers_above_the_window_above_the_rest_and_matches_the_step_choice() -> None:
    policy = ShadowKV(pages=1, window=2, outliers=1)
    size, pages, dim = 4, 6, 4
    keys = torch.randn(1, 1, pages * size - 2, dim, generator=torch.Generator().manual_seed(5))  # the last page half full
    keys[0, 0, 4:8] = torch.tensor([[4.0, 0, 0, 0], [-4.0, 0, 0, 0], [0, 4.0, 0, 0], [0, -4.0, 0, 0]])  # page 1: keys in all directions
    slots = keys.shape[2]
    valid = torch.ones(1, 1, slots, dtype=torch.bool)
    valid[0, 0, 0] = False  # padding
    view = LayerView(0, 1, keys, keys, torch.arange(slots).view(1, 1, -1), valid, page_size=size)
    scores = policy.ranking_scores(view)
    page_score = [scores[0, 0, p * size : (p + 1) * size].max().item() for p in range(pages)]
    assert scores[0, 0, 0] == float("-inf")
    assert page_score[1] >= OUTLIER_SCORE > page_score[5] > page_score[4] >= 1 > page_score[0] == page_score[2] == page_score[3] == 0
    padded = torch.nn.functional.pad(keys, (0, 0, 0, 2)).view(1, 1, pages, size, dim)
    key_min, key_max = padded.amin(3), padded.amax(3)
    key_min[0, 0, -1], key_max[0, 0, -1] = keys[0, 0, -2:].amin(0), keys[0, 0, -2:].amax(0)
    chosen = policy.select_pages(0, torch.zeros(1, 1, 1, dim), key_min, key_max, torch.tensor([[pages]]))
    assert 1 in chosen[0, 0].tolist()  # the placement's outlier is the step's outlier


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("shadowkv(pages=-1)", "pages must be >= 0"),
        ("shadowkv(window=0)", "window must be >= 1"),
        ("shadowkv(outliers=-2)", "outliers must be >= 0"),
        ("shadowkv(dense_layers=-1)", "dense_layers must be >= 0"),
        ("shadowkv(device_mb=0)", "device_mb must be > 0"),
        ("shadowkv(host_mb=-1)", "host_mb must be >= 0"),
        ("shadowkv(rank=4)", "rank"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_spec(spec)


@settings(max_examples=40, deadline=None)
@given(
    full_pages=st.integers(1, 8),
    tail=st.integers(1, 4),
    window=st.integers(1, 3),
    outliers=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_the_placement_keeps_on_the_device_the_outliers_the_step_reads(full_pages, tail, window, outliers, seed) -> None:
    """For any keys, the pages the ranking puts above the window (score >= OUTLIER_SCORE) are the
    outliers :meth:`select_pages` reads, computed from the same pages' min and max."""
    policy = ShadowKV(pages=0, window=window, outliers=outliers)
    size, dim, heads = 4, 3, 2
    slots = full_pages * size + tail
    keys = torch.randn(1, heads, slots, dim, generator=torch.Generator().manual_seed(seed)) * torch.rand(1, heads, slots, 1) * 4
    view = LayerView(
        0, 1, keys, keys, torch.arange(slots).expand(1, heads, slots), torch.ones(1, heads, slots, dtype=torch.bool), page_size=size
    )
    scores = policy.ranking_scores(view)
    count = full_pages + 1
    padded = torch.cat([keys, keys[:, :, -1:].expand(1, heads, count * size - slots, dim)], 2).view(1, heads, count, size, dim)
    key_min, key_max = padded.amin(3), padded.amax(3)
    chosen = policy.select_pages(0, torch.zeros(1, heads, 1, dim), key_min, key_max, torch.full((1, heads), count))
    for head in range(heads):
        ranked = {p for p in range(count) if scores[0, head, p * size : (p + 1) * size].max() >= OUTLIER_SCORE}
        window_pages = set(range(max(0, count - window), count))
        assert ranked == set(chosen[0, head].tolist()) - window_pages - {-1}
