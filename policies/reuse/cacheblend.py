"""CacheBlend: chunks' cached KV fused into one prompt, a selected share of tokens recomputed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from kvlib.params import Seed
from kvlib.policy import Reuse
from kvlib.registry import register


@register("cacheblend")
@dataclass
class CacheBlend(Reuse):
    """CacheBlend (Yao et al., 2025, "CacheBlend: Fast Large Language Model Serving for RAG with
    Cached Knowledge Fusion"): a prompt built from chunks whose KV was computed on their own
    (keys re-rotated to the chunks' new positions, exact) lacks only the cross-chunk attention; a
    small share of tokens recomputed restores most of it.

    Args:
        recompute: share of the chunks' tokens recomputed, in [0, 1] (1: a full prefill's KV).
        select: which tokens: ``deviation`` (CacheBlend: those whose KV at ``probe_layer``, computed
            with full attention, deviates most from the fused cache; the probe runs layers up to
            ``probe_layer`` on every token, and those layers keep the full KV), ``first`` (the
            first tokens of every chunk after the first, where missing context weighs most), or
            ``random`` (seeded; a baseline).
        probe_layer: the layer the ``deviation`` rule measures at (layers up to it run fully).
        seed: the ``random`` rule's seed.
    """

    recompute: float = 0.15
    select: Literal["deviation", "first", "random"] = "deviation"
    probe_layer: int = 1
    seed: Seed = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recompute <= 1.0:
            raise ValueError(f"recompute must be in [0, 1], got {self.recompute}")
        if self.probe_layer < 0:
            raise ValueError(f"probe_layer must be an int >= 0, got {self.probe_layer}")

    def count(self, tokens: int) -> int:
        """Tokens recomputed out of ``tokens``."""
        return min(tokens, math.ceil(self.recompute * tokens))

    def choose(self, chunk_lengths: list[int], deviation: torch.Tensor | None) -> torch.Tensor:
        """Positions to recompute (int64, ascending) among ``sum(chunk_lengths)`` tokens;
        ``deviation`` (float ``[tokens]``) is given for the ``deviation`` rule."""
        total = sum(chunk_lengths)
        count = self.count(total)
        if count == 0:
            return torch.zeros(0, dtype=torch.int64)
        if self.select == "deviation":
            if deviation is None:
                raise ValueError("the deviation rule needs the probe's deviation per token")
            return deviation.float().cpu().topk(count).indices.sort().values
        if self.select == "random":
            return torch.randperm(total, generator=torch.Generator().manual_seed(self.seed))[:count].sort().values
        starts = torch.tensor([0, *chunk_lengths[:-1]]).cumsum(0)
        later = [(int(s), n) for s, n in zip(starts.tolist(), chunk_lengths)][1:] or [(0, chunk_lengths[0])]
        share = [math.ceil(count * n / sum(n for _, n in later)) for _, n in later]
        chosen = torch.cat([torch.arange(s, s + min(k, n)) for (s, n), k in zip(later, share)])
        return chosen[:count].sort().values
