"""vatp: accumulated attention times the value L1 norm, with a recent window and attention sinks."""

from __future__ import annotations

import math

import pytest
import torch

import kvlib
from kvlib.policies.eviction.vatp import VATP
from kvlib.policy import Eviction, LayerView
from kvlib.selection import select_keep

BATCH, HEADS, SLOTS, DIM = 2, 3, 12, 5
LENGTHS = [[12, 9, 5], [10, 12, 2]]  # valid tokens per (row, head); the rest are invalid slots at the end


def make_view(lengths=LENGTHS, seed=0, first_position=0) -> LayerView:
    generator = torch.Generator().manual_seed(seed)
    valid = torch.arange(SLOTS) < torch.tensor(lengths).unsqueeze(-1)
    positions = torch.where(valid, torch.arange(SLOTS) + first_position, -1)
    keys = torch.randn(BATCH, HEADS, SLOTS, DIM, generator=generator)
    values = torch.randn(BATCH, HEADS, SLOTS, DIM, generator=generator)
    accumulated = torch.rand(BATCH, HEADS, SLOTS, generator=generator) * 3
    return LayerView(0, 1, keys, values, positions, valid, accumulated_attention=accumulated)


def importance(view: LayerView, b: int, h: int, s: int) -> float:
    """The paper's score: accumulated attention times the L1 norm of the value vector."""
    return float(view.accumulated_attention[b, h, s]) * sum(abs(float(x)) for x in view.values[b, h, s])


def valid_slots(view: LayerView, b: int, h: int) -> list[int]:
    return [s for s in range(SLOTS) if view.valid[b, h, s]]


@pytest.mark.parametrize("recent, sinks", [(0, 0), (3, 0), (0, 2), (3, 2), (20, 20)])
def test_scores_are_attention_times_value_norm_with_window_and_sinks_above(recent, sinks):
    view = make_view()
    scores = VATP(recent=recent, sinks=sinks).score(view)
    assert scores.shape == (BATCH, HEADS, SLOTS)
    for b in range(BATCH):
        heavy, sink_scores, window_scores = [], [], []
        for h in range(HEADS):
            slots = valid_slots(view, b, h)
            window = slots[max(len(slots) - recent, 0) :]
            head_sinks = [s for s in slots if s not in window and int(view.positions[b, h, s]) < sinks]
            for s in range(SLOTS):
                if not view.valid[b, h, s]:
                    assert float(scores[b, h, s]) == -math.inf
                elif s not in window and s not in head_sinks:
                    assert float(scores[b, h, s]) == pytest.approx(importance(view, b, h, s), rel=1e-5)
                    heavy.append(float(scores[b, h, s]))
            ordered_window = [float(scores[b, h, s]) for s in window]
            assert ordered_window == sorted(set(ordered_window))  # newest highest
            ordered_sinks = [float(scores[b, h, s]) for s in head_sinks]
            assert ordered_sinks == sorted(set(ordered_sinks), reverse=True)  # earliest highest
            sink_scores += ordered_sinks
            window_scores += ordered_window
        assert all(math.isfinite(x) for x in sink_scores + window_scores)
        # across every head of a row: window above sinks above importance
        if window_scores and sink_scores:
            assert min(window_scores) > max(sink_scores)
        if sink_scores and heavy:
            assert min(sink_scores) > max(heavy)
        if window_scores and heavy:
            assert min(window_scores) > max(heavy)


def reference_keep(view: LayerView, b: int, h: int, cap: int, recent: int, sinks: int) -> set[int]:
    """Window first (newest first), then sinks (earliest first), then the highest importance."""
    slots = valid_slots(view, b, h)
    window = list(reversed(slots[max(len(slots) - recent, 0) :]))
    head_sinks = [s for s in slots if s not in window and int(view.positions[b, h, s]) < sinks]
    rest = sorted((s for s in slots if s not in window and s not in head_sinks), key=lambda s: importance(view, b, h, s), reverse=True)
    return set((window + head_sinks + rest)[:cap])


@pytest.mark.parametrize("recent, sinks", [(0, 0), (2, 0), (0, 3), (2, 3), (4, 2)])
@pytest.mark.parametrize("cap", [1, 3, 4, 6, 9, 12])
def test_select_keep_keeps_window_then_sinks_then_importance(recent, sinks, cap):
    view = make_view(seed=1)
    scores = VATP(recent=recent, sinks=sinks).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, HEADS), cap))
    for b in range(BATCH):
        for h in range(HEADS):
            got = {int(s) for s in kept[b, h] if s >= 0}
            assert got == reference_keep(view, b, h, cap, recent, sinks), (b, h)


def test_sinks_with_tiny_values_are_kept_only_as_sinks():
    view = make_view(seed=2)
    view.accumulated_attention[:, :, :2] = 50.0  # the sinks draw most attention...
    view.values[:, :, :2] = 1e-4  # ...but carry almost no value, as the paper observes
    without = select_keep(VATP(recent=2, sinks=0).score(view), view.valid, torch.full((BATCH, HEADS), 4))
    with_sinks = select_keep(VATP(recent=2, sinks=2).score(view), view.valid, torch.full((BATCH, HEADS), 4))
    for b in range(BATCH):
        for h in range(HEADS):
            if len(valid_slots(view, b, h)) >= 6:  # enough other tokens to fill the 2 non-window places
                assert not {0, 1} & set(without[b, h].tolist())
                assert {0, 1} <= set(with_sinks[b, h].tolist())


def test_sinks_are_positions_not_slots():
    view = make_view(seed=3, first_position=5)  # positions 0..4 were evicted earlier: no sinks remain
    scores = VATP(recent=0, sinks=4).score(view)
    for b in range(BATCH):
        for h in range(HEADS):
            for s in valid_slots(view, b, h):
                assert float(scores[b, h, s]) == pytest.approx(importance(view, b, h, s), rel=1e-5)


def test_parameters_are_validated():
    with pytest.raises(ValueError, match="recent must be >= 0, got -1"):
        VATP(recent=-1)
    with pytest.raises(ValueError, match="sinks must be >= 0, got -3"):
        VATP(sinks=-3)
    with pytest.raises(kvlib.SpecError, match="sinks must be >= 0"):
        kvlib.parse_spec("vatp(sinks=-1)")
    with pytest.raises(kvlib.SpecError, match="'recent' must be int"):
        kvlib.parse_spec("vatp(recent='4')")


def test_spec_round_trip_and_registration():
    assert kvlib.parse_policy("vatp").spec() == "vatp"
    policy = kvlib.parse_policy("vatp(recent=8, sinks=4)")
    assert policy == VATP(recent=8, sinks=4) and policy.spec() == "vatp(recent=8, sinks=4)"
    assert kvlib.parse_policy(policy.spec()) == policy
    assert (VATP().recent, VATP().sinks) == (32, 20)
    assert kvlib.get_policy("vatp") is VATP and issubclass(VATP, Eviction)
    assert VATP.needs == frozenset({"accumulated_attention"})
