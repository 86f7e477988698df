"""Turning eviction scores into the token indices a head keeps."""

from __future__ import annotations

import torch


def select_keep(scores: torch.Tensor, candidates: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Indices of the tokens each head keeps: its ``caps`` best-scored candidates.

    Args:
        scores: keep-scores ``[batch, heads, slots]`` (higher means keep; ``+inf`` always kept
            before finite scores, NaN treated as the lowest finite score).
        candidates: bool ``[batch, heads, slots]``, the slots that may be kept (stored tokens that
            are not padding); no other slot is ever selected.
        caps: int ``[batch, heads]``, tokens each head may keep.

    Returns:
        int64 ``[batch, heads, k]`` on the CPU, slot indices padded with ``-1`` (``k`` is the
        largest number kept by any head); a head keeps ``min(cap, candidates)`` tokens.
    """
    if scores.shape != candidates.shape:
        raise ValueError(f"scores must have shape {list(candidates.shape)}, got {list(scores.shape)}")
    finite = torch.finfo(torch.float32)
    ranked = scores.to(torch.float32).nan_to_num(nan=finite.min, posinf=finite.max, neginf=finite.min)
    ranked = ranked.masked_fill(~candidates, -torch.inf)
    kept = torch.minimum(caps.to("cpu", torch.int64), candidates.sum(-1).cpu())
    width = int(kept.max()) if kept.numel() else 0
    top = ranked.topk(width, dim=-1).indices.cpu()
    return torch.where(torch.arange(width) < kept.unsqueeze(-1), top, -1)
