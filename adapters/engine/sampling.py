"""Choosing each request's next token from its logits (greedy, or sampling with temperature,
top-k and top-p), one request at a time so that every request keeps its own random source."""

from __future__ import annotations

import math

import torch

from kvlib.errors import quoted

MAX_TOP_K = 2**31
"""``top_k`` is below this (far above any vocabulary; ``torch.topk`` takes an int32-sized k)."""


def next_token(
    logits: torch.Tensor,
    *,
    do_sample: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """The next token id from ``logits`` (``[vocab]``): the argmax, or a sample from the
    temperature-scaled distribution restricted to the ``top_k`` most likely tokens (0: all) and to
    the smallest set whose probability reaches ``top_p`` (as ``transformers`` filters them)."""
    if not do_sample:
        return int(logits.argmax())
    scores = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scores.sort(descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probabilities = scores.softmax(-1)
    return int(torch.multinomial(probabilities.cpu(), 1, generator=generator))


def check_sampling(do_sample: bool, temperature: float, top_k: int, top_p: float) -> None:
    """``ValueError`` naming the first sampling argument of the wrong type or out of range."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be a bool, got {quoted(do_sample)}")
    if not _real(temperature) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {quoted(temperature)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k < MAX_TOP_K:
        raise ValueError(f"top_k must be an int in [0, {MAX_TOP_K}) (0: no top-k filter), got {quoted(top_k)}")
    if not _real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {quoted(top_p)}")


def _real(value: object) -> bool:
    """Whether ``value`` is a real number (an int or a float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
