"""rkv: importance minus redundancy against a loop reference; window kept; bad parameters refused."""

from __future__ import annotations

import math

import pytest
import torch

from kvlib.policies.eviction.rkv import RKV
from tests.policies.eviction.recent_view import GROUPS, assert_ranks_like, recent_view


def rkv_reference(view, window: int, kernel: int, mix: float, redundancy: str) -> dict:
    """R-KV written out per head: each window query's attention renormalised over the context
    tokens (valid, older than the head's newest ``window`` positions), averaged over the queries,
    max-pooled over ``kernel`` neighbouring context slots, averaged over the group; redundancy the
    softmax over the context of each key's mean (max) cosine similarity to the head's other keys."""
    expected = {}
    batch, heads, slots = view.valid.shape
    observed = view.recent_attention.shape[2]
    for b in range(batch):
        for h in range(heads):
            newest = max(int(view.positions[b, h, s]) for s in range(slots) if view.valid[b, h, s])
            context = [s for s in range(slots) if view.valid[b, h, s] and int(view.positions[b, h, s]) <= newest - window]
            if not context:
                continue
            importance = {s: 0.0 for s in context}
            for j in range(h * GROUPS, (h + 1) * GROUPS):
                mean = {s: 0.0 for s in context}
                for i in range(observed):
                    total = sum(float(view.recent_attention[b, j, i, s]) for s in context)
                    for s in context:
                        mean[s] += (float(view.recent_attention[b, j, i, s]) / total if total > 0 else 0.0) / observed
                for s in context:
                    near = [t for t in context if abs(t - s) <= kernel // 2]
                    importance[s] += max(mean[t] for t in near) / GROUPS
            keys = [view.keys[b, h, s].double() for s in range(slots)]
            units = [k / (k.norm() + 1e-8) for k in keys]
            similarity = {}
            for s in context:
                others = [float(units[s] @ units[t]) for t in range(slots) if t != s and view.valid[b, h, t]]
                similarity[s] = (sum(others) / len(others) if redundancy == "mean" else max(others)) if others else 0.0
            norm = sum(math.exp(v) for v in similarity.values())
            for s in context:
                expected[b, h, s] = mix * importance[s] - (1 - mix) * math.exp(similarity[s]) / norm
    return expected


@pytest.mark.parametrize(
    "window, kernel, mix, redundancy", [(4, 7, 0.1, "mean"), (4, 3, 0.5, "max"), (1, 1, 1.0, "mean"), (6, 5, 0.0, "max")]
)
def test_scores_match_the_loop_reference(window, kernel, mix, redundancy):
    view = recent_view(window, seed=window + kernel)
    scores = RKV(window=window, kernel=kernel, mix=mix, redundancy=redundancy).score(view)
    assert scores.shape == view.valid.shape
    assert_ranks_like(scores, view, window, rkv_reference(view, window, kernel, mix, redundancy))


def test_duplicated_keys_score_lowest_by_max_similarity():
    view = recent_view(2, seed=1)
    view.recent_attention = torch.zeros_like(view.recent_attention)
    view.keys[0, 0, 5] = view.keys[0, 0, 4] * 2.0  # same direction: cosine similarity 1
    scores = RKV(window=2, mix=0.0, redundancy="max").score(view)
    others = [s for s in range(2, 14) if s not in (4, 5)]  # the rest of head (0, 0)'s context
    assert float(scores[0, 0, 4]) < float(scores[0, 0, others].min()) and float(scores[0, 0, 5]) < float(scores[0, 0, others].min())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"window": 0}, "window must be >= 1"),
        ({"kernel": 4}, "kernel must be an odd"),
        ({"mix": 1.5}, "mix must be in"),
        ({"redundancy": "min"}, "redundancy"),
    ],
)
def test_bad_parameters_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        RKV(**options)
