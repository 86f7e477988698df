"""The index SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975) proposes draft tokens from,
held as one token array and searched by a numba scan instead of a tree of per-node objects.

A :class:`SuffixIndex` holds texts (a request's prompt and output as it grows, or a window of
finished outputs) one after another in one int32 array, each followed by :data:`SEPARATOR`, so
no match or continuation crosses from one text into the next. It answers what a suffix tree
with occurrence counts answers (:meth:`SuffixIndex.propose`):

- the match: the longest suffix of a context (at most ``max_match`` tokens) that occurs in the
  texts followed by some token;
- the draft: from the occurrences of that match, the most frequent next token, then the most
  frequent after it among the occurrences that continued so, and so on (a tie goes to the token
  that occurred first), while the estimated probability of the path, the product of each token's
  share of the occurrences that continue before it, stays at least ``min_probability``; its score
  is the sum of those probabilities over its tokens (the tokens a verification is expected to
  accept);
- the extension: the same walk on past where ``min_probability`` stopped the draft, within the
  draft's length limit (tokens worth verifying where a verification runs more than the draft; the
  limit stays, since the estimate of a path seen after a short match is no estimate).

This is exactly the walk down a suffix trie whose node counts are occurrence counts (by start
position) of substrings of at most ``max_match + max_draft`` tokens (the tree SuffixDecoding
builds), without building it: the occurrences are found by one pass over the array (a vectorized
compare with the context's last token), then narrowed token by token. Cost per proposal: one pass
over the indexed tokens plus, per matched or drafted token, one pass over the occurrences left.

Memory: 4 bytes per indexed token plus 4 per text (its separator); the array's capacity at most
doubles what it holds (and shrinks back when texts leave). Appending is amortized O(1) per token.

Invariant: :attr:`SuffixIndex.tokens` ``[:size]`` is the texts in order, each followed by one
:data:`SEPARATOR`; the last text is open (tokens may be appended to it) until :meth:`SuffixIndex.add`
starts another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numba
import numpy as np

SEPARATOR = -1
"""The marker after each text (token ids are >= 0)."""


class SuffixIndex:
    """Texts of token ids, searched for SuffixDecoding drafts (see the module docstring)."""

    def __init__(self) -> None:
        self.tokens = np.empty(64, dtype=np.int32)
        """The texts, each followed by :data:`SEPARATOR`, in ``[:size]``."""
        self.size = 0
        self.lengths: deque[int] = deque()
        """Tokens of each text held, oldest first."""

    @property
    def indexed(self) -> int:
        """Tokens held, over all texts (separators not counted)."""
        return self.size - len(self.lengths)

    def add(self, text: Sequence[int]) -> None:
        """Start a new text holding ``text`` (later :meth:`extend` calls append to it)."""
        self._reserve(len(text) + 1)
        self.tokens[self.size : self.size + len(text)] = text
        self.size += len(text) + 1
        self.tokens[self.size - 1] = SEPARATOR
        self.lengths.append(len(text))

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the newest text (a new one if none is held)."""
        if not self.lengths:
            self.add(tokens)
            return
        self._reserve(len(tokens))
        end = self.size - 1  # the newest text's separator moves to after the new tokens
        self.tokens[end : end + len(tokens)] = tokens
        self.size += len(tokens)
        self.tokens[self.size - 1] = SEPARATOR
        self.lengths[-1] += len(tokens)

    def drop_oldest(self) -> int:
        """Take the oldest text out (the rest move down; the capacity shrinks to twice what is
        left); returns its length in tokens."""
        length = self.lengths.popleft()
        kept = self.tokens[length + 1 : self.size]
        self.size = len(kept)
        self.tokens = np.concatenate([kept, np.empty(max(64, self.size), dtype=np.int32)])
        return length

    def _reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more entries (doubling the capacity when short)."""
        if self.size + tokens > len(self.tokens):
            grown = np.empty(max(2 * len(self.tokens), self.size + tokens), dtype=np.int32)
            grown[: self.size] = self.tokens[: self.size]
            self.tokens = grown

    def propose(
        self, context: np.ndarray, *, max_match: int, max_draft: int, alpha: float, min_probability: float
    ) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
        """The draft to follow ``context`` (int32 token ids), its score and its extension (see the
        module docstring): a match of ``p`` tokens drafts at most ``min(max_draft, floor(alpha *
        p))`` tokens. The extension continues the same walk past where ``min_probability``
        stopped the draft, to that many tokens in all at most: the likeliest tokens to verify
        after the draft where a verification runs more. Last, the estimated
        probability of each token of the draft and extension (the path's, up to it; float64).
        An empty draft (score 0) when not even the context's last token occurs followed by
        something, or no token passes ``min_probability``."""
        walk = np.empty(max(max_draft, 0), dtype=np.int32)
        chances = np.empty(max(max_draft, 0), dtype=np.float64)
        drafted, walked, score = _propose(self.tokens, self.size, context, max_match, alpha, min_probability, walk, chances)
        return walk[:drafted], score, walk[drafted:walked], chances[:walked]


@numba.njit(cache=True, nogil=True)
def _propose(
    text: np.ndarray,
    size: int,
    context: np.ndarray,
    max_match: int,
    alpha: float,
    min_probability: float,
    draft: np.ndarray,
    chances: np.ndarray,
) -> tuple[int, int, float]:  # pragma: no cover - compiled
    """:meth:`SuffixIndex.propose` over ``text[:size]``: writes the draft and its extension into
    ``draft`` (their length is at most ``len(draft)``) and each one's estimated probability into
    ``chances``, and returns the draft's length, with the extension's, and the draft's score. ``next_at`` holds the positions of the tokens that follow
    the occurrences still in play, ascending."""
    length = context.shape[0]
    if length == 0 or draft.shape[0] == 0:
        return 0, 0, 0.0
    last = context[length - 1]
    next_at = np.empty(size, dtype=np.int64)
    found = 0
    for j in range(1, size):
        if text[j - 1] == last and text[j] != SEPARATOR:
            next_at[found] = j
            found += 1
    if found == 0:
        return 0, 0, 0.0
    matched = 1
    while matched < min(max_match, length):  # lengthen the match while some occurrence still continues
        want = context[length - 1 - matched]
        kept = 0
        for i in range(found):
            start = next_at[i] - 1 - matched
            if start >= 0 and text[start] == want:
                kept += 1
        if kept == 0:
            break
        kept = 0
        for i in range(found):
            start = next_at[i] - 1 - matched
            if start >= 0 and text[start] == want:
                next_at[kept] = next_at[i]
                kept += 1
        found = kept
        matched += 1
    limit = min(draft.shape[0], int(alpha * matched))
    drafted, confident, probability, score = 0, -1, 1.0, 0.0
    while drafted < limit and found > 0:
        following = text[next_at[:found]]
        order = np.argsort(following, kind="mergesort")  # stable: a run's first entry is its earliest occurrence
        best, best_count, best_first = -1, 0, size
        run = 0
        while run < found:
            token = following[order[run]]
            end = run
            while end < found and following[order[end]] == token:
                end += 1
            first = next_at[order[run]]
            if end - run > best_count or (end - run == best_count and first < best_first):
                best, best_count, best_first = token, end - run, first
            run = end
        probability *= best_count / found
        if confident < 0 and probability < min_probability:
            confident = drafted  # the draft ends here; what follows is its extension
        draft[drafted] = best
        chances[drafted] = probability
        drafted += 1
        if confident < 0:
            score += probability
        kept = 0
        for i in range(found):
            j = next_at[i]
            if text[j] == best and text[j + 1] != SEPARATOR:  # every text ends in a separator: j + 1 < size
                next_at[kept] = j + 1
                kept += 1
        found = kept
    return drafted if confident < 0 else confident, drafted, score
