"""Tests of kvlib/selection.py: which token indices each head keeps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.selection import select_keep

INF, NAN = math.inf, math.nan


def keep(scores: list, candidates: list, caps: list) -> list:
    """``select_keep`` on nested lists; returns the kept index sets per head (padding checked)."""
    out = select_keep(torch.tensor(scores), torch.tensor(candidates), torch.tensor(caps))
    width = out.shape[-1]
    result = []
    for b, row in enumerate(out.tolist()):
        result.append([])
        for h, head in enumerate(row):
            kept = [i for i in head if i >= 0]
            assert head == kept + [-1] * (width - len(kept)), "padding must follow the kept indices"
            result[b].append(set(kept))
    return result


def test_keeps_the_best_candidates_up_to_each_cap() -> None:
    scores = [[[0.1, 0.9, 0.5, 0.7], [3.0, 1.0, 2.0, 0.0]]]
    candidates = [[[True] * 4, [True] * 4]]
    assert keep(scores, candidates, [[2, 3]]) == [[{1, 3}, {0, 1, 2}]]
    assert keep(scores, candidates, [[0, 1]]) == [[set(), {0}]]


def test_a_head_keeps_min_of_cap_and_candidates() -> None:
    scores = [[[5.0, 4.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]], [[0.0, 0.5, 0.25, 1.0], [1.0, 1.0, 1.0, 1.0]]]
    candidates = [[[True, False, True, False], [False] * 4], [[True] * 4, [False, False, False, True]]]
    out = select_keep(torch.tensor(scores), torch.tensor(candidates), torch.tensor([[9, 2], [3, 5]]))
    assert out.shape == (2, 2, 3)  # the widest head keeps 3
    assert keep(scores, candidates, [[9, 2], [3, 5]]) == [[{0, 2}, set()], [{1, 2, 3}, {3}]]
    assert out[0, 1].tolist() == [-1, -1, -1]


def test_output_is_int64_on_the_cpu_padded_to_the_widest_head() -> None:
    scores = torch.rand(2, 3, 6)
    candidates = torch.ones(2, 3, 6, dtype=torch.bool)
    caps = torch.tensor([[1, 4, 2], [0, 3, 1]], dtype=torch.int32)
    out = select_keep(scores, candidates, caps)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.shape == (2, 3, 4)
    assert (out >= 0).sum(-1).tolist() == [[1, 4, 2], [0, 3, 1]]


@pytest.mark.parametrize("caps", [[[0, 0]], [[3, 5]]])
def test_nothing_to_keep_gives_width_zero(caps: list) -> None:
    scores = torch.rand(1, 2, 4)
    candidates = torch.zeros(1, 2, 4, dtype=torch.bool) if caps[0][0] else torch.ones(1, 2, 4, dtype=torch.bool)
    out = select_keep(scores, candidates, torch.tensor(caps))
    assert out.shape == (1, 2, 0) and out.dtype == torch.int64


def test_empty_batch_and_empty_slots() -> None:
    assert select_keep(torch.zeros(0, 2, 3), torch.ones(0, 2, 3, dtype=torch.bool), torch.zeros(0, 2)).shape == (0, 2, 0)
    assert select_keep(torch.zeros(1, 2, 0), torch.ones(1, 2, 0, dtype=torch.bool), torch.ones(1, 2)).shape == (1, 2, 0)


@pytest.mark.parametrize("bad", [-INF, NAN])
def test_non_candidates_are_never_kept_even_over_the_worst_candidates(bad: float) -> None:
    scores = [[[bad, INF, bad, 1e30, bad, NAN]]]
    candidates = [[[True, False, True, False, True, False]]]
    assert keep(scores, candidates, [[2]])[0][0] <= {0, 2, 4}
    assert keep(scores, candidates, [[3]]) == [[{0, 2, 4}]]
    assert keep(scores, candidates, [[6]]) == [[{0, 2, 4}]]


def test_infinite_scores_are_kept_first() -> None:
    scores = [[[5.0, INF, 7.0, -1.0, INF], [-INF, 0.0, NAN, 2.0, -3.0]]]
    candidates = [[[True] * 5, [True] * 5]]
    first, second = keep(scores, candidates, [[1, 1]])[0]
    assert first in ({1}, {4}) and second == {3}
    assert keep(scores, candidates, [[2, 3]]) == [[{1, 4}, {1, 3, 4}]]
    first, second = keep(scores, candidates, [[3, 4]])[0]
    assert first == {1, 2, 4}
    assert second in ({0, 1, 3, 4}, {1, 2, 3, 4})  # NaN and -inf are the lowest: either may come fourth


def test_nan_ranks_below_every_finite_score() -> None:
    scores = [[[NAN, -1e30, 3.0, NAN, -5.0]]]
    assert keep(scores, [[[True] * 5]], [[3]]) == [[{1, 2, 4}]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_score_dtypes(dtype: torch.dtype) -> None:
    scores = torch.tensor([[[0.5, -2.0, 8.0, INF, NAN]]], dtype=dtype)
    out = select_keep(scores, torch.ones(1, 1, 5, dtype=torch.bool), torch.tensor([[3]]))
    assert set(out[0, 0].tolist()) == {0, 2, 3}


@pytest.mark.parametrize(
    ("scores", "candidates"),
    [
        (torch.zeros(1, 2, 3), torch.ones(1, 2, 4, dtype=torch.bool)),
        (torch.zeros(1, 2, 3), torch.ones(2, 2, 3, dtype=torch.bool)),
        (torch.zeros(2, 3), torch.ones(1, 2, 3, dtype=torch.bool)),
    ],
)
def test_shape_mismatch_raises(scores: torch.Tensor, candidates: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="scores must have shape"):
        select_keep(scores, candidates, torch.ones(1, 2, dtype=torch.int64))


@pytest.mark.parametrize(("dtype", "big"), [(torch.float32, torch.finfo(torch.float32).max), (torch.float64, 1e300)])
def test_infinity_is_kept_before_the_largest_finite_scores(dtype: torch.dtype, big: float) -> None:
    for scores in ([big, INF], [INF, big]):
        out = select_keep(torch.tensor([[scores]], dtype=dtype), torch.ones(1, 1, 2, dtype=torch.bool), torch.tensor([[1]]))
        assert scores[int(out[0, 0, 0])] == INF


# -- property test against a per-head Python reference ------------------------------------------

SPECIAL = st.sampled_from([INF, -INF, NAN])
FINITE = {  # every finite value of the dtype, its largest included (it must still rank below +inf)
    torch.float32: st.floats(allow_nan=False, allow_infinity=False, width=32),
    torch.float64: st.floats(allow_nan=False, allow_infinity=False),
}


def rank(score: float) -> tuple[int, float]:
    """The documented order: +inf first, then finite scores, then NaN and -inf (lowest)."""
    if math.isnan(score) or score == -INF:
        return (0, 0.0)
    if score == INF:
        return (2, 0.0)
    return (1, score)


@st.composite
def problems(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, slots = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 7))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    score = st.one_of(FINITE[dtype], SPECIAL, st.sampled_from([0.0, 1.0, -1.0]))  # small values tie often
    values = draw(st.lists(score, min_size=batch * heads * slots, max_size=batch * heads * slots))
    if dtype == torch.float64 and values and draw(st.booleans()):  # neighbours that float32 would merge
        values[0] = 1.0
        values[-1] = 1.0 + 2.0**-40
    flags = draw(st.lists(st.booleans(), min_size=batch * heads * slots, max_size=batch * heads * slots))
    caps = draw(st.lists(st.integers(0, slots + 2), min_size=batch * heads, max_size=batch * heads))
    return (
        torch.tensor(values, dtype=dtype).view(batch, heads, slots),
        torch.tensor(flags, dtype=torch.bool).view(batch, heads, slots),
        torch.tensor(caps, dtype=torch.int64).view(batch, heads),
    )


@settings(max_examples=200, deadline=None)
@given(problems())
def test_select_keep_matches_a_per_head_reference(problem) -> None:
    scores, candidates, caps = problem
    out = select_keep(scores, candidates, caps)
    batch, heads, _ = scores.shape
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    expected_counts = [[min(int(caps[b, h]), int(candidates[b, h].sum())) for h in range(heads)] for b in range(batch)]
    assert out.shape == (batch, heads, max((c for row in expected_counts for c in row), default=0))
    for b in range(batch):
        for h in range(heads):
            count = expected_counts[b][h]
            kept = out[b, h].tolist()
            assert all(i >= 0 for i in kept[:count]) and all(i == -1 for i in kept[count:])
            kept = kept[:count]
            assert len(set(kept)) == count, "an index is kept twice"
            assert all(bool(candidates[b, h, i]) for i in kept), "a non-candidate was kept"
            pool = sorted((rank(float(scores[b, h, i])) for i in range(scores.shape[2]) if candidates[b, h, i]), reverse=True)
            got = sorted((rank(float(scores[b, h, i])) for i in kept), reverse=True)
            assert got == pool[:count], "the kept scores are not the best ones"
