"""snapkv: pooled window attention per KV group against a loop reference; window kept; no leaks."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import LayerView
from kvlib.selection import select_keep

BATCH, KV_HEADS, GROUPS, SLOTS, QUERIES = 2, 2, 3, 14, 6


def make_view(seed: int = 0, queries: int = QUERIES, layer: int = 0) -> LayerView:
    """Row 0: two slots of left padding. Row 1, head 1: earlier eviction (gaps in positions) and
    three empty slots at the end. Every head holds its row's newest ``queries`` positions."""
    generator = torch.Generator().manual_seed(seed)
    valid = torch.ones(BATCH, KV_HEADS, SLOTS, dtype=torch.bool)
    valid[0, :, :2] = False
    valid[1, 1, -3:] = False
    positions = torch.full((BATCH, KV_HEADS, SLOTS), -1, dtype=torch.int64)
    positions[0, :, 2:] = torch.arange(SLOTS - 2)
    positions[1, 0] = torch.arange(SLOTS)
    positions[1, 1, : SLOTS - 3] = torch.tensor([0, 2, 3, 5, 7] + list(range(SLOTS - 6, SLOTS)))
    logits = torch.randn(BATCH, KV_HEADS * GROUPS, queries, SLOTS, generator=generator)
    logits = logits.masked_fill(~valid.repeat_interleave(GROUPS, dim=1).unsqueeze(2), -torch.inf)
    keys = torch.randn(BATCH, KV_HEADS, SLOTS, 4, generator=generator)
    return LayerView(layer, 4, keys, keys.clone(), positions, valid, attention=torch.softmax(logits, dim=-1))


def snapkv_reference(view: LayerView, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV written out with loops: per query head, sum the last ``window`` queries' attention to
    each context token (valid, not in the window), pool over ``kernel`` slots (average divides by
    ``kernel``; slots outside the context count as 0, or are skipped for max), then average over
    the query heads of the KV group. Window tokens +inf, invalid -inf."""
    batch, heads, slots = view.valid.shape
    groups = view.attention.shape[1] // heads
    observed = min(window, view.attention.shape[2])
    out = torch.empty(batch, heads, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            newest = max(int(view.positions[b, h, s]) for s in range(slots) if view.valid[b, h, s])
            held = [bool(view.valid[b, h, s]) for s in range(slots)]
            in_window = [held[s] and int(view.positions[b, h, s]) > newest - observed for s in range(slots)]
            context = [bool(view.valid[b, h, s]) and not in_window[s] for s in range(slots)]
            pooled_heads = []
            for j in range(h * groups, (h + 1) * groups):
                rows = view.attention[b, j, view.attention.shape[2] - observed :]
                votes = [sum(float(rows[i, s]) for i in range(observed)) for s in range(slots)]
                pooled = []
                for s in range(slots):
                    near = [t for t in range(s - kernel // 2, s + kernel // 2 + 1) if 0 <= t < slots and context[t]]
                    if pooling == "avg":
                        pooled.append(sum(votes[t] for t in near) / kernel)
                    else:
                        pooled.append(max((votes[t] for t in near), default=-float("inf")))
                pooled_heads.append(pooled)
            for s in range(slots):
                if not view.valid[b, h, s]:
                    out[b, h, s] = -float("inf")
                elif in_window[s]:
                    out[b, h, s] = float("inf")
                else:
                    out[b, h, s] = sum(p[s] for p in pooled_heads) / groups
    return out


@pytest.mark.parametrize("window, kernel, pooling", [(4, 5, "avg"), (4, 5, "max"), (2, 3, "avg"), (1, 1, "max"), (32, 7, "avg")])
def test_scores_match_the_loop_reference(window, kernel, pooling):
    view = make_view(seed=window + kernel)
    scores = SnapKV(window=window, kernel=kernel, pooling=pooling).score(view)
    expected = snapkv_reference(view, window, kernel, pooling)
    assert scores.shape == (BATCH, KV_HEADS, SLOTS) and scores.dtype == torch.float32
    assert torch.equal(scores == torch.inf, expected == torch.inf)
    assert torch.equal(scores == -torch.inf, expected == -torch.inf)
    finite = expected.isfinite()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-5, atol=1e-6)


def test_attention_already_restricted_to_the_window_gives_the_same_scores():
    view = make_view(seed=3)
    policy = SnapKV(window=4)
    restricted = make_view(seed=3)
    restricted.attention = view.attention[:, :, -4:]
    assert torch.equal(policy.score(view), policy.score(restricted))


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_padding_and_window_attention_do_not_leak_through_pooling(pooling):
    view = make_view(seed=5)
    policy = SnapKV(window=4, kernel=5, pooling=pooling)
    before = policy.score(view)
    window = SnapKV.window_tokens(view, 4)
    noisy = make_view(seed=5)
    outside = (~view.valid | window).repeat_interleave(GROUPS, dim=1).unsqueeze(2).expand_as(view.attention)
    noisy.attention = torch.where(outside, 50.0, view.attention)  # huge weights on padding and window slots
    after = policy.score(noisy)
    context = view.valid & ~window
    assert torch.equal(before[context], after[context])


def test_window_tokens_are_always_kept():
    view = make_view(seed=7)
    scores = SnapKV(window=4).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, KV_HEADS), 6))
    for b in range(BATCH):
        for h in range(KV_HEADS):
            positions = {int(view.positions[b, h, s]) for s in kept[b, h].tolist() if s >= 0}
            newest = int(view.positions[b, h].max())
            assert set(range(newest - 3, newest + 1)) <= positions
            assert len(positions) == 6


def test_a_budget_below_the_window_keeps_the_newest_window_tokens():
    view = make_view(seed=7)
    scores = SnapKV(window=4).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, KV_HEADS), 2))
    for b in range(BATCH):
        for h in range(KV_HEADS):
            positions = {int(view.positions[b, h, s]) for s in kept[b, h].tolist() if s >= 0}
            newest = int(view.positions[b, h].max())
            assert positions == {newest - 1, newest}


def test_decode_step_protects_only_the_new_token():
    view = make_view(seed=9, queries=1)
    scores = SnapKV(window=32).score(view)
    newest = view.positions == view.positions.amax(dim=-1, keepdim=True)
    assert torch.all(scores[newest] == torch.inf)
    assert torch.all(scores[view.valid & ~newest].isfinite())
    assert torch.all(scores[~view.valid] == -torch.inf)


def test_registration_needs_and_observed_queries():
    assert kvlib.get_policy("snapkv") is SnapKV
    assert SnapKV.needs == frozenset({"attention"}) and SnapKV().needs == frozenset({"attention"})
    assert SnapKV().observed_queries() == 32 and SnapKV(window=8).observed_queries() == 8
    assert (SnapKV().window, SnapKV().kernel, SnapKV().pooling) == (32, 5, "avg")


def test_spec_round_trip():
    text = "snapkv(window=16, kernel=7, pooling='max')"
    policy = kvlib.parse_policy(text)
    assert policy == SnapKV(window=16, kernel=7, pooling="max")
    assert policy.spec() == text
    assert kvlib.parse_policy(policy.spec()) == policy
    assert SnapKV().spec() == "snapkv"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"window": 0}, "window must be >= 1"),
        ({"kernel": 4}, "kernel must be an odd integer >= 1"),
        ({"kernel": -1}, "kernel must be an odd integer >= 1"),
        ({"pooling": "median"}, "pooling"),
        ({"window": 2.0}, "window"),
    ],
)
def test_invalid_parameters_are_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        SnapKV(**params)
    arguments = ", ".join(f"{name}={value!r}" for name, value in params.items())
    with pytest.raises(kvlib.SpecError, match=message):
        kvlib.parse_spec(f"snapkv({arguments})")
