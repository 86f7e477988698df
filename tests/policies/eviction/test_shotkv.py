"""shotkv: shots found from token ids, whole shots kept on a case worked by hand (and the fixed-size
fallback), decode tokens ranked among themselves, and the budget and freed pages through generate and
the Engine (with a codec: ``tests/adapters/cache/test_codecs.py`` walks every eviction policy as
``<name>+kivi(bits=4)``)."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.shotkv import ShotKV
from kvlib.policy import LayerView
from kvlib.selection import select_keep
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded
from tests.policies.eviction.kept_bytes import assert_budget_and_bytes
from tests.policies.eviction.test_fastkv import assert_engine_matches_generate

VOTES = [0.3, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.02, 0.02, 0.02, 0.5, 0.5]
"""The hand-made case's votes by position: shots [0, 4) (mean 0.075), [4, 7) (0.1), [7, 12) (0.02 over
its context tokens 7-9; 10 and 11 are the window)."""


def test_shots_begin_after_each_separator() -> None:
    ids = [5, 1, 2, 9, 9, 3, 4, 9, 9, 6, 9, 9]
    assert ShotKV.for_prompt(ids, [9, 9]).starts == (5, 9)  # the last separator ends the prompt
    assert ShotKV.for_prompt(torch.tensor(ids), [9, 9], window=4).window == 4
    assert ShotKV.for_prompt([9, 9, 1, 2, 9, 9, 3], [9, 9]).starts == (2, 6)
    assert ShotKV.for_prompt([9, 9, 9, 1], [9, 9]).starts == (2,)  # occurrences do not overlap
    assert ShotKV.for_prompt(ids, [9, 9], opens=True).starts == (3, 7, 10)  # a marker opening each shot
    assert ShotKV.for_prompt(ids, [7]).starts == ()  # no separator: the chunk fallback
    with pytest.raises(ValueError, match="separator must hold"):
        ShotKV.for_prompt(ids, [])


def hand_view(budget: int | None, prompt_length: int = 12) -> LayerView:
    """One row, one KV head (one query head), twelve tokens; two window queries whose votes sum to ``VOTES``."""
    attention = torch.zeros(1, 1, 2, 12)
    attention[0, 0, 0] = torch.tensor(VOTES)
    keys = torch.zeros(1, 1, 12, 0)
    positions = torch.arange(12).view(1, 1, 12)
    valid = torch.ones(1, 1, 12, dtype=torch.bool)
    tokens = None if budget is None else torch.tensor([budget])
    return LayerView(
        0, 1, keys, keys.clone(), positions, valid, attention=attention, prompt_lengths=torch.tensor([prompt_length]), budget_tokens=tokens
    )


def kept(scores: torch.Tensor, count: int) -> set[int]:
    chosen = select_keep(scores, scores > -torch.inf, torch.full(scores.shape[:2], count))
    return {int(s) for s in chosen[0, 0] if s >= 0}


@pytest.mark.parametrize(
    "budget, expected",
    [
        (9, {10, 11, 4, 5, 6, 0, 1, 2, 3}),  # room 7: shots [4, 7) and [0, 4) whole (tokens 7-9 vote higher than 1-3)
        (8, {10, 11, 4, 5, 6, 0, 7, 8}),  # room 6: [4, 7) whole, [0, 4) does not fit: the best three left by their own votes
        (4, {10, 11, 0, 4}),  # room 2: no shot fits
    ],
)
def test_whole_shots_are_kept_best_first_while_they_fit(budget: int, expected: set[int]) -> None:
    view = hand_view(budget)
    scores = ShotKV(starts=(0, 4, 7), window=2).score(view)
    assert kept(scores, budget) == expected
    assert bool((scores[0, 0, 10:] == torch.inf).all())


def test_without_starts_segments_are_chunks() -> None:
    policy = ShotKV(chunk=3, window=2)
    assert policy.segments(torch.arange(12)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # segments [0, 3) mean 0.1, [3, 6) 0.0667, [6, 9) 0.0467, [9, 12) 0.02 (token 9 alone outside the window)
    assert kept(policy.score(hand_view(8)), 8) == {10, 11, 0, 1, 2, 3, 4, 5}
    assert ShotKV(starts=(0, 4, 7)).segments(torch.tensor([0, 3, 4, 6, 7, 20])).tolist() == [1, 1, 2, 2, 3, 3]


def test_decode_tokens_compete_among_themselves_and_prompt_tokens_stay() -> None:
    view = hand_view(budget=None, prompt_length=8)
    view.attention[0, 0, -1] = torch.tensor([0.0] * 8 + [0.1, 0.4, 0.2, 0.3])
    scores = ShotKV(starts=(0, 4)).score(view)
    assert bool((scores[0, 0, :8] > scores[0, 0, 8:].max()).all())
    assert scores[0, 0, 8:].argsort(descending=True).tolist() == [1, 3, 2, 0]
    assert kept(scores, 10) == set(range(8)) | {9, 11}


def test_the_budget_leaves_the_decode_share() -> None:
    policy = ShotKV(decode_budget=0.25)
    assert policy.prompt_tokens(torch.tensor([20, 3])).tolist() == [15, 2]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        policy.prompt_tokens(torch.tensor([1]))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_through_generate_each_head_keeps_its_budget_and_frees_the_pages(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([30, 41], seed=3)
    cache = kvlib.make_cache(model, "shotkv(starts=(0, 10, 20), window=4)", budget=20, slack=0)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=9, pad_token_id=PAD)
    assert_budget_and_bytes(cache, 20)
    for layer in range(cache.shape.num_layers):  # 15 prompt tokens (whole shots first), 5 of the 8 decode tokens
        kept_positions = cache.kept_positions(layer)
        for row, length in enumerate([30, 41]):
            decoded = (kept_positions[row] >= length).sum(-1)
            assert bool((decoded == 5).all()), (layer, row, decoded)


def test_the_engine_takes_it_per_request_as_generate_does() -> None:
    assert_engine_matches_generate("shotkv(starts=(0, 15, 30), window=4)")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("shotkv(starts=(4, 2))", "starts must be ascending"),
        ("shotkv(starts=(-1, 2))", "starts must be ascending"),
        ("shotkv(chunk=0)", "chunk must be >= 1"),
        ("shotkv(window=0)", "window must be >= 1"),
        ("shotkv(decode_budget=1.0)", "decode_budget must be in"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def test_spec_round_trip() -> None:
    text = "shotkv(starts=(0, 12, 30), chunk=8, window=16, decode_budget=0.5)"
    assert kvlib.parse_policy(text).spec() == text
    assert kvlib.get_policy("shotkv") is ShotKV and not ShotKV().reads_kv
