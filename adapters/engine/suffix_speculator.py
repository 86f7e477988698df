"""Draft tokens without a draft model: SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975) for the Engine.

A :class:`SuffixSpeculator` keeps a :class:`~kvlib.adapters.engine.suffix_index.SuffixIndex` per
running request over its prompt and output (each step appends only the tokens output since the
last) and one global index over the outputs of the requests finished most recently (at most
``global_tokens`` tokens of them; the oldest output leaves when a new one would pass that). Each
decode step, a request matches the longest suffix of its tokens (at most ``max_match``) that occurs
followed by something in each index, follows the most frequent continuation from there while its
estimated probability stays at least ``min_probability``, and of the two candidates proposes the
one of higher score (expected accepted tokens); its length is at most ``alpha * p`` for a match of
``p`` tokens (the adaptive ``MAX_SPEC``), at most ``max_draft``, and never more than the request
may still output beyond the verification's own token. Whether a proposed draft runs, and how
many tokens of it and its extension, is the scheduler's call (its cost model,
:attr:`SuffixSpeculation.token_cost`).

Memory: 4 bytes per token of each running request's prompt and output and per token of the global
window (``global_tokens``), in arrays of at most twice that capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from kvlib.adapters.engine.engine_request import Request
from kvlib.adapters.engine.suffix_index import SuffixIndex
from kvlib.errors import quoted

SPECULATION_METHODS = ("suffix",)

CALIBRATION_PRIOR = 16.0
"""Tokens expected and accepted that :meth:`SuffixSpeculator.calibration` starts from (it trusts
the chances until verifications have run about this many tokens)."""


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
        global_tokens: tokens of recent outputs the global index holds at most (0: no global index).
        token_cost: what one more token in a forward pass costs, as a share of a step's fixed
            cost (its weights' reads, its host work): the scheduler's cost model
            (:meth:`~kvlib.adapters.engine.scheduler.Scheduler.plan`) verifies a draft token where
            its probability of acceptance beats ``token_cost * R / (1 + token_cost * T)`` (a
            step of ``T`` tokens that outputs ``R``: what a verified token costs, in output
            tokens of that step), so a larger batch verifies less, and none past where that
            reaches 1. About 0.01 for a small model on a CPU core; less on an accelerator whose
            step is bound by memory.
        segment_cost: what a step's verification segment costs in itself (its writes, its
            attention call and the rollback of what it rejects, in every layer), as a share of a
            step's fixed cost: a step verifies only where the tokens it expects to gain pay for it
            too (``segment_cost * R / (1 + token_cost * T)`` output tokens). About 0.5 for a
            small model on a CPU core.
    """

    max_draft: int = 16
    alpha: float = 1.0
    max_match: int = 16
    min_probability: float = 0.1
    global_tokens: int = 8192
    token_cost: float = 0.01
    segment_cost: float = 0.5

    def __post_init__(self) -> None:
        for name in ("token_cost", "segment_cost"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (a share of a step's fixed cost), got {quoted(value)}")
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


class Draft(NamedTuple):
    """A request's proposal: the draft ``tokens`` (to follow its last token), their ``score`` (the
    tokens a verification is expected to accept), the ``extension`` (the same walk on past where
    ``min_probability`` stopped the draft, within its length limit: what to verify after it where
    a verification runs more tokens) and
    ``chances``, the estimated probability that each token of the draft and extension is
    accepted (the path's up to it)."""

    tokens: list[int]
    score: float
    extension: list[int]
    chances: list[float]


class SuffixSpeculator:
    """Proposes each decoding request's draft from its own index and the global one (see the module docstring)."""

    def __init__(self, options: SuffixSpeculation) -> None:
        self.options = options
        self.requests: dict[int, SuffixIndex] = {}
        """Each running request's index over its tokens (prompt and output so far)."""
        self.recent = SuffixIndex()
        """The global index: the outputs of the requests finished most recently (``global_tokens`` at most, all told)."""
        self.expected = 0.0
        """Draft tokens the verifications so far were expected to accept (the sum of the chances of the tokens they ran)."""
        self.accepted = 0
        """Draft tokens they accepted."""

    def observe(self, draft: Draft, ran: int, accepted: int) -> None:
        """A verification ran ``ran`` tokens of ``draft`` (and its extension; past them, fillers
        of no chance) and accepted ``accepted`` of them: the chances' calibration learns it."""
        self.expected += sum(draft.chances[:ran])
        self.accepted += accepted

    def calibration(self) -> float:
        """Tokens accepted per token expected so far, in (0, 1] (with a prior of
        :data:`CALIBRATION_PRIOR` tokens expected and accepted): a path's frequency share
        overestimates its chance where few occurrences back it (a path seen once has a share of
        1), so the cost model weighs the chances by this (``token_cost / calibration``)."""
        return min(1.0, (self.accepted + CALIBRATION_PRIOR) / (self.expected + CALIBRATION_PRIOR))

    def propose(self, request: Request) -> Draft:
        """The draft to follow ``request``'s last token (empty tokens: none found)."""
        options = self.options
        room = min(options.max_draft, request.max_new_tokens - len(request.output) - 1)
        if room <= 0:
            return Draft([], 0.0, [], [])
        own = self.requests.get(request.request_id)
        if own is None:
            own = self.requests[request.request_id] = SuffixIndex()
            own.add(request.prompt)
        indexed = own.indexed - len(request.prompt)
        if indexed < len(request.output):
            own.extend(request.output[indexed:])
        context = own.tokens[: own.size - 1]  # the request's tokens: its text, before the separator
        search = {"max_match": options.max_match, "max_draft": room, "alpha": options.alpha, "min_probability": options.min_probability}
        best = own.propose(context, **search)
        if self.recent.lengths:
            other = self.recent.propose(context, **search)
            if other[1] > best[1]:
                best = other
        return Draft(best[0].tolist(), best[1], best[2].tolist(), best[3].tolist())

    def finish(self, request: Request, *, finished: bool) -> None:
        """``request`` leaves the engine: its index is dropped, and a ``finished`` one's output joins
        the global window (the oldest outputs leave it while it holds more than ``global_tokens``)."""
        self.requests.pop(request.request_id, None)
        output = request.output
        if not finished or not output or len(output) > self.options.global_tokens:
            return
        self.recent.add(output)
        while self.recent.indexed > self.options.global_tokens:
            self.recent.drop_oldest()

    def indexed_tokens(self) -> int:
        """Tokens the indexes hold now (requests' and global), the unit of the memory bound."""
        return self.recent.indexed + sum(own.indexed for own in self.requests.values())
