"""graphkv: the decay a kept token sends to tokens with similar keys, on a case worked by hand and
against a loop reference; scores only go down; the budget and the freed pages through generate,
and in the Engine (with a codec: ``tests/adapters/cache/test_codecs.py`` walks every eviction
policy as ``<name>+kivi(bits=4)`` and ``<name>+svd(rank=4)``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvlib
from kvlib.policies.eviction.graphkv import GraphKV
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded
from tests.policies.eviction.kept_bytes import assert_budget_and_bytes
from tests.policies.eviction.test_fastkv import assert_engine_matches_generate


@dataclass
class FixedScores(Eviction):
    """A test-only scorer: the view's ``accumulated_attention`` as the scores (never registered)."""

    def score(self, view: LayerView) -> torch.Tensor:
        return view.accumulated_attention.clone()


def hand_view(budget: int | None) -> LayerView:
    """One row, one head, four tokens: token 1's key repeats token 0's, token 2's is orthogonal to
    it, token 3's at cosine 0.6; inner scores 0.9, 0.8, 0.5, 0.1."""
    keys = torch.tensor([[[[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.6, 0.8]]]])
    positions = torch.arange(4).view(1, 1, 4)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    scores = torch.tensor([[[0.9, 0.8, 0.5, 0.1]]])
    tokens = None if budget is None else torch.tensor([budget])
    return LayerView(0, 1, keys, keys.clone(), positions, valid, accumulated_attention=scores, budget_tokens=tokens)


def test_a_kept_token_decays_its_duplicate_and_a_different_token_takes_its_place() -> None:
    view = hand_view(budget=2)
    scores = GraphKV(inner=FixedScores(), sources=1).score(view)
    # token 0 is the source; token 1 (cos 1) keeps 0, token 2 (cos 0) all, token 3 (cos 0.6) 0.4 of its score
    torch.testing.assert_close(scores, torch.tensor([[[0.9, 0.0, 0.5, 0.04]]]))
    assert scores[0, 0].topk(2).indices.tolist() == [0, 2]  # the plain scores keep tokens 0 and 1
    half = GraphKV(inner=FixedScores(), sources=1, decay=0.5).score(view)
    torch.testing.assert_close(half, torch.tensor([[[0.9, 0.4, 0.5, 0.07]]]))
    nearest = GraphKV(inner=FixedScores(), sources=1, neighbors=1).score(view)  # one edge: to token 1 only
    torch.testing.assert_close(nearest, torch.tensor([[[0.9, 0.0, 0.5, 0.1]]]))


def test_two_rounds_take_the_next_source_from_the_decayed_scores() -> None:
    view = hand_view(budget=4)
    scores = GraphKV(inner=FixedScores(), sources=1, rounds=2).score(view)
    # round 1: source 0 -> [0.9, 0, 0.5, 0.04]; round 2: source 2 (0.5), token 3 at cos 0.8 keeps 0.2
    torch.testing.assert_close(scores, torch.tensor([[[0.9, 0.0, 0.5, 0.008]]]))


def test_a_negative_score_goes_further_down() -> None:
    view = hand_view(budget=1)
    view.accumulated_attention = torch.tensor([[[1.0, -0.5, -0.2, -0.3]]])
    scores = GraphKV(inner=FixedScores(), sources=1).score(view)
    torch.testing.assert_close(scores, torch.tensor([[[1.0, -1.0, -0.2, -0.3 - 0.6 * 0.3]]]))


def random_view(seed: int) -> LayerView:
    """Two rows, two KV heads of a group of three, 24 slots; row 1 head 1 ends in four empty slots."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, group, slots, observed = 2, 2, 3, 24, 4
    valid = torch.ones(batch, heads, slots, dtype=torch.bool)
    valid[1, 1, -4:] = False
    positions = torch.where(valid, torch.arange(slots), -1)
    base = torch.randn(batch, heads, 6, 8, generator=generator)  # keys in clusters: redundancy to find
    keys = base[:, :, torch.randint(0, 6, (slots,), generator=generator)] + 0.1 * torch.randn(batch, heads, slots, 8, generator=generator)
    attention = torch.rand(batch, heads * group, observed, slots, generator=generator).masked_fill(
        ~valid.repeat_interleave(group, 1).unsqueeze(2), 0.0
    )
    return LayerView(
        0,
        2,
        keys,
        keys.clone(),
        positions,
        valid,
        attention=attention / attention.sum(-1, keepdim=True),
        budget_tokens=torch.tensor([10, 10]),
    )


def loop_reference(view: LayerView, policy: GraphKV) -> torch.Tensor:
    """GraphKV written out per head with Python loops over tokens."""
    inner = policy.inner.score(view).double()
    out = torch.full(inner.shape, -float("inf"), dtype=torch.float64)
    batch, heads, slots = inner.shape
    for b in range(batch):
        for h in range(heads):
            held = [s for s in range(slots) if view.valid[b, h, s] and inner[b, h, s] > -float("inf")]
            score = {s: float(inner[b, h, s]) for s in held}
            keys = {s: view.keys[b, h, s].double() / view.keys[b, h, s].double().norm() for s in held}
            m = max(1, min(policy.sources, int(view.budget_tokens[b]) // policy.rounds))
            sources: list[int] = []
            for _ in range(policy.rounds):
                infinite = sorted((s for s in held if s not in sources and score[s] == float("inf")), reverse=True)
                finite = sorted((s for s in held if s not in sources and score[s] != float("inf")), key=lambda s: (-score[s], s))
                new = (infinite + finite)[:m]
                sources += new
                receivers = [s for s in held if s not in sources and abs(score[s]) != float("inf")]
                factor = dict.fromkeys(receivers, 1.0)
                for i in new:
                    near = sorted(receivers, key=lambda j: (-max(0.0, float(keys[i] @ keys[j])), j))[: policy.neighbors]
                    for j in near:
                        factor[j] *= 1.0 - policy.decay * max(0.0, float(keys[i] @ keys[j]))
                for j in receivers:
                    score[j] -= (1.0 - factor[j]) * abs(score[j])
            for s in held:
                out[b, h, s] = score[s]
    return out


@pytest.mark.parametrize("sources, neighbors, decay, rounds", [(3, 4, 1.0, 1), (2, 24, 0.7, 2), (64, 5, 0.3, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_scores_match_the_loop_reference_and_only_go_down(seed: int, sources: int, neighbors: int, decay: float, rounds: int) -> None:
    view = random_view(seed)
    policy = GraphKV(inner=SnapKV(window=4, kernel=3), sources=sources, neighbors=neighbors, decay=decay, rounds=rounds)
    scores = policy.score(view)
    expected = loop_reference(view, policy)
    assert torch.equal(scores.isinf(), expected.isinf()) and torch.equal(scores == torch.inf, expected == torch.inf)
    finite = expected.isfinite()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-5, atol=1e-6)
    inner = policy.inner.score(view)
    assert bool((scores[finite] <= inner[finite] + 1e-7).all())
    assert bool((scores[~view.valid] == -torch.inf).all())


def test_no_decay_gives_the_inner_scores() -> None:
    view = random_view(3)
    inner = SnapKV(window=4, kernel=3)
    assert torch.equal(GraphKV(inner=inner, decay=0.0).score(view), inner.score(view))


def test_needs_follow_the_inner_and_the_spec_round_trips() -> None:
    assert kvlib.get_policy("graphkv") is GraphKV
    assert GraphKV().needs == frozenset({"attention", "budget"}) and GraphKV().reads_kv
    assert kvlib.parse_policy("graphkv(inner='h2o')").needs == frozenset({"accumulated_attention", "budget"})
    assert GraphKV().observed_queries() == 32 and GraphKV(inner=SnapKV(window=8)).observed_queries() == 8
    text = "graphkv(inner='snapkv(window=8)', sources=16, neighbors=4, decay=0.5, rounds=2)"
    assert kvlib.parse_policy(text).spec() == text


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_through_generate_each_head_keeps_its_budget_and_frees_the_pages(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([30, 41], seed=3)
    cache = kvlib.make_cache(model, "graphkv(inner='snapkv(window=4)', sources=8)", budget=20, slack=0)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    assert_budget_and_bytes(cache, 20)


def test_the_engine_takes_it_per_request_as_generate_does() -> None:
    assert_engine_matches_generate("graphkv(inner='snapkv(window=4)', sources=4)")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("graphkv(sources=0)", "sources must be >= 1"),
        ("graphkv(neighbors=-1)", "neighbors must be >= 0"),
        ("graphkv(decay=1.5)", "decay must be in"),
        ("graphkv(rounds=0)", "rounds must be >= 1"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)
