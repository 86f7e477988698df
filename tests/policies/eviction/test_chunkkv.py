"""chunkkv: chunk sums of the inner scores against a loop reference; whole chunks kept; layer reuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import kvlib
from kvlib.policies.budget.pyramid import Pyramid
from kvlib.policies.eviction.chunkkv import ChunkKV
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, LayerView
from kvlib.selection import select_keep
from tests.policies.eviction.test_snapkv import make_view, snapkv_reference


@dataclass
class Given(Eviction):
    """A test inner that returns whatever ``scores`` it was handed (not registered)."""

    needs: ClassVar[frozenset[str]] = frozenset({"queries"})

    def score(self, view: LayerView) -> torch.Tensor:
        return self.scores


def given(scores: torch.Tensor) -> Given:
    inner = Given()
    inner.scores = scores
    return inner


def line_view(heads_positions: list[list[int]], slots: int, layer: int = 0) -> LayerView:
    """One row; head ``h`` holds ``heads_positions[h]`` (ascending) in its first slots, the rest empty."""
    positions = torch.full((1, len(heads_positions), slots), -1, dtype=torch.int64)
    for h, held in enumerate(heads_positions):
        positions[0, h, : len(held)] = torch.tensor(held)
    keys = torch.zeros(*positions.shape, 2)
    return LayerView(layer, 4, keys, keys, positions, positions >= 0)


def chunk_reference(view: LayerView, inner: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Each finite-scored valid token gets the sum of the finite inner scores of its head's valid
    tokens with the same ``position // chunk_size``; non-finite inner scores stay; invalid -inf."""
    batch, heads, slots = view.valid.shape
    out = torch.empty(batch, heads, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            sums: dict[int, float] = {}
            for s in range(slots):
                value = float(inner[b, h, s])
                if view.valid[b, h, s] and abs(value) != float("inf") and value == value:
                    chunk = int(view.positions[b, h, s]) // chunk_size
                    sums[chunk] = sums.get(chunk, 0.0) + value
            for s in range(slots):
                value = float(inner[b, h, s])
                if not view.valid[b, h, s]:
                    out[b, h, s] = -float("inf")
                elif abs(value) == float("inf"):
                    out[b, h, s] = value
                else:
                    out[b, h, s] = sums[int(view.positions[b, h, s]) // chunk_size]
    return out


def assert_scores_equal(scores: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(scores == torch.inf, expected == torch.inf)
    assert torch.equal(scores == -torch.inf, expected == -torch.inf)
    finite = expected.isfinite()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-5, atol=1e-6)


def kept_positions(view: LayerView, scores: torch.Tensor, cap: int) -> list[list[list[int]]]:
    caps = torch.full(view.valid.shape[:2], cap)
    kept = select_keep(scores, view.valid, caps)
    return [
        [sorted(int(view.positions[b, h, s]) for s in kept[b, h].tolist() if s >= 0) for h in range(kept.shape[1])]
        for b in range(kept.shape[0])
    ]


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 20])
def test_chunk_sums_of_given_scores_match_the_loop_reference(chunk_size):
    view = make_view(seed=2)  # left padding in row 0, gaps in row 1 head 1
    generator = torch.Generator().manual_seed(chunk_size)
    inner = torch.randn(view.valid.shape, generator=generator)
    inner[0, 0, 5] = torch.inf
    inner[1, 1, 3] = -torch.inf
    scores = ChunkKV(inner=given(inner), chunk_size=chunk_size).score(view)
    assert scores.dtype == torch.float32
    assert_scores_equal(scores, chunk_reference(view, inner, chunk_size))


def test_chunk_sums_of_snapkv_scores_match_the_references():
    view = make_view(seed=4)
    scores = ChunkKV(inner=SnapKV(window=3, kernel=3), chunk_size=4).score(view)
    assert_scores_equal(scores, chunk_reference(view, snapkv_reference(view, 3, 3, "avg"), 4))


def test_chunks_follow_positions_not_slots():
    view = line_view([[0, 1, 2, 3, 4, 5]], slots=9)
    view.positions = torch.roll(view.positions, 3, dims=-1)  # three empty slots first (left padding)
    view.valid = view.positions >= 0
    inner = torch.tensor([[[9.0, 9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]])
    scores = ChunkKV(inner=given(inner), chunk_size=3).score(view)
    assert scores[0, 0, 3:].tolist() == [6.0, 6.0, 6.0, 15.0, 15.0, 15.0]


def test_whole_chunks_are_kept_best_chunk_sums_first():
    generator = torch.Generator().manual_seed(0)
    view = line_view([list(range(20)), list(range(20))], slots=20)
    inner = torch.rand(1, 2, 20, generator=generator)
    policy = ChunkKV(inner=given(inner), chunk_size=4)
    scores = policy.score(view)
    kept = kept_positions(view, scores, 8)
    for h in range(2):
        sums = [float(inner[0, h, 4 * c : 4 * c + 4].sum()) for c in range(5)]
        best = sorted(range(5), key=lambda c: -sums[c])[:2]
        assert kept[0][h] == sorted(p for c in best for p in range(4 * c, 4 * c + 4))
    # a cap that is no multiple of the chunk size cuts only the next best chunk, keeping its first tokens
    kept = kept_positions(view, scores, 10)
    for h in range(2):
        sums = [float(inner[0, h, 4 * c : 4 * c + 4].sum()) for c in range(5)]
        first, second, third = sorted(range(5), key=lambda c: -sums[c])[:3]
        whole = [p for c in (first, second) for p in range(4 * c, 4 * c + 4)]
        assert kept[0][h] == sorted(whole + [4 * third, 4 * third + 1])


def test_equal_chunk_scores_go_to_the_earlier_chunk():
    view = line_view([list(range(12))], slots=12)
    scores = ChunkKV(inner=given(torch.ones(1, 1, 12)), chunk_size=4).score(view)
    assert kept_positions(view, scores, 8) == [[list(range(8))]]


def test_snapkv_window_stays_kept_token_by_token():
    view = make_view(seed=6)
    scores = ChunkKV(inner=SnapKV(window=4, kernel=3), chunk_size=5).score(view)
    window = SnapKV.window_tokens(view, 4)
    assert torch.all(scores[window] == torch.inf)
    assert torch.all(scores[view.valid & ~window].isfinite())
    for b, row in enumerate(kept_positions(view, scores, 4)):
        for h, held in enumerate(row):
            newest = int(view.positions[b, h].max())
            assert held == list(range(newest - 3, newest + 1))


def test_reuse_keeps_the_same_positions_in_the_layers_of_a_group():
    policy = ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3, reuse_layers=2)
    first, second, third = make_view(seed=1, layer=0), make_view(seed=2, layer=1), make_view(seed=3, layer=2)
    chosen = policy.score(first)
    reused = policy.score(second)
    assert torch.equal(reused, chosen)
    assert kept_positions(second, reused, 7) == kept_positions(first, chosen, 7)
    assert not torch.equal(ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3).score(second), chosen)
    # the next group chooses afresh, and its second layer reuses that choice
    fresh = ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3).score(third)
    assert torch.equal(policy.score(third), fresh)
    assert torch.equal(policy.score(make_view(seed=4, layer=3)), fresh)


def test_reuse_maps_chunks_by_position_and_drops_chunks_the_choosing_layer_lacked():
    policy = ChunkKV(inner=given(torch.tensor([[[1.0, 2, 3, 4, 5, 6, 7, 8, 0, 0]]])), chunk_size=4, reuse_layers=4)
    first = line_view([[0, 1, 2, 3, 8, 9, 10, 11]], slots=10, layer=0)  # chunk 0 sums to 10, chunk 2 to 26
    policy.score(first)
    policy.inner = given(torch.full((1, 1, 10), 100.0))
    second = line_view([[0, 4, 5, 9, 10, 11]], slots=10, layer=3)  # chunk 1 (positions 4, 5) was not in layer 0
    scores = policy.score(second)
    assert scores[0, 0, :6].tolist() == [10.0, -torch.inf, -torch.inf, 26.0, 26.0, 26.0]


def test_no_reuse_across_calls_or_without_reuse_layers():
    policy = ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3, reuse_layers=2)
    policy.score(make_view(seed=1, layer=0))
    later = make_view(seed=2, layer=1)
    later.positions = torch.where(later.valid, later.positions + 1, -1)  # the next call: newer positions
    fresh = ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3).score(later)
    assert torch.equal(policy.score(later), fresh)
    single = ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3)
    single.score(make_view(seed=1, layer=0))
    second = make_view(seed=2, layer=1)
    assert torch.equal(single.score(second), ChunkKV(inner=SnapKV(window=2, kernel=3), chunk_size=3).score(second))


def test_needs_observed_queries_and_default_budget_come_from_the_inner():
    assert ChunkKV().needs == frozenset({"attention"})
    assert ChunkKV(inner="knorm").needs == frozenset()
    assert ChunkKV.needs == frozenset()  # what the registry sees on the class
    assert ChunkKV().observed_queries() == 32
    assert ChunkKV(inner="snapkv(window=8)").observed_queries() == 8
    assert ChunkKV(inner="knorm").observed_queries() is None
    assert ChunkKV().default_budget() is None
    assert ChunkKV(inner="pyramidkv(beta=7)").default_budget() == Pyramid(beta=7, reserved=32)


def test_registration_spec_round_trip_and_state_outside_equality():
    assert kvlib.get_policy("chunkkv") is ChunkKV
    assert (ChunkKV().inner, ChunkKV().chunk_size, ChunkKV().reuse_layers) == (SnapKV(), 10, 1)
    text = "chunkkv(inner='snapkv(window=16)', chunk_size=4, reuse_layers=2)"
    policy = kvlib.parse_policy(text)
    assert policy == ChunkKV(inner=SnapKV(window=16), chunk_size=4, reuse_layers=2)
    assert policy.spec() == text
    assert kvlib.parse_policy(policy.spec()) == policy
    assert ChunkKV().spec() == "chunkkv"
    policy.score(make_view(seed=1))
    assert policy == kvlib.parse_policy(text) and "_choice" not in repr(policy)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"reuse_layers": 0}, "reuse_layers must be >= 1"),
        ({"inner": "pyramid"}, "expected a eviction policy"),
        ({"inner": "snapkv(kernel=2)"}, "kernel must be an odd integer"),
        ({"inner": 3}, "inner"),
    ],
)
def test_invalid_parameters_are_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        ChunkKV(**params)
    arguments = ", ".join(f"{name}={value!r}" for name, value in params.items())
    with pytest.raises(kvlib.SpecError, match=message):
        kvlib.parse_spec(f"chunkkv({arguments})")
