"""What one layer's past calls leave for policies that look back across calls.

A decode step's compaction sees only that step's query; policies that rank tokens by the
attention of the last few decode steps (MorphKV, R-KV) or treat prompt and decode tokens apart
(SCOPE) need the layer's recent queries and where each row's prompt ended. The evictor keeps
one :class:`QueryHistory` per layer for policies that need ``recent_queries`` or
``prompt_length`` and keeps it in step with the cache's rows (``rows``; a new batch starts afresh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QueryHistory:
    """One layer's last real queries and each row's prompt length.

    ``queries`` ``[batch, query_heads, count, head_dim]`` (after RoPE, the compute dtype) and
    ``positions`` int64 ``[batch, count]`` (from the row's first real token; -1 for an empty
    place, in a row that has seen fewer than ``count`` real queries): oldest first, positions
    strictly ascending among the real ones. ``prompt_lengths`` int64 ``[batch]``: one past the
    newest position written by a row's first call or a call of more than one token (0 before any).
    """

    queries: torch.Tensor
    positions: torch.Tensor
    prompt_lengths: torch.Tensor

    @classmethod
    def empty(cls, query: torch.Tensor) -> QueryHistory:
        """No queries yet, shaped like ``query`` ``[batch, heads, _, head_dim]``."""
        batch, heads, _, dim = query.shape
        return cls(
            query.new_zeros(batch, heads, 0, dim),
            torch.zeros(batch, 0, dtype=torch.int64, device=query.device),
            torch.zeros(batch, dtype=torch.int64, device=query.device),
        )

    def after_call(self, query: torch.Tensor, positions: torch.Tensor, count: int) -> QueryHistory:
        """The history once a call with ``query`` ``[batch, heads, q_len, head_dim]`` at
        ``positions`` int64 ``[batch, q_len]`` (-1: padding) has run, keeping the last ``count``
        real queries of each row. Stored queries at or past a row's first new position are
        dropped first (a rolled-back, re-run step replaces them)."""
        positions = positions.to(self.positions.device)
        first_new = torch.where(positions >= 0, positions, torch.iinfo(torch.int64).max).amin(-1, keepdim=True)
        kept = torch.where(self.positions < first_new, self.positions, -1)
        missing = max(0, count - kept.shape[1] - positions.shape[1])  # empty places, so the history is ``count`` wide
        empties = torch.full((positions.shape[0], missing), -1, dtype=torch.int64, device=positions.device)
        every = torch.cat([empties, kept, positions], dim=1)
        queries = torch.cat([query.new_zeros(*query.shape[:2], missing, query.shape[-1]), self.queries, query], dim=2)
        order = every.argsort(dim=-1, stable=True)[:, max(0, every.shape[1] - count) :]  # empties (-1) sort first
        index = order.view(order.shape[0], 1, -1, 1).expand(-1, queries.shape[1], -1, queries.shape[-1])
        prompting = (self.prompt_lengths == 0) | (query.shape[2] > 1)  # a row's first call is its prompt, whatever its length
        prompt_lengths = torch.where(prompting, torch.maximum(self.prompt_lengths, positions.amax(-1) + 1), self.prompt_lengths)
        return QueryHistory(queries.gather(2, index), every.gather(1, order), prompt_lengths)

    def rows(self, index: torch.Tensor) -> QueryHistory:
        """Row ``i`` becomes old row ``index[i]``."""
        index = index.to(self.positions.device)
        return QueryHistory(self.queries[index], self.positions[index], self.prompt_lengths[index])

    def attention(self, keys: torch.Tensor, key_positions: torch.Tensor, valid: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Float32 ``[batch, query_heads, count, slots]``: each stored query's softmax attention
        over the ``valid`` slots of ``keys`` ``[batch, kv_heads, slots, head_dim]`` at positions at
        or before its own (``key_positions`` int64 ``[batch, kv_heads, slots]``), 0 elsewhere and
        in the rows of empty places. ``scaling``: the softmax scale (None: ``head_dim ** -0.5``)."""
        batch, kv_heads, slots, dim = keys.shape
        heads, count = self.queries.shape[1], self.queries.shape[2]
        groups = heads // kv_heads
        scale = scaling if scaling is not None else dim**-0.5
        rows = self.queries.to(keys.device).reshape(batch, kv_heads, groups * count, dim).float()
        logits = torch.matmul(rows, keys.float().transpose(-1, -2)).mul_(scale).view(batch, kv_heads, groups, count, slots)
        query_positions = self.positions.to(keys.device).view(batch, 1, 1, count, 1)
        visible = valid.view(batch, kv_heads, 1, 1, slots) & (key_positions.view(batch, kv_heads, 1, 1, slots) <= query_positions)
        visible = visible & (query_positions >= 0)
        weights = torch.softmax(logits.masked_fill(~visible, -torch.inf), dim=-1).nan_to_num_(0.0)
        return weights.reshape(batch, heads, count, slots)
