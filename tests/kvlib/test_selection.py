"""Tests of kvlib/selection.py: which token indices each head keeps."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.selection import apportion, rank_order, select_keep

INF, NAN = math.inf, math.nan


def keep(scores: list, candidates: list, caps: list) -> list:
    """``select_keep`` on nested lists; returns the kept index sets per head (padding checked)."""
    out = select_keep(torch.tensor(scores), torch.tensor(candidates), torch.tensor(caps))
    width = out.shape[-1]
    result = []
    for b, row in enumerate(out.tolist()):
        result.append([])
        for head in row:
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


def tie_key(score: float, slot: int) -> int:
    """Ties: +inf scores rank later slots first (the newest of a protected window); others keep slot order."""
    return slot if score == INF else -slot


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


# -- rank_order: the full order select_keep takes its prefix from -------------------------------


@settings(max_examples=150, deadline=None)
@given(problems())
def test_rank_order_sorts_candidates_by_documented_rank_with_stable_ties(problem) -> None:
    scores, candidates, caps = problem
    order = rank_order(scores, candidates)
    batch, heads, slots = scores.shape
    assert order.shape == scores.shape and order.dtype == torch.int64
    for b in range(batch):
        for h in range(heads):
            ranked = order[b, h].tolist()
            assert sorted(ranked) == list(range(slots)), "not a permutation of the slots"
            flags = candidates[b, h].tolist()
            count = sum(flags)
            assert all(flags[i] for i in ranked[:count]) and not any(flags[i] for i in ranked[count:])
            keys = [(rank(float(scores[b, h, i])), tie_key(float(scores[b, h, i]), i)) for i in ranked[:count]]
            finite_first = [key for key in keys if key[0][0] > 0]  # NaN and -inf: last, in either order
            assert finite_first == sorted(finite_first, reverse=True) and keys[: len(finite_first)] == finite_first


@settings(max_examples=150, deadline=None)
@given(problems())
def test_select_keep_is_the_prefix_of_rank_order(problem) -> None:
    scores, candidates, caps = problem
    order = rank_order(scores, candidates)
    out = select_keep(scores, candidates, caps)
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            count = min(int(caps[b, h]), int(candidates[b, h].sum()))
            assert out[b, h, :count].tolist() == order[b, h, :count].tolist()


def test_rank_order_ties_nan_with_minus_infinity_and_keeps_slot_order() -> None:
    # documented: "+inf (later slots first), then finite scores descending, then NaN and -inf ...;
    # other ties keep slot order".
    # NaN is mapped to -inf to tie with it, but nan_to_num also maps -inf itself to the lowest finite
    # float, so every -inf ranks before every NaN whatever their slots.
    scores = torch.tensor([[[NAN, 2.0, -INF, INF, 2.0, NAN, INF, -0.5]]])
    candidates = torch.tensor([[[True, True, True, True, True, True, True, False]]])
    assert rank_order(scores, candidates)[0, 0].tolist() == [6, 3, 1, 4, 0, 2, 5, 7]


def test_rank_order_accepts_integer_scores() -> None:
    scores = torch.tensor([[[3, 1, 2, 3]]])
    assert rank_order(scores, torch.ones(1, 1, 4, dtype=torch.bool))[0, 0].tolist() == [0, 3, 2, 1]


# -- apportion: integer shares proportional to weights -----------------------------------------


def exact_shares(total: int, weights: list[float]) -> list[Fraction]:
    """Each part's exact share of ``total`` for the float ``weights`` (no rounding anywhere)."""
    exact = [Fraction(w) for w in weights]
    whole = sum(exact)
    return [Fraction(total) * w / whole for w in exact]


WEIGHT = st.one_of(
    st.just(0.0),
    st.integers(1, 6).map(float),  # equal weights tie; small integers give exact and repeated shares
    st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.floats(min_value=1e-300, max_value=1e-290),
)


@st.composite
def apportion_problems(draw: st.DrawFn) -> tuple[list[int], list[float]]:
    weights = draw(st.lists(WEIGHT, min_size=1, max_size=9).filter(lambda w: sum(w) > 0))
    totals = draw(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**31)), min_size=1, max_size=4))
    return totals, weights


@settings(max_examples=300, deadline=None)
@given(apportion_problems())
def test_apportion_rows_sum_to_totals_and_parts_round_their_exact_share(problem) -> None:
    totals, weights = problem
    out = apportion(torch.tensor(totals), torch.tensor(weights, dtype=torch.float64))
    assert out.dtype == torch.int64 and out.shape == (len(totals), len(weights))
    for total, row in zip(totals, out.tolist()):
        assert sum(row) == total
        shares = exact_shares(total, weights)
        for part, share in zip(row, shares):
            assert math.floor(share) <= part <= math.ceil(share), (part, share)
        for i, w in enumerate(weights):
            if w == 0.0:
                assert row[i] == 0, "a zero weight got a unit"
        # the leftover units go to the largest remainders (within float error); equal weights: lower index first
        raised = [i for i, (p, s) in enumerate(zip(row, shares)) if p > math.floor(s)]
        left = [i for i, (p, s) in enumerate(zip(row, shares)) if p == math.floor(s) and s != math.floor(s)]
        tolerance = 1e-9 + total * 1e-14
        for i in raised:
            for j in left:
                assert shares[i] - math.floor(shares[i]) >= shares[j] - math.floor(shares[j]) - tolerance
        for i in range(len(weights)):
            for j in range(i + 1, len(weights)):
                if weights[i] == weights[j]:
                    assert row[i] >= row[j] and row[i] - row[j] <= 1


def test_apportion_worked_examples() -> None:
    assert apportion(torch.tensor([10]), torch.tensor([1.0, 1.0, 1.0])).tolist() == [[4, 3, 3]]
    assert apportion(torch.tensor([2]), torch.tensor([1.0, 1.0, 1.0])).tolist() == [[1, 1, 0]]
    out = apportion(torch.tensor([7, 0, 1]), torch.tensor([0.0, 3.0, 1.0]))
    assert out.tolist() == [[0, 5, 2], [0, 0, 0], [0, 1, 0]]
    # 15.6, 11.8, 8, 4.2, 0.4: floors sum to 38, the two largest remainders (0.8, 0.6) get the rest
    pyramid = torch.tensor([1.95, 1.475, 1.0, 0.525, 0.05], dtype=torch.float64)
    assert apportion(torch.tensor([40]), pyramid).tolist() == [[16, 12, 8, 4, 0]]


def test_apportion_accepts_other_weight_dtypes_and_scales() -> None:
    half = torch.tensor([0.25, 0.75], dtype=torch.float16)
    for weights in (torch.tensor([1, 3]), half, torch.tensor([1e-30, 3e-30])):
        assert apportion(torch.tensor([8]), weights).tolist() == [[2, 6]]


@pytest.mark.parametrize(
    "weights",
    [
        [1.0, -0.5],
        [0.0, 0.0],
        [],
        [NAN, 1.0],
        [[1.0, 2.0]],
    ],
    ids=["negative", "all-zero", "empty", "nan", "2-D"],
)
def test_apportion_rejects_bad_weights(weights: list) -> None:
    with pytest.raises(ValueError, match="non-negative numbers with a positive sum"):
        apportion(torch.tensor([5]), torch.tensor(weights, dtype=torch.float64))


def test_apportion_rejects_an_infinite_weight() -> None:
    # an infinite weight has no proportional share: inf / inf is NaN and the parts are garbage
    with pytest.raises(ValueError, match="weights"):
        apportion(torch.tensor([10]), torch.tensor([1.0, INF], dtype=torch.float64))


def test_apportion_sums_to_totals_when_the_weight_sum_overflows() -> None:
    # each weight is finite and non-negative, as documented; only their float sum overflows to inf
    big = torch.finfo(torch.float64).max / 2
    out = apportion(torch.tensor([10, 7]), torch.tensor([big, big, big], dtype=torch.float64))
    assert out.sum(-1).tolist() == [10, 7]
    assert out.tolist() == [[4, 3, 3], [3, 2, 2]]
