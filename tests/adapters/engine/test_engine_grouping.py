"""``Engine.generate``'s global prefix grouping (``group_prefixes``): greedy outputs equal with it on
and off and to ``model.generate`` alone, a shared prefix computed once per group, requests queued
group by group in the grouping's order, a finished group's blocks reclaimed first, bad values
refused."""

from __future__ import annotations

import random

import pytest
import torch

import kvlib
from kvlib.adapters.engine.prefix_groups import prefix_groups
from tests.adapters.conftest import VOCAB, build_model
from tests.adapters.engine.test_engine import alone, page_bytes

PAGE = 4
NEW = 4
PREFIX = 24
"""Tokens of each group's shared prefix (6 full pages of ``PAGE``)."""


def shuffled_groups(groups: int = 3, per_group: int = 3, seed: int = 0) -> list[list[int]]:
    """``groups`` prefixes of :data:`PREFIX` tokens, each opening ``per_group`` prompts with their
    own 3 to 9 tokens after it, in shuffled order."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(3, VOCAB) for _ in range(PREFIX)]
        prompts += [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 10))] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return build_model("llama")


@pytest.fixture(scope="module")
def case(llama) -> tuple[list[list[int]], list[list[int]]]:
    prompts = shuffled_groups()
    return prompts, [alone(llama, prompt, NEW) for prompt in prompts]


def computed_prompt_tokens(engine: kvlib.Engine) -> int:
    stats = engine.stats()
    return stats["prompt_tokens"] - stats["cached_tokens"]


@pytest.mark.parametrize("pages", [None, 40], ids=["no-budget", "tight-budget"])
def test_grouping_is_exact_and_computes_each_shared_prefix_once(llama, case, pages) -> None:
    prompts, expected = case
    budget = None if pages is None else pages * page_bytes(llama, PAGE)
    computed = {}
    for group_prefixes in (True, False):
        engine = kvlib.Engine(llama, page_size=PAGE, max_batch_tokens=32, page_budget_bytes=budget)
        assert engine.generate(prompts, max_new_tokens=NEW, group_prefixes=group_prefixes) == expected
        computed[group_prefixes] = computed_prompt_tokens(engine)
    groups = prefix_groups(prompts, PAGE)
    once = sum(len(p) for p in prompts) - sum(len(group) - 1 for group in groups) * PREFIX
    assert computed[True] == once
    assert computed[False] >= once


def test_requests_are_queued_group_by_group_in_the_groupings_order(llama, case) -> None:
    prompts, _ = case
    engine = kvlib.Engine(llama, page_size=PAGE, max_finished=None)
    engine.generate(prompts, max_new_tokens=NEW)
    queued = [engine.requests[request_id].prompt for request_id in sorted(engine.requests)]
    assert queued == [prompts[index] for group in prefix_groups(prompts, PAGE) for index in group]
    plain = kvlib.Engine(llama, page_size=PAGE, max_finished=None)
    plain.generate(prompts, max_new_tokens=NEW, group_prefixes=False)
    assert [plain.requests[request_id].prompt for request_id in sorted(plain.requests)] == prompts


def test_a_finished_groups_blocks_are_the_first_reclaimed(llama, case) -> None:
    """Blocks cached before the batch stay behind the batch's in the LRU with grouping on (the
    batch's are given back first); without it, the older blocks go first as usual."""
    prompts, _ = case
    earlier = [5] * (3 * PAGE + 1)
    for group_prefixes, first_is_batch in ((True, True), (False, False)):
        engine = kvlib.Engine(llama, page_size=PAGE)
        engine.generate([earlier], max_new_tokens=1)
        engine.generate(prompts, max_new_tokens=NEW, group_prefixes=group_prefixes)
        oldest = next(iter(engine.prefix.index.lru.values()))
        assert (oldest.tokens != tuple(earlier[:PAGE])) == first_is_batch
        cached = {entry.tokens for entry in engine.prefix.index.lru.values()}
        assert tuple(earlier[:PAGE]) in cached  # freed first, not dropped: nothing was short of pages


def test_bad_group_prefixes_is_refused(llama) -> None:
    engine = kvlib.Engine(llama)
    with pytest.raises(ValueError, match=r"^group_prefixes must be True or False, got 'yes'$"):
        engine.generate([[1, 2]], group_prefixes="yes")
    with pytest.raises(ValueError, match=r"^unknown options \['group'\]"):
        engine.generate([[1, 2]], group=True)
    assert not engine.has_unfinished
