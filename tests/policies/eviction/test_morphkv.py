"""morphkv: fused recent-window attention per KV group against a loop reference; window kept."""

from __future__ import annotations

import pytest

from kvlib.policies.eviction.morphkv import MorphKV
from tests.policies.eviction.recent_view import GROUPS, assert_ranks_like, newest_tokens, recent_view


def morphkv_reference(view, window: int, fusion: str) -> dict:
    """Per older token: over each query head of its group, the sum (or max) of the window queries'
    attention to it; then the mean over the group."""
    expected = {}
    batch, heads, slots = view.valid.shape
    for b in range(batch):
        for h in range(heads):
            for s in set(range(slots)) - newest_tokens(view, b, h, window):
                if not view.valid[b, h, s]:
                    continue
                per_head = []
                for j in range(h * GROUPS, (h + 1) * GROUPS):
                    column = [float(view.recent_attention[b, j, i, s]) for i in range(view.recent_attention.shape[2])]
                    per_head.append(sum(column) if fusion == "sum" else max(column))
                expected[b, h, s] = sum(per_head) / GROUPS
    return expected


@pytest.mark.parametrize("window, fusion", [(4, "sum"), (4, "max"), (1, "sum"), (6, "max")])
def test_scores_match_the_loop_reference(window, fusion):
    view = recent_view(window, seed=window)
    scores = MorphKV(window=window, fusion=fusion).score(view)
    assert scores.shape == view.valid.shape
    assert_ranks_like(scores, view, window, morphkv_reference(view, window, fusion))


@pytest.mark.parametrize("options, message", [({"window": 0}, "window must be >= 1"), ({"fusion": "mean"}, "fusion")])
def test_bad_parameters_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        MorphKV(**options)
