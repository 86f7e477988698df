"""A depth-bounded suffix trie with occurrence counts: the index SuffixDecoding (Oliaro et al., 2024,
arXiv:2411.04975) proposes draft tokens from.

Every substring of at most ``max_depth`` tokens of the texts indexed is a path from the root; a
node's ``count`` is how many times its path occurs in them (occurrences counted by start
position). Texts are indexed incrementally, a token at a time (:meth:`SuffixTrie.extend`, for a
request's prompt and output as it grows), or whole, and whole texts can be removed again
(:meth:`SuffixTrie.remove`, for a bounded window of recent outputs).

Memory: at most ``max_depth`` nodes per indexed token (a node per substring ending there).

Invariants: a node's count is the number of (text, start) pairs where its path occurs; a node
whose count falls to 0 is removed; a path of length ``p`` present implies each of its suffixes is
present (a suffix occurs wherever the path does, starting later), so the longest context suffix
that is a path, or that is a path with a continuation, can be found by bisection.
"""

from __future__ import annotations

from collections.abc import Sequence


class SuffixNode:
    """One substring: how often it occurs and the nodes of its one-token extensions."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, SuffixNode] = {}


class SuffixTrie:
    """Every substring of at most ``max_depth`` tokens of the indexed texts, with counts (see the module docstring)."""

    def __init__(self, max_depth: int) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1 (tokens), got {max_depth!r}")
        self.max_depth = max_depth
        self.root = SuffixNode()
        self.nodes = 0
        """Nodes besides the root (at most ``max_depth`` per indexed token)."""

    def extend(self, cursor: list[SuffixNode], tokens: Sequence[int]) -> list[SuffixNode]:
        """Index ``tokens`` appended to a text whose open suffixes are ``cursor`` (the nodes of its
        suffixes shorter than ``max_depth``, longest first; ``[]`` for a new text; the list is
        consumed); returns the cursor after them."""
        root, depth, created = self.root, self.max_depth, 0
        for token in tokens:
            cursor.append(root)
            advanced = []
            for node in cursor:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = SuffixNode()
                    created += 1
                child.count += 1
                advanced.append(child)
            cursor = advanced[1:] if len(advanced) >= depth else advanced
        self.nodes += created
        return cursor

    def remove(self, text: Sequence[int]) -> None:
        """Take one indexed occurrence of whole ``text`` out (every substring of it that
        :meth:`extend` counted), dropping nodes no longer occurring."""
        for start in range(len(text)):
            node = self.root
            for token in text[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.nodes -= self._size(child)
                    break
                node = child

    def _size(self, node: SuffixNode) -> int:
        """Nodes in the subtree under and including ``node``."""
        return 1 + sum(self._size(child) for child in node.children.values())

    def find(self, path: Sequence[int]) -> SuffixNode | None:
        """The node of ``path``, or None where it does not occur."""
        node = self.root
        for token in path:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def longest_continued_suffix(self, context: Sequence[int], max_length: int) -> tuple[SuffixNode, int] | None:
        """The node and length ``p`` of the longest suffix of ``context`` (at most ``max_length``
        tokens, and below ``max_depth``) that occurs followed by some token; None when not even its
        last token does. Bisection (see the module docstring: continued suffixes nest)."""
        low, high, best = 1, min(max_length, self.max_depth - 1, len(context)), None
        while low <= high:
            middle = (low + high) // 2
            node = self.find(context[len(context) - middle :])
            if node is not None and node.children:
                best, low = (node, middle), middle + 1
            else:
                high = middle - 1
        return best

    def continuation(self, node: SuffixNode, max_tokens: int, min_probability: float) -> tuple[list[int], float]:
        """The most frequent path below ``node``, of at most ``max_tokens`` tokens, extended while
        its estimated probability (the product of each step's share of its parent's continued
        occurrences) stays at least ``min_probability``; returns its tokens and its score, the sum
        of those probabilities over its tokens (the tokens a verification is expected to accept)."""
        tokens: list[int] = []
        probability, score = 1.0, 0.0
        while len(tokens) < max_tokens and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            probability *= child.count / sum(other.count for other in node.children.values())
            if probability < min_probability:
                break
            tokens.append(token)
            score += probability
            node = child
        return tokens, score
