"""Reads of one layer of the paged store: whole heads or chosen pages in dense form, stored
positions, page selections for attention over the pages, key summaries. Nothing here changes
the pool or the block table: :class:`LayerReads`, a part of :class:`~kvlib.storage.layers.layer_pages.LayerPages`."""

from __future__ import annotations

import torch

from kvlib.devices import to_arena_device
from kvlib.storage.layers.layer_state import LayerState
from kvlib.storage.layers.read_cache import LayerRead


class LayerReads(LayerState):
    """Reads of one layer: dense, positional and sparse, page selections, key bounds, page scores."""

    def gather(self, rows: torch.Tensor, size: int) -> LayerRead:
        """Gather ``rows`` from the pages into fresh dense tensors with ``size`` slots per head.

        Whole pages are gathered (one ``index_select`` of contiguous page rows per tensor); slots
        past each head's length are then zeroed and marked invalid.
        """
        pool, table = self.pool, self.table
        page_size, device = pool.page_size, pool.device
        lengths = table.lengths[rows]
        batch, heads = lengths.shape
        valid = torch.arange(size) < lengths.unsqueeze(-1)
        if pool.pages_in_use == 0:  # nothing stored: no page to gather from
            return LayerRead(
                torch.zeros(batch, heads, size, pool.head_dim, dtype=pool.dtype, device=device),
                torch.zeros(batch, heads, size, pool.value_dim, dtype=pool.dtype, device=device),
                torch.full((batch, heads, size), -1, dtype=torch.int64, device=device),
                valid.to(device),
            )
        pages = -(-size // page_size)
        page_ids = table.pages[rows][:, :, :pages]
        if page_ids.shape[2] < pages:
            page_ids = torch.nn.functional.pad(page_ids, (0, pages - page_ids.shape[2]), value=-1)
        ids = page_ids.clamp(min=0).flatten()
        slots = pages * page_size
        keys, values = pool.read_pages(ids)
        keys = keys.view(batch, heads, slots, pool.head_dim)[:, :, :size]
        values = values.view(batch, heads, slots, pool.value_dim)[:, :, :size]
        positions = pool.positions.index_select(0, to_arena_device(ids, device)).view(batch, heads, slots)[:, :, :size]
        if not bool(valid.all()):
            invalid = to_arena_device(~valid, device)
            keys.masked_fill_(invalid.unsqueeze(-1), 0)
            values.masked_fill_(invalid.unsqueeze(-1), 0)
            positions.masked_fill_(invalid, -1)
        return LayerRead(keys, values, positions, to_arena_device(valid, device))

    def read_positions(self, rows: torch.Tensor) -> LayerRead:
        """``rows``' stored tokens as :meth:`gather` lays them out for their longest head, without
        keys and values: ``keys`` and ``values`` have no channels (``[batch, kv_heads, slots, 0]``)."""
        pool, table = self.pool, self.table
        page_size, device = pool.page_size, pool.device
        lengths = table.lengths[rows]
        batch, heads = lengths.shape
        size = int(lengths.max()) if lengths.numel() else 0
        pages = -(-size // page_size)
        ids = table.pages[rows][:, :, :pages].clamp(min=0).flatten()
        positions = pool.positions.index_select(0, to_arena_device(ids, device)).view(batch, heads, pages * page_size)[:, :, :size]
        valid = to_arena_device(torch.arange(size) < lengths.unsqueeze(-1), device)
        empty = torch.empty(batch, heads, size, 0, dtype=pool.dtype, device=device)
        return LayerRead(empty, empty, positions.masked_fill(~valid, -1), valid)

    def stored_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions of the stored tokens of ``rows``: int64 ``[batch, heads, longest]`` on the CPU,
        -1 past each head's length (read from the arena without touching keys or values)."""
        pool, table = self.pool, self.table
        lengths = table.lengths[rows]
        longest = int(lengths.max()) if lengths.numel() else 0
        token_index = torch.arange(longest).expand(*lengths.shape, longest)
        stored = token_index < lengths.unsqueeze(-1)
        slots = torch.where(stored, table.flat_slots(rows, token_index), 0)
        flat = pool.positions.view(-1)
        positions = flat[to_arena_device(slots, pool.device)].cpu() if longest else slots
        return torch.where(stored, positions, -1)

    def check_selection(self, lengths: torch.Tensor, page_index: torch.Tensor) -> torch.Tensor:
        """``page_index`` on the CPU, once it names, per (sequence, head) of ``lengths [batch,
        kv_heads]``, pages the head holds or -1; else ``ValueError``."""
        table = self.table
        batch, heads = lengths.shape
        if page_index.dim() != 3 or tuple(page_index.shape[:2]) != (batch, heads):
            raise ValueError(f"page_index must be [batch={batch}, kv_heads={heads}, k], got {list(page_index.shape)}")
        page_index = page_index.cpu()
        if bool(((page_index < -1) | (page_index >= table.pages_used(lengths).unsqueeze(-1))).any()):
            raise ValueError("page_index must name pages each head holds (0 <= j < pages used) or be -1")
        return page_index

    def selected_pages(self, rows: torch.Tensor, page_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table of a selection (``page_index`` as for :meth:`read_selected`): page ids
        int64 ``[batch, kv_heads, k]`` in block-table order (``-1`` past each head's chosen pages, so
        a chosen partly filled last page comes last) and the tokens they hold, int64 ``[batch, kv_heads]``."""
        table = self.table
        lengths = table.lengths[rows]
        page_index = self.check_selection(lengths, page_index)
        past_end = torch.iinfo(torch.int64).max
        ordered = torch.where(page_index < 0, past_end, page_index).sort(-1).values
        chosen = ordered != past_end
        index = torch.where(chosen, ordered, 0)
        pages = torch.where(chosen, table.pages[rows].gather(2, index), -1)
        filled = torch.where(chosen, (lengths.unsqueeze(-1) - index * table.page_size).clamp(0, table.page_size), 0)
        return pages, filled.sum(-1)

    def read_selected(self, rows: torch.Tensor, page_index: torch.Tensor) -> LayerRead:
        """Only the chosen pages of each (sequence, head) of ``rows``, in dense form: a sparse read.

        ``page_index`` int64 ``[batch, kv_heads, k]`` names pages by their index in each head's block
        table (``0 <= j < pages used``), ``-1`` for none. Page ``i`` of the selection fills slots
        ``[i * page_size, (i + 1) * page_size)``; slots past the head's length or of a ``-1`` entry
        are zero and invalid, and trailing slots invalid in every head are left out. Only the chosen
        pages are read; nothing moves or changes.
        """
        pool, table = self.pool, self.table
        page_size, device, dtype = pool.page_size, pool.device, pool.dtype
        lengths = table.lengths[rows]
        batch, heads = lengths.shape
        page_index = self.check_selection(lengths, page_index)
        chosen = page_index >= 0
        ids = table.pages[rows].gather(2, page_index.clamp(min=0))[chosen]
        size = page_index.shape[2] * page_size
        slot = page_index.clamp(min=0).unsqueeze(-1) * page_size + torch.arange(page_size)
        valid = (chosen.unsqueeze(-1) & (slot < lengths.view(batch, heads, 1, 1))).view(batch, heads, size)
        keys = torch.zeros(batch, heads, page_index.shape[2], page_size, pool.head_dim, dtype=dtype, device=device)
        values = torch.zeros(batch, heads, page_index.shape[2], page_size, pool.value_dim, dtype=dtype, device=device)
        positions = torch.full((batch, heads, page_index.shape[2], page_size), -1, dtype=torch.int64, device=device)
        if ids.numel():
            where = to_arena_device(chosen.flatten().nonzero().squeeze(-1), device)
            page_keys, page_values = pool.read_pages(ids)
            keys.view(-1, page_size, pool.head_dim).index_copy_(0, where, page_keys)
            values.view(-1, page_size, pool.value_dim).index_copy_(0, where, page_values)
            positions.view(-1, page_size).index_copy_(0, where, pool.positions.index_select(0, to_arena_device(ids, device)))
        held = valid.flatten(0, 1).any(0).nonzero()
        extent = int(held.max()) + 1 if held.numel() else 0  # trailing slots no head holds are left out
        invalid = to_arena_device(~valid, device)
        keys, values, positions = (
            keys.view(batch, heads, size, -1).masked_fill_(invalid.unsqueeze(-1), 0)[:, :, :extent],
            values.view(batch, heads, size, -1).masked_fill_(invalid.unsqueeze(-1), 0)[:, :, :extent],
            positions.view(batch, heads, size).masked_fill_(invalid, -1)[:, :, :extent],
        )
        return LayerRead(keys, values, positions, to_arena_device(valid[:, :, :extent], device))

    def key_bounds(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key summaries of every page of ``rows``, in block-table order: ``(key_min, key_max)``,
        each ``[batch, kv_heads, pages, head_dim]`` on the pool's device (entries past a head's
        ``pages_used`` are meaningless), and ``pages_used`` int64 ``[batch, kv_heads]`` on the CPU.
        ``ValueError`` for a pool without key summaries."""
        pool, table = self.pool, self.table
        summaries = pool.summaries
        if summaries is None:
            raise ValueError("key_bounds needs a store made with key_summaries=True")
        pages_used = table.pages_used(table.lengths[rows])
        width = int(pages_used.max()) if pages_used.numel() else 0
        ids = to_arena_device(table.pages[rows][:, :, :width].clamp(min=0), pool.device)
        return summaries.key_min[ids], summaries.key_max[ids], pages_used

    def page_scores(self, rows: torch.Tensor, token_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Placement scores of the pages of ``rows`` from ``token_scores`` (float ``[batch, kv_heads,
        slots]``, aligned with :meth:`gather`'s slots; ``-inf`` for tokens that should not count): a
        page scores its best stored token. Returns ``(page ids, scores)``, one entry per block-table
        reference (a page shared by several heads appears once for each); ``ValueError`` for scores
        of the wrong shape."""
        table = self.table
        page_size = table.page_size
        lengths = table.lengths[rows]
        if token_scores.dim() != 3 or tuple(token_scores.shape[:2]) != tuple(lengths.shape) or token_scores.shape[2] < int(lengths.max()):
            raise ValueError(f"token_scores must be [batch, kv_heads, >= {int(lengths.max())} slots], got {list(token_scores.shape)}")
        pages = int(table.pages_used(lengths).max())
        slots = pages * page_size
        scores = token_scores.float().cpu()[:, :, :slots]
        scores = torch.nn.functional.pad(scores, (0, slots - scores.shape[2]), value=float("-inf"))
        scores = scores.masked_fill(torch.arange(slots) >= lengths.unsqueeze(-1), float("-inf"))
        ids = table.pages[rows][:, :, :pages]
        held = ids >= 0
        return ids[held], scores.view(*lengths.shape, pages, page_size).amax(-1)[held]
