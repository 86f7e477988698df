"""lagkv: scores against a per-token loop computation of the paper's formula; what is kept."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import kvlib
from kvlib.policies.eviction.lagkv import LagKV
from kvlib.policy import LayerView
from kvlib.selection import select_keep
from kvlib.spec_text import parse_policy

BATCH, HEADS, SLOTS, DIM = 2, 3, 23, 5
LENGTHS = [[23, 14, 3], [0, 11, 19]]  # valid slots per (row, head): a prefix of the head's slots


def make_view(lengths=LENGTHS, slots=SLOTS, seed=0, dtype=torch.float32) -> LayerView:
    generator = torch.Generator().manual_seed(seed)
    valid = torch.arange(slots) < torch.tensor(lengths).unsqueeze(-1)
    batch, heads = valid.shape[:2]
    keys = torch.randn(batch, heads, slots, DIM, generator=generator).to(dtype)
    values = torch.randn(batch, heads, slots, DIM + 1, generator=generator).to(dtype)
    return LayerView(0, 1, keys, values, torch.where(valid, torch.arange(slots) * 3, -1), valid)


def softmax_of_lag_std(current: list[list[float]], reference: list[list[float]]) -> list[float]:
    """Softmax over the partition of each token's channel std after min-max scaling by the reference."""
    channels = range(len(current[0]))
    low = [min(token[c] for token in reference) for c in channels]
    high = [max(token[c] for token in reference) for c in channels]
    normalised = [[(token[c] - low[c]) / ((high[c] - low[c]) or 1.0) for c in channels] for token in current]
    stds = [statistics.stdev(token) for token in normalised]
    total = sum(math.exp(s) for s in stds)
    return [math.exp(s) / total for s in stds]


def reference(view: LayerView, policy: LagKV) -> list[list[list[float]]]:
    """Per head: its valid slots in stored order, cut into sinks, partitions and window."""
    sink, lag = policy.n_sink, policy.lag_size
    batch, heads, slots = view.valid.shape
    result = []
    for b in range(batch):
        rows = []
        for h in range(heads):
            stored = [s for s in range(slots) if view.valid[b, h, s]]
            scores = [-math.inf] * slots
            for rank, s in enumerate(stored):
                scores[s] = math.inf if rank < sink else 2.0 + rank
            for p in range((len(stored) - sink) // lag - 1 if len(stored) > sink else 0):
                start = sink + p * lag

                def tokens(tensor, first):
                    return [tensor[b, h, stored[first + i]].double().tolist() for i in range(lag)]

                raw = [
                    k + v
                    for k, v in zip(
                        softmax_of_lag_std(tokens(view.keys, start), tokens(view.keys, start + lag)),
                        softmax_of_lag_std(tokens(view.values, start), tokens(view.values, start + lag)),
                    )
                ]
                ascending = sorted(range(lag), key=lambda i: raw[i])
                for i in range(lag):
                    scores[stored[start + i]] = raw[i] if policy.cross_scoring else ascending.index(i) / lag
            rows.append(scores)
        result.append(rows)
    return result


@pytest.mark.parametrize(
    "policy",
    [
        LagKV(n_sink=2, lag_size=4),
        LagKV(n_sink=2, lag_size=4, cross_scoring=True),
        LagKV(n_sink=0, lag_size=3, cross_scoring=True),
        LagKV(n_sink=5, lag_size=2),
    ],
    ids=lambda s: s.spec(),
)
def test_scores_match_the_paper_formula(policy):
    view = make_view(seed=1)
    scores = policy.score(view)
    assert scores.dtype == torch.float32 and scores.shape == (BATCH, HEADS, SLOTS)
    expected = torch.tensor(reference(view, policy), dtype=torch.float64)
    assert torch.allclose(scores.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cross_scoring", [False, True])
def test_left_padding_and_holes_follow_the_valid_slots(cross_scoring):
    view = make_view(seed=6)
    view.valid[0, 0, :3] = False  # left padding, as at a padded prefill
    view.valid[1, 2, 7] = False  # a hole
    view.keys[~view.valid] = float("nan")  # whatever invalid slots hold must not leak
    policy = LagKV(n_sink=2, lag_size=4, cross_scoring=cross_scoring)
    scores = policy.score(view)
    expected = torch.tensor(reference(view, policy), dtype=torch.float64)
    assert torch.allclose(scores.double(), expected, rtol=1e-5, atol=1e-6)
    assert scores[0, 0, 3] == scores[0, 0, 4] == torch.inf and scores[0, 0, 5] < 1


def test_budget_keeps_sinks_window_and_an_equal_share_of_each_partition():
    view = make_view(seed=2)
    policy = LagKV(n_sink=2, lag_size=4)
    raw = reference(view, LagKV(n_sink=2, lag_size=4, cross_scoring=True))
    # head (0, 0): 23 tokens = 2 sinks, scored partitions 2-5, 6-9, 10-13, 14-17, window 18-22
    # (the last full partition and the remainder); head (1, 2): 19 tokens, scored 2-5, 6-9, 10-13, window 14-18
    for (b, h, partitions, window), per_partition in [((0, 0, 4, 5), 1), ((0, 0, 4, 5), 3), ((1, 2, 3, 5), 2)]:
        sub = LayerView(
            0,
            1,
            view.keys[b : b + 1, h : h + 1],
            view.values[b : b + 1, h : h + 1],
            view.positions[b : b + 1, h : h + 1],
            view.valid[b : b + 1, h : h + 1],
        )
        cap = 2 + window + per_partition * partitions  # sinks + window + a share of each partition
        kept = set(select_keep(policy.score(sub), sub.valid, torch.tensor([[cap]]))[0, 0].tolist())
        length = int(view.valid[b, h].sum())
        expected = {0, 1} | set(range(length - window, length))
        for p in range(partitions):
            start = 2 + 4 * p
            expected |= set(sorted(range(start, start + 4), key=lambda s: raw[b][h][s])[-per_partition:])
        assert kept == expected, (b, h, per_partition)


def test_budget_smaller_than_the_window_keeps_sinks_then_newest():
    view = make_view(seed=3)
    scores = LagKV(n_sink=2, lag_size=4).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, HEADS), 5))
    assert set(kept[0, 0].tolist()) == {0, 1, 20, 21, 22}
    assert set(kept[1, 1].tolist()) == {0, 1, 8, 9, 10}  # 11 tokens: 2 partitions, the first one scored
    assert set(kept[0, 2].tolist()) == {0, 1, 2, -1}  # 3 tokens: all kept (-1 pads the index list)


@pytest.mark.parametrize("lengths, slots", [([[0, 1, 2]], 2), ([[1, 2, 3]], 3), ([[0, 0, 0]], 0), ([[6, 9, 10]], 10)])
def test_tiny_sequences_give_no_nan(lengths, slots):
    view = make_view(lengths=lengths, slots=slots)
    scores = LagKV(n_sink=2, lag_size=4).score(view)
    assert scores.shape == view.valid.shape and not scores.isnan().any()
    assert (scores[~view.valid] == -torch.inf).all() and (scores[view.valid] > -torch.inf).all()


def test_constant_reference_channels_stay_finite():
    view = make_view(seed=4)
    view.keys[..., 0] = 1.5  # zero min-max range in channel 0 of every reference
    view.values[..., :] = 0.0  # and in every value channel
    for policy in (LagKV(n_sink=2, lag_size=4), LagKV(n_sink=2, lag_size=4, cross_scoring=True)):
        scores = policy.score(view)
        assert not scores.isnan().any() and (scores[view.valid] > -torch.inf).all()
        expected = torch.tensor(reference(view, policy), dtype=torch.float64)
        assert torch.allclose(scores.double(), expected, rtol=1e-5, atol=1e-6)


def test_half_precision_and_rows_independent():
    view = make_view(seed=5, dtype=torch.bfloat16)
    policy = LagKV(n_sink=2, lag_size=4, cross_scoring=True)
    scores = policy.score(view)
    assert scores.dtype == torch.float32 and not scores.isnan().any()
    for b in range(BATCH):
        rows = slice(b, b + 1)
        alone = LayerView(0, 1, view.keys[rows], view.values[rows], view.positions[rows], view.valid[rows])
        assert torch.equal(policy.score(alone)[0], scores[b])


@pytest.mark.parametrize("kwargs, message", [({"n_sink": -1}, "n_sink must be >= 0"), ({"lag_size": 1}, "lag_size must be >= 2")])
def test_parameter_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LagKV(**kwargs)
    with pytest.raises(kvlib.SpecError, match=message):
        parse_policy(f"lagkv({next(iter(kwargs))}={next(iter(kwargs.values()))})")


def test_spec_round_trip_and_registration():
    policy = parse_policy("lagkv(n_sink=8, lag_size=64, cross_scoring=True)")
    assert policy == LagKV(n_sink=8, lag_size=64, cross_scoring=True)
    assert parse_policy(policy.spec()) == policy
    assert LagKV().spec() == "lagkv" and (LagKV().n_sink, LagKV().lag_size, LagKV().cross_scoring) == (4, 128, False)
    assert kvlib.get_policy("lagkv") is LagKV and LagKV.needs == frozenset()
