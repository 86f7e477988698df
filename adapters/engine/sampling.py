"""Choosing each request's next token from its logits (greedy, or sampling with temperature,
top-k and top-p), one request at a time so that every request keeps its own random source, and
verifying a speculated draft against the logits of its tokens (:func:`verify_draft`)."""

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
    """The next token id from ``logits`` (``[vocab]``): the argmax, or a sample from
    :func:`target_probabilities`."""
    if not do_sample:
        return int(logits.argmax())
    probabilities = target_probabilities(logits, temperature, top_k, top_p)
    return int(torch.multinomial(probabilities, 1, generator=generator))


def target_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from, float32 ``[vocab]`` on the CPU: the temperature-scaled
    softmax of ``logits`` restricted to the ``top_k`` most likely tokens (0: all) and to the smallest
    set whose probability reaches ``top_p`` (as ``transformers`` filters them)."""
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
    return scores.softmax(-1).cpu()


def verify_draft(
    logits: torch.Tensor,
    draft: list[int],
    *,
    do_sample: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a verification outputs: the accepted prefix of ``draft`` and one token of the
    model's after it. ``logits`` ``[len(draft) + 1, vocab]``: row ``i`` predicts the token after
    the verified segment's ``i``-th (the last token, then the draft's).

    Greedy: draft token ``i`` is accepted while it equals the argmax of row ``i``; the first row
    that disagrees (or the last row) gives its argmax. Sampling (speculative sampling with a
    deterministic draft, Leviathan et al. 2023, Chen et al. 2023): draft token ``x`` is accepted
    with probability ``p(x)`` under :func:`target_probabilities` of its row; on a rejection the
    token is drawn from ``p`` with ``x``'s mass removed, renormalized; after a fully accepted draft
    from the last row. Each output token is so distributed as :func:`next_token` would draw it."""
    outputs = []
    for row, proposed in zip(logits, draft):
        if not do_sample:
            chosen = int(row.argmax())
            outputs.append(chosen)
            if chosen != proposed:
                return outputs
            continue
        probabilities = target_probabilities(row, temperature, top_k, top_p)
        if float(torch.rand((), generator=generator)) < float(probabilities[proposed]):
            outputs.append(proposed)
            continue
        probabilities[proposed] = 0.0
        outputs.append(int(torch.multinomial(probabilities, 1, generator=generator)))
        return outputs
    outputs.append(
        next_token(logits[len(draft)], do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    )
    return outputs


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
