"""Draft tokens without a draft model: SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975) for the Engine.

A :class:`SuffixSpeculator` keeps a :class:`~kvlib.adapters.engine.suffix_trie.SuffixTrie` per
running request over its prompt and output (extended as the output grows) and one global trie over
the outputs of the requests finished most recently (at most ``global_tokens`` tokens of them; the
oldest output leaves when a new one would pass that). Each decode step, a request matches the
longest suffix of its tokens (at most ``max_match``) that occurs followed by something in each trie,
follows the most frequent continuation from there while its estimated probability stays at least
``min_probability``, and of the two candidates proposes the one of higher score (expected accepted
tokens); its length is at most ``alpha * p`` for a match of ``p`` tokens (the adaptive
``MAX_SPEC``), at most ``max_draft``, and never more than the request may still output beyond the
verification's own token.

Memory: at most ``max_match + max_draft`` trie nodes per token of each running request's prompt and
output, and per token of the global window (``global_tokens``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvlib.adapters.engine.engine_request import Request
from kvlib.adapters.engine.suffix_trie import SuffixNode, SuffixTrie
from kvlib.errors import quoted

SPECULATION_METHODS = ("suffix",)


@dataclass(frozen=True)
class SuffixSpeculation:
    """How the Engine drafts with suffix trees (``Engine(model, speculate="suffix")`` takes these defaults).

    Args:
        max_draft: draft tokens one verification checks at most (``k``).
        alpha: a match of ``p`` tokens proposes at most ``alpha * p`` tokens (SuffixDecoding's
            adaptive ``MAX_SPEC``; floored, so a short match with a small alpha proposes none).
        max_match: the longest suffix of a request's tokens matched (tokens).
        min_probability: a draft stops before the token at which its estimated probability (the
            product of each token's frequency share after the path before it) falls below this.
        global_tokens: tokens of recent outputs the global trie indexes at most (0: no global trie).
    """

    max_draft: int = 8
    alpha: float = 1.0
    max_match: int = 16
    min_probability: float = 0.1
    global_tokens: int = 8192

    def __post_init__(self) -> None:
        for name, low in (("max_draft", 1), ("max_match", 1), ("global_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low} (tokens), got {quoted(value)}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ValueError(f"alpha must be a finite number > 0 (draft tokens per matched token), got {quoted(self.alpha)}")
        if (
            isinstance(self.min_probability, bool)
            or not isinstance(self.min_probability, (int, float))
            or not 0 <= self.min_probability <= 1
        ):
            raise ValueError(f"min_probability must be a number in [0, 1], got {quoted(self.min_probability)}")


def speculation(value: object) -> SuffixSpeculation | None:
    """The speculation ``Engine(speculate=value)`` asks for: None (off), ``"suffix"`` (the defaults)
    or a :class:`SuffixSpeculation`; ``ValueError`` for anything else."""
    if value is None or isinstance(value, SuffixSpeculation):
        return value
    if value == "suffix":
        return SuffixSpeculation()
    raise ValueError(f"speculate must be None, one of {SPECULATION_METHODS} or a SuffixSpeculation, got {quoted(value)}")


@dataclass
class _RequestTrie:
    """A request's trie over its tokens, the first ``indexed`` of them indexed so far, and its cursor."""

    trie: SuffixTrie
    indexed: int = 0
    cursor: list[SuffixNode] = field(default_factory=list)


class SuffixSpeculator:
    """Proposes each decoding request's draft from its own trie and the global one (see the module docstring)."""

    def __init__(self, options: SuffixSpeculation) -> None:
        self.options = options
        self.depth = options.max_match + options.max_draft
        self.requests: dict[int, _RequestTrie] = {}
        self.recent = SuffixTrie(self.depth)
        """The global trie: the outputs in :attr:`window`."""
        self.window: deque[list[int]] = deque()
        """The finished outputs :attr:`recent` indexes, oldest first (``global_tokens`` at most, all told)."""
        self.window_tokens = 0

    def propose(self, request: Request) -> list[int]:
        """Draft tokens to follow ``request``'s last token (empty: none worth verifying)."""
        options = self.options
        room = min(options.max_draft, request.max_new_tokens - len(request.output) - 1)
        if room <= 0:
            return []
        tokens = request.tokens
        own = self.requests.get(request.request_id)
        if own is None:
            own = self.requests[request.request_id] = _RequestTrie(SuffixTrie(self.depth))
        own.cursor = own.trie.extend(own.cursor, tokens[own.indexed :])
        own.indexed = len(tokens)
        best: tuple[list[int], float] = ([], 0.0)
        for trie in (own.trie, self.recent):
            match = trie.longest_continued_suffix(tokens, options.max_match)
            if match is None:
                continue
            node, length = match
            draft = trie.continuation(node, min(room, int(options.alpha * length)), options.min_probability)
            if draft[1] > best[1]:
                best = draft
        return best[0]

    def finish(self, request: Request, *, finished: bool) -> None:
        """``request`` leaves the engine: its trie is dropped, and a ``finished`` one's output joins
        the global window (the oldest outputs leave it while it holds more than ``global_tokens``)."""
        self.requests.pop(request.request_id, None)
        output = list(request.output)
        if not finished or not output or len(output) > self.options.global_tokens:
            return
        self.recent.extend([], output)
        self.window.append(output)
        self.window_tokens += len(output)
        while self.window_tokens > self.options.global_tokens:
            oldest = self.window.popleft()
            self.recent.remove(oldest)
            self.window_tokens -= len(oldest)

    def nodes(self) -> int:
        """Trie nodes held now (requests' and global), the unit of the memory bound."""
        return self.recent.nodes + sum(own.trie.nodes for own in self.requests.values())
