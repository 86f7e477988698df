"""Attention of a few queries per row over a layer's pages with torch ops: the paged read path
of devices the numba kernel does not run on (CUDA; :func:`kvlib.devices.paged_kernel`).

:func:`attend_pages_torch` computes exactly what :func:`kvlib.kernels.paged_attention.paged_attention`
computes (the same arguments, shapes and mask rules: grouped-query heads, visibility by the
model's mask looked up at each stored token's original position or causal by the queries'
positions, soft-capping, float32 accumulation, zeros for a query that sees no token, output in
the query's dtype), on any device, without a dense copy of the layer:

- the block table is walked ``pages_per_block`` pages at a time (by default as many as fit
  :data:`WORKSPACE_BYTES`, see :func:`block_pages`); each step gathers that block's
  pages of every (row, KV head) at once (``key_arena[page_ids]``: one batched gather for the
  whole batch and all heads) into float32, scores it and folds it into a running max, sum and
  accumulator per query (FlashAttention's online softmax, rescaling by ``exp(old_max -
  new_max)``);
- the transient workspace is one block: ``batch * kv_heads * pages_per_block * page_size``
  tokens of keys and values in float32, plus the block's scores; never the whole layer;
- index and bookkeeping tensors (``pages``, ``lengths``, ``visible``, ``query_positions``) may
  arrive on the CPU: they move to the arenas' device through :func:`kvlib.devices.to_arena_device`.
  The number of blocks is read from ``lengths`` (no device synchronisation when it is on the CPU).

Slots past a head's length (the tail of its last page, pages ``-1`` past its last) are masked
and their values zeroed before use, so an arena's unwritten rows (``torch.empty``: any bits,
NaN included) never reach the output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvlib.devices import to_arena_device
from kvlib.kernels.query_groups import grouped_rows

PAGES_PER_BLOCK = 32
"""The fewest pages of each (row, KV head) a step gathers by default: 512 tokens at 16 tokens a page."""

WORKSPACE_BYTES = 64 * 2**20
"""The transient workspace a step may take by default (float32 keys, values and scores of one
block). Each step costs a dozen kernel launches, so on CUDA a decode step over a few thousand
tokens is bound by launches, not bytes (measured on an H100: 32-page blocks took 2-4 ms per layer
at 2k tokens where gathering the layer and running SDPA took 0.2-0.4 ms); a budget in bytes lets
a short context go in one step and bounds a long one's workspace. It is freed after the layer:
nothing keeps a dense copy."""


def block_pages(batch: int, kv_heads: int, rows: int, page_size: int, dims: int, used: int) -> int:
    """Pages per step under :data:`WORKSPACE_BYTES` for ``batch`` rows of ``kv_heads`` heads,
    ``rows`` grouped queries per head and ``dims`` = head_dim + value_dim per token: at least
    :data:`PAGES_PER_BLOCK`, at most ``used`` (the longest head's pages, one step for all)."""
    per_page = batch * kv_heads * page_size * (dims + rows) * 4  # float32 keys, values and scores
    return max(PAGES_PER_BLOCK, min(max(used, 1), WORKSPACE_BYTES // per_page))


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Page dtypes the torch path reads (computed in float32 whatever the pages' dtype)."""


class TorchPageSource(NamedTuple):
    """A layer's float pages as :func:`attend_pages_torch` reads them, on their own device: key
    and value arenas ``[capacity, page_size, head_dim | value_dim]`` (one dtype) and each page's
    token positions (int64 ``[capacity, page_size]``, same device). The counterpart of
    :class:`kvlib.kernels.paged_attention.PageSource` off the CPU (:func:`kvlib.kernels.arena_sources.arena_source_for`)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def value_dim(self) -> int:
        """Value channels per token."""
        return self.values.shape[2]

    def attend(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attend_pages_torch` of ``query`` over these pages through the block table
        ``pages`` holding ``lengths`` tokens; ``options``: its keyword arguments."""
        return attend_pages_torch(query, self.keys, self.values, self.positions, pages, lengths, **options)

    def attend_parts(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`attend_parts_torch` of ``query`` over these pages: float32 output and log-sum-exps."""
        return attend_parts_torch(query, self.keys, self.values, self.positions, pages, lengths, **options)

    def weights(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attention_weights_torch` of ``query`` over these pages; ``options``: its keyword arguments."""
        return attention_weights_torch(query, self.keys, self.positions, pages, lengths, **options)


def torch_arena_source(key_arena: torch.Tensor, value_arena: torch.Tensor, positions: torch.Tensor) -> TorchPageSource:
    """The :class:`TorchPageSource` of pages held in a float compute dtype (keys and values alike)."""
    if key_arena.dtype not in FLOAT_DTYPES or value_arena.dtype != key_arena.dtype:
        raise ValueError(f"pages must be one of {FLOAT_DTYPES} (keys and values alike), got {key_arena.dtype} / {value_arena.dtype}")
    return TorchPageSource(key_arena, value_arena, positions)


def attend_pages_torch(
    query: torch.Tensor,
    key_arena: torch.Tensor,
    value_arena: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    pages_per_block: int | None = None,
) -> torch.Tensor:
    """:func:`kvlib.kernels.paged_attention.paged_attention` with torch ops, ``pages_per_block`` pages of
    each (row, KV head) at a time (None: :func:`block_pages`; module docstring); arguments and
    result as documented there.
    ``query`` and the arenas share a device (the result's); the index tensors may be on the CPU."""
    out, _ = attend_parts_torch(
        query,
        key_arena,
        value_arena,
        positions,
        pages,
        lengths,
        visible=visible,
        query_positions=query_positions,
        scale=scale,
        softcap=softcap,
        pages_per_block=pages_per_block,
    )
    return out.to(query.dtype)


def attend_parts_torch(
    query: torch.Tensor,
    key_arena: torch.Tensor,
    value_arena: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    pages_per_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_pages_torch` as a partial attention (:func:`kvlib.kernels.paged_attention.attend_parts`):
    the output in float32 ``[batch, query_heads, queries, value_dim]`` and each query's
    log-sum-exp, float32 ``[batch, query_heads, queries]`` (``-inf`` where it sees nothing)."""
    batch, query_heads, queries, _ = query.shape
    blocks = _Blocks.over(query, key_arena, pages, lengths, visible, query_positions, pages_per_block, value_arena.shape[2])
    kv_heads, rows, value_dim = pages.shape[1], blocks.grouped.shape[2], value_arena.shape[2]
    device = key_arena.device
    running_max = torch.full((batch, kv_heads, rows), float("-inf"), device=device)
    running_sum = torch.zeros(batch, kv_heads, rows, device=device)
    acc = torch.zeros(batch, kv_heads, rows, value_dim, device=device)
    for ids, stored, scores in blocks.scores(key_arena, positions, scale, softcap):
        tokens = stored.shape[-1]
        values = value_arena[ids].reshape(batch, kv_heads, tokens, value_dim).to(torch.float32)
        values = values.masked_fill(~stored.unsqueeze(-1), 0.0)  # unwritten slots may hold NaN
        new_max = torch.maximum(running_max, scores.amax(-1))
        shift = new_max.masked_fill(new_max == float("-inf"), 0.0)  # nothing seen yet: exp(-inf) = 0 all the same
        weights = torch.exp(scores - shift.unsqueeze(-1))
        rescale = torch.exp(running_max - shift)
        running_sum = running_sum * rescale + weights.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + weights @ values
        running_max = new_max
    inverse = torch.where(running_sum > 0, running_sum.reciprocal(), 0.0)
    out = acc * inverse.unsqueeze(-1)
    lse = torch.where(running_sum > 0, running_max + running_sum.log(), float("-inf"))
    return out.view(batch, query_heads, queries, value_dim), lse.view(batch, query_heads, queries)


def attention_weights_torch(
    query: torch.Tensor,
    key_arena: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    pages_per_block: int | None = None,
) -> torch.Tensor:
    """:func:`kvlib.kernels.paged_attention.attention_weights` with torch ops (keys only, a block of pages
    at a time): float32 ``[batch, query_heads, queries, pages.shape[2] * page_size]``, on the
    arenas' device."""
    batch, query_heads, queries, _ = query.shape
    blocks = _Blocks.over(query, key_arena, pages, lengths, visible, query_positions, pages_per_block, 0)
    kv_heads, rows, page_size = pages.shape[1], blocks.grouped.shape[2], key_arena.shape[1]
    scores = torch.full((batch, kv_heads, rows, pages.shape[2] * page_size), float("-inf"), device=key_arena.device)
    first = 0
    for _, stored, block in blocks.scores(key_arena, positions, scale, softcap):
        scores[..., first : first + stored.shape[-1]] = block
        first += stored.shape[-1]
    weights = torch.softmax(scores.view(batch, query_heads, queries, -1), dim=-1)
    return weights.nan_to_num_(0.0)  # a query that sees nothing: all -inf, softmax NaN


class _Blocks(NamedTuple):
    """The block walk both torch paths share: grouped float32 queries ``[batch, kv_heads, group *
    queries, head_dim]`` (row ``r``: group ``r // queries``, query ``r % queries``, as the numba
    kernel), the block table and lengths on the arenas' device, the visibility rule, and how
    many pages each step takes."""

    grouped: torch.Tensor
    pages: torch.Tensor
    lengths: torch.Tensor
    seen_by: _Visibility
    used: int
    pages_per_block: int

    @staticmethod
    def over(query, key_arena, pages, lengths, visible, query_positions, pages_per_block, value_dim) -> _Blocks:
        """Checked arguments of :func:`attend_pages_torch` as a block walk (``value_dim`` 0 when
        only keys are read; ``pages_per_block`` None: :func:`block_pages`)."""
        batch, _, _, dim = query.shape
        kv_heads = pages.shape[1]
        rows = grouped_rows(query, pages, visible, query_positions)
        if pages_per_block is not None and pages_per_block < 1:
            raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
        device, page_size = key_arena.device, key_arena.shape[1]
        used = -(-int(lengths.max()) // page_size) if lengths.numel() else 0  # pages of the longest head
        if pages_per_block is None:
            pages_per_block = block_pages(batch, kv_heads, rows, page_size, dim + value_dim, used)
        grouped = query.detach().to(device=device, dtype=torch.float32).reshape(batch, kv_heads, rows, dim)
        seen_by = _Visibility(
            None if visible is None else to_arena_device(visible, device),
            None if query_positions is None else to_arena_device(query_positions, device),
            kv_heads,
        )
        return _Blocks(grouped, to_arena_device(pages, device), to_arena_device(lengths, device), seen_by, used, pages_per_block)

    def scores(self, key_arena: torch.Tensor, positions: torch.Tensor, scale: float, softcap: float | None):
        """Yield ``(ids, stored, scores)`` per block of pages: the block's page ids ``[batch,
        kv_heads, n]`` (``-1`` read as page 0), bool ``stored [batch, kv_heads, n * page_size]``
        (slots within the head's length) and float32 ``scores [batch, kv_heads, rows, n *
        page_size]``, scaled, soft-capped, ``-inf`` where a query does not see the token."""
        batch, kv_heads, rows, dim = self.grouped.shape
        queries = self.seen_by.queries(rows)
        page_size = key_arena.shape[1]
        offsets = torch.arange(self.pages_per_block * page_size, device=key_arena.device)
        for first in range(0, self.used, self.pages_per_block):
            ids = self.pages[:, :, first : first + self.pages_per_block].clamp(min=0)  # -1 (no page) reads page 0, masked below
            tokens = ids.shape[2] * page_size
            stored = first * page_size + offsets[:tokens] < self.lengths.unsqueeze(-1)  # [batch, kv_heads, tokens]
            keys = key_arena[ids].reshape(batch, kv_heads, tokens, dim).to(torch.float32)
            seen = self.seen_by(positions[ids].reshape(batch, kv_heads, tokens), stored)  # [batch, kv_heads, queries, tokens]
            scores = (self.grouped @ keys.transpose(-1, -2)) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.view(batch, kv_heads, rows // queries, queries, tokens).masked_fill(~seen.unsqueeze(2), float("-inf"))
            yield ids, stored, scores.view(batch, kv_heads, rows, tokens)


class _Visibility(NamedTuple):
    """Which stored tokens each query sees: by the model's mask ``visible [batch, queries,
    logical]`` looked up at each token's position, or else causally by ``query_positions
    [queries]``; on the arenas' device."""

    visible: torch.Tensor | None
    query_positions: torch.Tensor | None
    kv_heads: int

    def queries(self, rows: int) -> int:
        """Queries per row of a KV head (``rows`` is group size times queries)."""
        return self.visible.shape[1] if self.visible is not None else self.query_positions.shape[0]

    def __call__(self, token_positions: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """bool ``[batch, kv_heads, queries, tokens]`` for a block's ``token_positions`` (int64
        ``[batch, kv_heads, tokens]``), of which only the ``stored`` ones count."""
        counted = (stored & (token_positions >= 0)).unsqueeze(2)
        if self.visible is None:
            return counted & (token_positions.unsqueeze(2) <= self.query_positions.view(1, 1, -1, 1))
        batch, queries, logical = self.visible.shape
        if logical == 0:
            return counted & False
        tokens = token_positions.shape[-1]
        inside = token_positions < logical
        index = token_positions.clamp(0, logical - 1).unsqueeze(2).expand(batch, self.kv_heads, queries, tokens)
        looked_up = self.visible.unsqueeze(1).expand(batch, self.kv_heads, queries, logical).gather(-1, index)
        return counted & inside.unsqueeze(2) & looked_up
