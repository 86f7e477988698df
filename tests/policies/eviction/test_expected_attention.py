"""expected_attention: un-rotation and scores against a plain numpy / loop computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvlib
from kvlib.policies.eviction.expected_attention import ExpectedAttention, unrotate
from kvlib.policy import LayerView, Rope
from kvlib.selection import select_keep
from kvlib.spec_text import parse_policy

BATCH, KV_HEADS, GROUPS, DIM, SLOTS = 2, 2, 2, 8, 9
ROPE = Rope(1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM), scaling=1.3)
QUERY_POSITIONS = [[-1, -1, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7]]  # row 0 is left-padded
LENGTHS = [[9, 6], [7, 9]]  # valid slots per (row, kv head), a prefix of the head's slots


def rope_rotate(x: np.ndarray, position: int, rope: Rope) -> np.ndarray:
    """One vector rotated the Llama way, pair by pair (channel i with i + d/2), times scaling."""
    half = len(x) // 2
    out = np.empty_like(x)
    for i in range(half):
        angle = position * float(rope.inv_freq[i])
        out[i] = x[i] * math.cos(angle) - x[i + half] * math.sin(angle)
        out[i + half] = x[i + half] * math.cos(angle) + x[i] * math.sin(angle)
    return out * rope.scaling


def make_view(seed: int = 0, query_positions=QUERY_POSITIONS, rope: Rope | None = ROPE):
    """A view whose queries are RoPE-rotated (numpy) from known pre-RoPE queries, returned too."""
    generator = torch.Generator().manual_seed(seed)
    query_positions = torch.tensor(query_positions)
    q_len = query_positions.shape[1]
    pre_rope = torch.randn(BATCH, KV_HEADS * GROUPS, q_len, DIM, generator=generator, dtype=torch.float64)
    queries = pre_rope.clone()
    if rope is not None:
        for b in range(BATCH):
            for h in range(KV_HEADS * GROUPS):
                for t in range(q_len):
                    rotated = rope_rotate(pre_rope[b, h, t].numpy(), int(query_positions[b, t]), rope)
                    queries[b, h, t] = torch.from_numpy(rotated)
    valid = torch.arange(SLOTS) < torch.tensor(LENGTHS).unsqueeze(-1)
    positions = torch.where(valid, torch.arange(SLOTS) * 2, -1)  # stored after an earlier compaction
    view = LayerView(
        layer_idx=0,
        num_layers=1,
        keys=torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=generator),
        values=torch.randn(BATCH, KV_HEADS, SLOTS, DIM + 2, generator=generator),
        positions=positions,
        valid=valid,
        queries=queries.float(),
        query_positions=query_positions,
        rope=rope,
    )
    return view, pre_rope


def reference(view: LayerView, pre_rope: torch.Tensor, policy: ExpectedAttention) -> np.ndarray:
    """The paper's closed form, written out per row, head and slot in float64."""
    scores = np.full((BATCH, KV_HEADS, SLOTS), -np.inf)
    for b in range(BATCH):
        positions = [int(p) for p in view.query_positions[b]]
        used = [t for t, p in enumerate(positions) if p >= policy.n_sink]
        average = np.eye(DIM)
        if view.rope is not None:
            average = np.zeros((DIM, DIM))
            for delta in range(1, policy.n_future_positions + 1):
                for column in range(DIM):  # the rotation matrix, column by column
                    average[:, column] += rope_rotate(np.eye(DIM)[column], max(positions) + delta, view.rope)
            average /= policy.n_future_positions
        per_head = []
        for h in range(KV_HEADS * GROUPS):
            samples = [pre_rope[b, h, t].numpy() for t in used]
            mean = np.mean(samples, axis=0) if samples else np.zeros(DIM)
            covariance = np.zeros((DIM, DIM))
            for sample in samples:
                covariance += np.outer(sample - mean, sample - mean) / len(samples)
            per_head.append((average @ mean, average @ covariance @ average.T))
        for k in range(KV_HEADS):
            slots = [s for s in range(SLOTS) if view.valid[b, k, s]]
            scored = [s for s in slots if view.positions[b, k, s] >= policy.n_sink]
            expected = {s: 0.0 for s in scored}
            for j in range(GROUPS):
                mean, covariance = per_head[k * GROUPS + j]
                logits = {}
                for s in scored:
                    key = view.keys[b, k, s].double().numpy()
                    logits[s] = mean @ key / math.sqrt(DIM)
                    if policy.use_covariance:
                        logits[s] += key @ covariance @ key / (2 * DIM)
                total = sum(math.exp(x) for x in logits.values())
                for s in scored:
                    expected[s] += math.exp(logits[s]) / total / GROUPS
            for s in slots:
                if s not in expected:
                    scores[b, k, s] = np.inf
                elif policy.use_vnorm:
                    norm = np.linalg.norm(view.values[b, k, s].double().numpy())
                    scores[b, k, s] = (expected[s] + policy.epsilon) * norm
                else:
                    scores[b, k, s] = expected[s]
    return scores


def test_unrotate_recovers_pre_rope_queries():
    view, pre_rope = make_view(seed=1)
    recovered = unrotate(view.queries, view.query_positions.clamp(min=0), ROPE)
    real = view.query_positions >= 0
    for b in range(BATCH):
        for t in range(view.query_positions.shape[1]):
            if real[b, t]:
                assert torch.allclose(recovered[b, :, t].double(), pre_rope[b, :, t], atol=1e-5)


@pytest.mark.parametrize(
    "policy",
    [
        ExpectedAttention(n_future_positions=5, n_sink=2),
        ExpectedAttention(n_future_positions=3, n_sink=0, use_covariance=False),
        ExpectedAttention(n_future_positions=7, n_sink=1, use_vnorm=False),
        ExpectedAttention(n_future_positions=4, n_sink=3, epsilon=0.25),
    ],
    ids=lambda s: s.spec(),
)
def test_scores_match_the_closed_form(policy):
    view, pre_rope = make_view(seed=2)
    scores = policy.score(view)
    expected = reference(view, pre_rope, policy)
    assert scores.dtype == torch.float32 and scores.shape == (BATCH, KV_HEADS, SLOTS)
    np.testing.assert_allclose(scores.double().numpy(), expected, rtol=1e-4, atol=1e-7)


def test_without_rope_queries_are_used_as_they_are():
    view, pre_rope = make_view(seed=3, rope=None)
    policy = ExpectedAttention(n_future_positions=5, n_sink=2)
    expected = reference(view, pre_rope, policy)
    np.testing.assert_allclose(policy.score(view).double().numpy(), expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("query_positions", [[[30], [41]], [[-1, 0], [0, 1]]], ids=["decode", "only-sink-queries"])
def test_few_queries_give_finite_scores(query_positions):
    view, pre_rope = make_view(seed=4, query_positions=query_positions)
    policy = ExpectedAttention(n_sink=2)
    scores = policy.score(view)
    assert not torch.isnan(scores).any()
    assert torch.isfinite(scores[view.valid & (view.positions >= 2)]).all()
    np.testing.assert_allclose(scores.double().numpy(), reference(view, pre_rope, policy), rtol=1e-4, atol=1e-7)


def test_sinks_kept_and_invalid_slots_minus_inf():
    view, _ = make_view(seed=5)
    scores = ExpectedAttention(n_sink=3).score(view)
    sinks = view.valid & (view.positions < 3)  # positions 0 and 2: the first two slots
    assert (scores[sinks] == torch.inf).all() and (scores[view.valid & ~sinks] < torch.inf).all()
    assert (scores[~view.valid] == -torch.inf).all()
    kept = select_keep(scores, view.valid, torch.full((BATCH, KV_HEADS), 3))
    assert all({0, 1} <= set(kept[b, k].tolist()) for b in range(BATCH) for k in range(KV_HEADS))


def test_padding_queries_and_invalid_slots_do_not_leak():
    view, pre_rope = make_view(seed=7)
    policy = ExpectedAttention(n_future_positions=5, n_sink=2)
    view.queries[0, :, :2] = float("nan")  # the two padding queries of row 0
    view.keys[~view.valid] = float("nan")
    view.values[~view.valid] = float("nan")
    scores = policy.score(view)
    assert not scores.isnan().any()
    np.testing.assert_allclose(scores.double().numpy(), reference(view, pre_rope, policy), rtol=1e-4, atol=1e-7)


def test_rows_are_independent():
    view, _ = make_view(seed=6)
    policy = ExpectedAttention(n_future_positions=5, n_sink=2)
    together = policy.score(view)
    for b in range(BATCH):
        alone = LayerView(
            0,
            1,
            view.keys[b : b + 1],
            view.values[b : b + 1],
            view.positions[b : b + 1],
            view.valid[b : b + 1],
            queries=view.queries[b : b + 1],
            query_positions=view.query_positions[b : b + 1],
            rope=view.rope,
        )
        assert torch.allclose(policy.score(alone)[0], together[b])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_future_positions": 0}, "n_future_positions must be >= 1"),
        ({"n_sink": -1}, "n_sink must be >= 0"),
        ({"epsilon": -0.5}, "epsilon must be >= 0"),
    ],
)
def test_parameter_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpectedAttention(**kwargs)


def test_spec_round_trip_and_registration():
    policy = parse_policy("expected_attention(n_future_positions=64, use_covariance=False, epsilon=0.01)")
    assert policy == ExpectedAttention(n_future_positions=64, use_covariance=False, epsilon=0.01)
    assert parse_policy(policy.spec()) == policy
    assert ExpectedAttention().spec() == "expected_attention"
    assert kvlib.get_policy("expected_attention") is ExpectedAttention
    assert ExpectedAttention.needs == frozenset({"queries", "rope"})
    defaults = ExpectedAttention()
    assert (defaults.n_future_positions, defaults.n_sink, defaults.epsilon) == (512, 4, 0.0)
    assert defaults.use_covariance and defaults.use_vnorm
