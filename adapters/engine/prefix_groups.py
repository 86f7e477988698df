"""Global prefix grouping of an offline batch (BatchLLM): the prompts of one ``Engine.generate``
call, ordered so that prompts sharing a prefix are served together.

Grouping is at page granularity, on the blocks the prefix index can share (full pages, never a
prompt's last token): two prompts are in one group when they share their first full block, and
within a group the prompts are in lexicographic order of their token ids, a depth-first walk of
the batch's prefix trie, so prompts sharing the longest prefixes are neighbours. A prompt with no
shareable block (at most ``page_size`` tokens) is a group of its own. Groups come in the order of
their first prompt in the caller's list; every prompt index is in exactly one group.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_groups(prompts: Sequence[Sequence[int]], page_size: int) -> list[list[int]]:
    """Indices of ``prompts`` (token ids) grouped by their first full page of ``page_size`` tokens,
    each group in depth-first (lexicographic) order, groups by first appearance; see the module
    docstring."""
    groups: dict[object, list[int]] = {}
    for index, prompt in enumerate(prompts):
        shareable = (len(prompt) - 1) // page_size > 0  # a prefix lookup never includes the last token
        key = tuple(prompt[:page_size]) if shareable else index
        groups.setdefault(key, []).append(index)
    return [sorted(members, key=lambda index: list(prompts[index])) for members in groups.values()]
