"""ZipCache's normalized attention score: the default salience of the mixed-precision codec
(:mod:`.mixed`) where the spec has no eviction policy. A scorer, not a registered policy: it
never evicts (the cache runs it with no budget, for the codec only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policy import Eviction, LayerView


@dataclass
class NormalizedAttention(Eviction):
    """ZipCache (He et al., 2024): a token's salience is the attention it has accumulated divided
    by the number of queries that could attend to it (causal attention gives early tokens more
    queries, so plain accumulated attention, H2O's, favours them): ``sum_k A[k, i] / nnz(A[:, i])``.

    The accumulated attention is the cache's (every query since the token was stored, prefill and
    decoding; averaged over the query heads of its KV group), and the queries that saw token ``i``
    are those at positions ``i ..`` the row's newest. ZipCache computes the score from probe
    queries only, to keep FlashAttention's fused kernel; kvlib computes attention weights in
    blocks anyway (as for H2O), so every query is a probe here.
    """

    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"accumulated_attention"})
    order_free: ClassVar[bool] = True

    def score(self, view: LayerView) -> torch.Tensor:
        """Accumulated attention over the count of queries at or after each token; invalid ``-inf``."""
        positions = torch.where(view.valid, view.positions, -1)
        newest = positions.amax(dim=(1, 2), keepdim=True)
        seen_by = (newest - positions + 1).clamp(min=1).to(torch.float32)
        return (view.accumulated_attention.float() / seen_by).masked_fill(~view.valid, -torch.inf)
