"""Turning eviction scores into the token indices a head keeps."""

from __future__ import annotations

import torch


def select_keep(scores: torch.Tensor, candidates: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Indices of the tokens each head keeps: its ``caps`` best-scored candidates.

    Args:
        scores: keep-scores ``[batch, heads, slots]`` (higher means keep): ``+inf`` before every
            finite score, then finite scores in order (any float dtype), NaN and ``-inf`` last.
        candidates: bool ``[batch, heads, slots]``, the slots that may be kept (stored tokens that
            are not padding); no other slot is ever selected.
        caps: int ``[batch, heads]``, tokens each head may keep.

    Returns:
        int64 ``[batch, heads, k]`` on the CPU, slot indices padded with ``-1`` (``k`` is the
        largest number kept by any head); a head keeps ``min(cap, candidates)`` tokens.
    """
    if scores.shape != candidates.shape:
        raise ValueError(f"scores must have shape {list(candidates.shape)}, got {list(scores.shape)}")
    if not scores.dtype.is_floating_point:
        scores = scores.to(torch.float64)
    # Rank by class first (+inf, then finite, then NaN / -inf; non-candidates last), then by score.
    rank_class = torch.where(scores == torch.inf, 2, torch.where(torch.isfinite(scores), 1, 0))
    rank_class = rank_class.masked_fill(~candidates, -1)
    by_score = torch.sort(scores.nan_to_num(nan=-torch.inf), dim=-1, descending=True, stable=True).indices
    by_class = torch.sort(rank_class.gather(-1, by_score), dim=-1, descending=True, stable=True).indices
    order = by_score.gather(-1, by_class)
    kept = torch.minimum(caps.to("cpu", torch.int64), candidates.sum(-1).cpu())
    width = int(kept.max()) if kept.numel() else 0
    top = order[..., :width].cpu()
    return torch.where(torch.arange(width) < kept.unsqueeze(-1), top, -1)
