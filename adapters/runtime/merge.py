"""Merging evicted tokens into kept ones instead of dropping them (CaM-style).

CaM (Zhang et al., 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference") observes that
dropping a token removes its value's contribution to every later attention output, and merges
evicted values into the kept cache instead. kvlib's ``merge`` option does the simplest faithful
form: each evicted token's value is folded into the kept token of the same head whose key is
most similar (cosine), and each kept value becomes the mean of itself and the values folded
into it. Keys (what attention matches against) are not changed.
"""

from __future__ import annotations

import torch


def merged_values(keys: torch.Tensor, values: torch.Tensor, candidates: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """New values of the kept tokens, ``[batch, heads, k, value_dim]`` aligned with ``kept``.

    Args:
        keys, values: the layer's stored tokens ``[batch, heads, slots, dim]``.
        candidates: bool ``[batch, heads, slots]``: tokens eviction chose among; those not kept
            are folded in (other slots, such as padding, are ignored).
        kept: int64 ``[batch, heads, k]``: kept slots, ascending, ``-1`` last.
    """
    if kept.shape[-1] == 0:
        return values[:, :, :0]
    slot_kept = kept >= 0
    index = kept.clamp(min=0)
    kept_keys = keys.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])).float()
    kept_values = values.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1])).float()
    is_kept = torch.zeros_like(candidates).scatter_(2, index, slot_kept) & candidates
    evicted = candidates & ~is_kept
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    similarity = torch.matmul(unit, torch.nn.functional.normalize(kept_keys, dim=-1).transpose(-1, -2))
    target = similarity.masked_fill_(~slot_kept.unsqueeze(2), -torch.inf).argmax(-1)  # [batch, heads, slots]
    weight = evicted.float()
    sums = kept_values.scatter_add(2, target.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]), values.float() * weight.unsqueeze(-1))
    counts = torch.ones_like(kept, dtype=torch.float32).scatter_add(2, target, weight)
    return (sums / counts.unsqueeze(-1)).to(values.dtype)
