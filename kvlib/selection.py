"""Turning eviction scores into the token indices a head keeps."""

from __future__ import annotations

import torch


def select_keep(scores: torch.Tensor, candidates: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Indices of the tokens each head keeps: its ``caps`` best-scored candidates.

    Args:
        scores: keep-scores ``[batch, heads, slots]`` (higher means keep): ``+inf`` before every
            finite score (later slots first among them), then finite scores in order (any float
            dtype), NaN and ``-inf`` last.
        candidates: bool ``[batch, heads, slots]``, the slots that may be kept (stored tokens that
            are not padding); no other slot is ever selected.
        caps: int ``[batch, heads]``, tokens each head may keep.

    Returns:
        int64 ``[batch, heads, k]`` on the CPU, slot indices padded with ``-1`` (``k`` is the
        largest number kept by any head); a head keeps ``min(cap, candidates)`` tokens.
    """
    if scores.shape != candidates.shape:
        raise ValueError(f"scores must have shape {list(candidates.shape)}, got {list(scores.shape)}")
    order = rank_order(scores, candidates)
    kept = torch.minimum(caps.to("cpu", torch.int64), candidates.sum(-1).cpu())
    width = int(kept.max()) if kept.numel() else 0
    top = order[..., :width].cpu()
    return torch.where(torch.arange(width) < kept.unsqueeze(-1), top, -1)


def rank_order(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last axis best first: candidates with ``+inf`` (later slots first: a
    protected window larger than the budget keeps its newest tokens), then finite scores
    descending, then NaN and ``-inf``, then non-candidates; other ties keep slot order (stable)."""
    if not scores.dtype.is_floating_point:
        scores = scores.to(torch.float64)
    slots = scores.shape[-1]
    newest_first = 2.0 + torch.arange(1, slots + 1, dtype=torch.float64, device=scores.device) / (slots + 1)
    rank_class = torch.where(scores == torch.inf, newest_first, torch.where(torch.isfinite(scores), 1.0, 0.0))
    rank_class = rank_class.masked_fill(~candidates, -1.0)
    by_score = torch.sort(
        scores.nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf), dim=-1, descending=True, stable=True
    ).indices
    by_class = torch.sort(rank_class.gather(-1, by_score), dim=-1, descending=True, stable=True).indices
    return by_score.gather(-1, by_class)


def position_rank(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch, heads, slots]``: each valid slot's rank among its head's valid slots by
    position (0: the oldest), wherever the slots lie (slot order need not be position order);
    invalid slots rank after every valid one."""
    key = torch.where(valid, positions, torch.iinfo(torch.int64).max)
    order = torch.sort(key, dim=-1, stable=True).indices
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)


def apportion(totals: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Split each of ``totals`` (int ``[batch]``) into integer parts proportional to ``weights``.

    ``weights``: finite non-negative floats ``[parts]`` with a positive sum. Returns int64
    ``[batch, parts]`` whose rows sum exactly to ``totals``: each part gets the floor of its
    share, and the leftover units go to the largest remainders (ties: lower index first).
    """
    weights = weights.to(torch.float64)
    if weights.ndim != 1 or not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or not float(weights.sum()) > 0:
        raise ValueError(f"weights must be a 1-D tensor of finite, non-negative numbers with a positive sum, got {weights}")
    weights = weights / weights.max()  # in [0, 1]: the sum cannot overflow
    totals = totals.to(torch.int64)
    shares = totals.unsqueeze(-1).to(torch.float64) * (weights / weights.sum())
    parts = shares.floor().to(torch.int64)
    leftover = totals - parts.sum(-1)
    order = torch.sort(shares - parts, dim=-1, descending=True, stable=True).indices
    bonus = (torch.arange(weights.numel(), device=totals.device) < leftover.unsqueeze(-1)).to(torch.int64)
    return parts + torch.zeros_like(parts).scatter(-1, order, bonus)
