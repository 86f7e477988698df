"""Global prefix grouping (``prefix_groups``): every prompt in exactly one group, a group's prompts
share their first full page and come in depth-first (lexicographic) order, short prompts alone,
groups by first appearance."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvlib.adapters.engine.prefix_groups import prefix_groups

PAGE = 4


def test_shuffled_prompts_with_shared_prefixes_are_grouped_depth_first() -> None:
    a, b = [1] * 8, [2] * 8
    prompts = [b + [9, 9], a + [5], [7, 7], a + [3, 3, 3, 3, 1], b + [4], a + [3, 3, 3, 3, 0]]
    assert prefix_groups(prompts, PAGE) == [[4, 0], [5, 3, 1], [2]]


prompt_lists = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), max_size=12)


@given(prompt_lists)
def test_groups_partition_the_batch_by_first_shareable_page(prompts: list[list[int]]) -> None:
    groups = prefix_groups(prompts, PAGE)
    assert sorted(index for group in groups for index in group) == list(range(len(prompts)))
    firsts = [min(group) for group in groups]
    assert firsts == sorted(firsts)  # groups by first appearance
    for group in groups:
        members = [prompts[index] for index in group]
        assert members == sorted(members)  # depth-first walk of the group's prefix trie
        if len(group) > 1:
            assert all((len(p) - 1) // PAGE > 0 and p[:PAGE] == members[0][:PAGE] for p in members)
    for i, j in itertools.combinations(range(len(prompts)), 2):
        shareable = all((len(prompts[k]) - 1) // PAGE > 0 for k in (i, j))
        together = any(i in group and j in group for group in groups)
        assert together == (shareable and prompts[i][:PAGE] == prompts[j][:PAGE])
