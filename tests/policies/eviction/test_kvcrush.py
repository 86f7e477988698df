"""kvcrush: signatures found by position across heads, representatives of the pruned tokens on a
case worked by hand for every anchor, the inner's choice at share 0, and the budget and freed pages
through generate and the Engine (with a codec: ``tests/adapters/cache/test_codecs.py`` walks every
eviction policy as ``<name>+kivi(bits=4)``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvlib
from kvlib.policies.eviction.kvcrush import KVCrush
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, LayerView
from kvlib.selection import select_keep
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded
from tests.policies.eviction.kept_bytes import assert_budget_and_bytes
from tests.policies.eviction.test_fastkv import assert_engine_matches_generate

UPPER = [{0, 1, 2, 3}, {0, 1, 4, 5}, {0, 2, 4, 6}, {1, 3, 5, 7}]
"""The hand-made case's upper half of each of its four query heads (one KV head, eight tokens)."""


@dataclass
class FixedScores(Eviction):
    """A test-only scorer: the view's ``accumulated_attention`` as the scores (never registered)."""

    def score(self, view: LayerView) -> torch.Tensor:
        return view.accumulated_attention.clone()


def hand_view() -> LayerView:
    """Eight tokens of one KV head with four query heads; query head ``g`` attends to ``UPPER[g]``.
    Signatures (bits of query heads 0-3): t0 1110, t1 1101, t2 1010, t3 1001, t4 0110, t5 0101,
    t6 0010, t7 0001. Inner scores rise with the slot: the inner keeps the last tokens."""
    attention = torch.zeros(1, 4, 1, 8)
    for head, tokens in enumerate(UPPER):
        attention[0, head, 0, sorted(tokens)] = 1.0
    keys = torch.zeros(1, 1, 8, 2)
    positions = torch.arange(8).view(1, 1, 8)
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    inner = torch.linspace(0.1, 0.8, 8).view(1, 1, 8)
    return LayerView(
        0, 1, keys, keys.clone(), positions, valid, attention=attention, accumulated_attention=inner, budget_tokens=torch.tensor([4])
    )


def kept(scores: torch.Tensor, count: int) -> set[int]:
    chosen = select_keep(scores, scores > -torch.inf, torch.full(scores.shape[:2], count))
    return {int(s) for s in chosen[0, 0] if s >= 0}


@pytest.mark.parametrize(
    "anchor, representatives",
    [
        ("zeros", {2, 5}),  # distances 3 3 2 2 2 2 -> order t2 t3 t4 t5 t0 t1, every third: t2, t5
        ("ones", {0, 3}),  # distances 1 1 2 2 2 2 -> t0 t1 t2 t3 t4 t5: t0, t3
        ("alternate", {5, 4}),  # from 0101: 3 1 4 2 2 0 -> t5 t1 t3 t4 t0 t2: t5, t4
        ("mean", {0, 3}),  # majority of t0-t5: 1100 -> 1 1 2 2 2 2: t0, t3
    ],
)
def test_representatives_of_the_pruned_tokens_on_a_hand_made_case(anchor: str, representatives: set[int]) -> None:
    view = hand_view()
    policy = KVCrush(inner=FixedScores(), share=0.5, anchor=anchor, window=1)
    assert policy.signatures(view)[0, 0].int().tolist() == [[int(t in upper) for upper in UPPER] for t in range(8)]
    scores = policy.score(view)
    assert kept(scores, 4) == {6, 7} | representatives  # the inner's two best, then two representatives
    assert kept(KVCrush(inner=FixedScores(), share=0.0).score(view), 4) == {4, 5, 6, 7}


def test_signatures_find_each_token_by_position_in_every_kv_group() -> None:
    """Two KV heads holding different positions: a token's bit for a query head comes from the slot
    that holds its position in that head's KV group (0 where that group holds no such token)."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([[[0, 1, 2, 3, 4, 5, -1], [0, 2, 4, 6, 7, 8, 9]]])
    valid = positions >= 0
    attention = torch.rand(1, 4, 3, 7, generator=generator).masked_fill(~valid.repeat_interleave(2, 1).unsqueeze(2), 0.0)
    keys = torch.zeros(1, 2, 7, 2)
    view = LayerView(0, 1, keys, keys.clone(), positions, valid, attention=attention, budget_tokens=torch.tensor([4]))
    bits = KVCrush(window=2).signatures(view)
    received = attention[:, :, -2:].sum(2)
    upper = {}
    for query_head in range(4):
        head = query_head // 2
        held = [s for s in range(7) if valid[0, head, s]]
        best = sorted(held, key=lambda s: (-float(received[0, query_head, s]), s))[: len(held) // 2]
        upper[query_head] = {int(positions[0, head, s]) for s in best}
    for head in range(2):
        for s in range(7):
            expected = [int(valid[0, head, s]) and int(positions[0, head, s]) in upper[g] for g in range(4)]
            assert bits[0, head, s].int().tolist() == [int(bool(e)) for e in expected], (head, s)


def random_view(seed: int, budget: int) -> LayerView:
    generator = torch.Generator().manual_seed(seed)
    valid = torch.ones(2, 2, 30, dtype=torch.bool)
    valid[1, 0, -5:] = False
    attention = torch.rand(2, 6, 4, 30, generator=generator).masked_fill(~valid.repeat_interleave(3, 1).unsqueeze(2), 0.0)
    keys = torch.randn(2, 2, 30, 4, generator=generator)
    positions = torch.where(valid, torch.arange(30), -1)
    return LayerView(0, 2, keys, keys.clone(), positions, valid, attention=attention, budget_tokens=torch.tensor([budget, budget]))


@pytest.mark.parametrize("anchor", ["random", "mean"])
def test_the_inner_keeps_its_share_and_representatives_come_from_what_it_prunes(anchor: str) -> None:
    view = random_view(1, budget=12)
    inner = SnapKV(window=4, kernel=3)
    policy = KVCrush(inner=inner, share=0.25, anchor=anchor)
    ours = select_keep(policy.score(view), view.valid, torch.full((2, 2), 12))
    theirs = select_keep(inner.score(view), view.valid, torch.full((2, 2), 12))
    for b in range(2):
        for h in range(2):
            mine, base = {int(s) for s in ours[b, h] if s >= 0}, [int(s) for s in theirs[b, h] if s >= 0]
            assert len(mine) == 12 and set(base[:9]) <= mine  # B - floor(0.25 B) of the inner's best
            assert len(mine - set(base[:9])) == 3
    view.budget_tokens = None
    assert torch.equal(policy.score(view), torch.where(view.valid, inner.score(view), -torch.inf))


def test_needs_follow_the_inner_and_the_spec_round_trips() -> None:
    assert kvlib.get_policy("kvcrush") is KVCrush
    assert KVCrush().needs == frozenset({"attention", "budget"}) and not KVCrush().reads_kv
    knorm = kvlib.parse_policy("kvcrush(inner='knorm', window=8)")
    assert knorm.reads_kv and knorm.observed_queries() == 8
    assert KVCrush(inner=SnapKV(window=16)).observed_queries() == 16
    text = "kvcrush(inner='h2o', share=0.5, window=8, anchor='mean', seed=3)"
    assert kvlib.parse_policy(text).spec() == text


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_through_generate_each_head_keeps_its_budget_and_frees_the_pages(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([30, 41], seed=3)
    cache = kvlib.make_cache(model, "kvcrush(inner='snapkv(window=4)', share=0.5)", budget=20, slack=0)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    assert_budget_and_bytes(cache, 20)


def test_the_engine_takes_it_per_request_as_generate_does() -> None:
    assert_engine_matches_generate("kvcrush(inner='snapkv(window=4)', share=0.5)")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kvcrush(share=1.0)", "share must be in"),
        ("kvcrush(share=-0.1)", "share must be in"),
        ("kvcrush(window=0)", "window must be >= 1"),
        ("kvcrush(anchor='middle')", "anchor"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)
