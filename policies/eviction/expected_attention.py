"""Expected Attention: keep the tokens future queries are expected to attend to."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policy import Eviction, LayerView, Rope
from kvlib.registry import register


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves of the last dim (the RoPE pair partner)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotation(positions: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[*positions.shape, head_dim]`` of each position's angles (channel ``i`` and
    ``i + head_dim // 2`` share ``position * inv_freq[i]``), in float32 as the model computes them."""
    inv_freq = rope.inv_freq.to(positions.device, torch.float32)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` times the RoPE-shaped matrix with diagonal ``cos`` and pair coupling ``sin`` (last dim)."""
    return x * cos + rotate_half(x) * sin


def unrotate(queries: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Pre-RoPE queries ``[batch, heads, q, d]`` from post-RoPE ones at int64 ``positions [batch, q]``.

    Inverts ``q' = scaling * R(p) q``: ``q = R(-p) q' / scaling``. Padding positions (-1) give
    finite values that callers must ignore.
    """
    cos, sin = rotation(positions.unsqueeze(1), rope)  # [batch, 1, q, d]
    return rotate(queries, cos, -sin) / rope.scaling


@register("expected_attention")
@dataclass
class ExpectedAttention(Eviction):
    """Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by
    Estimating Attention from Future Queries Distribution"; kvpress ``ExpectedAttentionPress``).

    Future queries of each query head are modelled as a Gaussian with the mean ``mu`` and
    covariance ``Sigma`` of this call's queries, taken before RoPE (un-rotated with
    ``query_positions``) and then rotated by the RoPE rotation averaged over the
    ``n_future_positions`` positions after the row's last query (``A = scaling * mean_D R(t + D)``,
    ``mu -> A mu``, ``Sigma -> A Sigma A^T``). Under that model the expected attention logit of a
    key ``k`` is ``mu^T k / sqrt(d) + k^T Sigma k / (2 d)``; its softmax over the head's valid
    non-sink slots, averaged over the query heads of the KV group, times ``||v||_2`` is the score.
    Tokens at positions below ``n_sink`` score +inf (kept); invalid slots score -inf.

    Statistics skip padding queries and queries at positions below ``n_sink`` (outliers). With
    one query (a decode step) the covariance is zero; with none the mean is zero too, so the
    score falls back to ``||v||`` times a uniform softmax. For a model without RoPE
    (``rope`` None) queries are used as they are. Scores of a row depend only on that row.

    Args:
        n_future_positions: future positions (tokens) the RoPE rotation is averaged over.
        n_sink: initial positions (tokens) always kept and left out of the query statistics.
        use_covariance: include the ``k^T Sigma k / (2 d)`` term (False: mean query only).
        use_vnorm: multiply the expected attention by the value's L2 norm.
        epsilon: added to the expected attention before the value-norm product (``use_vnorm``).
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    needs: ClassVar[frozenset[str]] = frozenset({"queries", "rope"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be >= 1, got {self.n_future_positions}")
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")

    def query_statistics(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean ``[batch, query_heads, d]`` and covariance ``[batch, query_heads, d, d]`` (1/N
        normalisation; None unless ``use_covariance``) of the future queries, after the averaged
        RoPE rotation."""
        queries, positions = view.queries.float(), view.query_positions
        if view.rope is not None:
            queries = unrotate(queries, positions.clamp(min=0), view.rope)
        used = (positions >= self.n_sink)[:, None, :, None]  # [batch, 1, q, 1]; excludes padding (-1)
        count = used.sum(2, keepdim=True).clamp(min=1)
        mean = torch.where(used, queries, 0.0).sum(2, keepdim=True) / count
        covariance = None
        if self.use_covariance:
            centered = torch.where(used, queries - mean, 0.0)
            covariance = centered.mT @ centered / count
        mean = mean.squeeze(2)
        if view.rope is None:
            return mean, covariance
        ahead = torch.arange(1, self.n_future_positions + 1, device=positions.device)
        future = positions.max(-1).values[:, None] + ahead  # [batch, future] after the last query
        cos, sin = rotation(future, view.rope)  # [batch, future, d]
        cos, sin = cos.mean(1) * view.rope.scaling, sin.mean(1) * view.rope.scaling  # the averaged A
        mean = rotate(mean, cos[:, None], sin[:, None])
        if covariance is not None:
            cos, sin = cos[:, None, None], sin[:, None, None]
            covariance = rotate(rotate(covariance, cos, sin).mT, cos, sin).mT  # A Sigma A^T
        return mean, covariance

    def score(self, view: LayerView) -> torch.Tensor:
        """Expected attention times value norm; sinks +inf, invalid slots -inf."""
        batch, kv_heads, slots, dim = view.keys.shape
        keys = view.keys.float()
        mean, covariance = self.query_statistics(view)
        mean = mean.reshape(batch, kv_heads, -1, dim)  # query head j -> kv head j // group
        logits = torch.einsum("bkgd,bksd->bkgs", mean, keys) / math.sqrt(dim)
        if covariance is not None:
            covariance = covariance.reshape(batch, kv_heads, -1, dim, dim)
            logits = logits + torch.einsum("bksi,bkgij,bksj->bkgs", keys, covariance, keys) / (2 * dim)
        sink = view.valid & (view.positions < self.n_sink)
        scored = (view.valid & ~sink).unsqueeze(2)
        attention = torch.softmax(logits.masked_fill(~scored, -torch.inf), dim=-1)
        score = torch.where(scored, attention, 0.0).mean(2)  # no NaN from heads with nothing scored
        if self.use_vnorm:
            score = (score + self.epsilon) * view.values.float().norm(dim=-1)
        score = torch.where(sink, torch.inf, score)
        return torch.where(view.valid, score, -torch.inf)
