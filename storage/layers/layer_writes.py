"""Writes to one layer of the paged store: appends (copy-on-write of a shared open page, new
pages as heads fill theirs), the append fast path into known open slots, and overwrites of
stored tokens; with the validation of a step's tensors and positions (:class:`LayerWrites`, a
part of :class:`~kvlib.storage.layers.layer_pages.LayerPages`)."""

from __future__ import annotations

import torch

from kvlib.devices import check_tensor, to_arena_device
from kvlib.errors import PoolExhaustedError
from kvlib.storage.layers.layer_state import LayerState
from kvlib.storage.layers.open_pages import OpenPages
from kvlib.storage.pools.page_indexing import heads_to_copy, page_coordinates


class LayerWrites(LayerState):
    """Appends, the open-page fast path, room for planned steps and overwrites of one layer."""

    def check_step(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int]:
        """``(batch, kv_heads, tokens)`` of a step's ``keys`` and ``values`` for ``rows``, once they
        have the pool's dtype, device and shapes; else ``ValueError``."""
        layer, pool = self.layer, self.pool
        heads = self.table.num_heads
        check_tensor("keys", keys, pool.dtype, pool.device)
        check_tensor("values", values, pool.dtype, pool.device)
        expect_k = (len(rows), heads, keys.shape[2] if keys.dim() == 4 else -1, pool.head_dim)
        if keys.dim() != 4 or tuple(keys.shape) != expect_k:
            raise ValueError(
                f"layer {layer}: keys must be [batch={len(rows)}, kv_heads={heads}, tokens, head_dim={pool.head_dim}], got {list(keys.shape)}"
            )
        expect_v = (*expect_k[:3], pool.value_dim)
        if values.dim() != 4 or tuple(values.shape) != expect_v:
            raise ValueError(f"layer {layer}: values must be {list(expect_v)}, got {list(values.shape)}")
        return len(rows), heads, keys.shape[2]

    def step_positions(
        self, rows: torch.Tensor, positions: torch.Tensor | None, *, heads: int, steps: int, device: torch.device
    ) -> torch.Tensor:
        """Positions of a step as int64 ``[batch, heads, steps]`` on ``device``: ``positions`` (int
        ``[batch, steps]`` or ``[steps]``), by default continuing from each row's logical length."""
        batch = len(rows)
        if positions is None:
            positions = self.table.logical[rows].unsqueeze(-1) + torch.arange(steps)
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError("positions must be an integer tensor of shape [batch, tokens] or [tokens]")
        if positions.dim() == 1 and positions.shape[0] == steps:
            positions = positions.unsqueeze(0).expand(batch, steps)
        if tuple(positions.shape) != (batch, steps):
            raise ValueError(f"positions must have shape [{batch}, {steps}] or [{steps}], got {list(positions.shape)}")
        return positions.to(device, torch.int64).unsqueeze(1).expand(batch, heads, steps)

    def make_room(self, rows: torch.Tensor, steps: int | torch.Tensor) -> None:
        """Give every head of ``rows`` room for ``steps`` more tokens (an int, or int64 ``[batch,
        kv_heads]``) in pages it alone holds, lengths unchanged: a partly filled last page shared with
        another sequence is copied first (copy-on-write), heads that would fill their last page get
        new ones. ``PoolExhaustedError`` before any change when a fixed pool lacks the pages."""
        layer, pool, table = self.layer, self.pool, self.table
        page_size = pool.page_size
        heads = table.num_heads
        lengths = table.lengths[rows]
        have, need = table.pages_used(lengths), table.pages_used(lengths + steps)
        open_index = lengths // page_size
        is_open = lengths % page_size != 0
        if isinstance(steps, torch.Tensor):
            is_open &= steps > 0
        open_pages = table.pages[rows].gather(2, torch.where(is_open, open_index, 0).unsqueeze(-1)).squeeze(-1)
        shared = is_open.clone()
        shared[is_open] = pool.refcount[open_pages[is_open]] > 1
        b, h = heads_to_copy(pool, open_pages, shared)
        new_page_counts = (need - have).flatten()
        copies = b.numel()
        fresh = int(new_page_counts.sum())
        if not pool.can_allocate(copies + fresh):
            raise PoolExhaustedError(f"layer {layer}: append needs {copies + fresh} pages, {pool.free_pages} free")
        table.ensure_pages(int(need.max()))
        if copies:
            copied = pool.allocate(copies, h)
            pool.copy_pages(open_pages[b, h], copied)
            pool.decref(open_pages[b, h])
            table.pages[rows[b], h, open_index[b, h]] = copied
        if fresh:
            b, h, j = page_coordinates(have, new_page_counts, heads)
            table.pages[rows[b], h, j] = pool.allocate(fresh, h)

    def append(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append a step (``keys [batch, kv_heads, steps, head_dim]``, ``values``, ``positions``
        int64 ``[batch, kv_heads, steps]``) to every head of ``rows``, after :meth:`make_room` for it.
        ``PoolExhaustedError`` before any change when a fixed pool lacks the pages."""
        pool, table = self.pool, self.table
        steps = keys.shape[2]
        self.make_room(rows, steps)
        lengths = table.lengths[rows]
        token_index = lengths.unsqueeze(-1) + torch.arange(steps)
        slots = table.flat_slots(rows, token_index)
        pool.write(slots.flatten(), keys.reshape(-1, pool.head_dim), values.reshape(-1, pool.value_dim), positions.reshape(-1))
        table.lengths[rows] = lengths + steps
        table.logical[rows] += steps

    def append_in_open_pages(self, rows: torch.Tensor, open_pages: OpenPages, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Append a step where ``open_pages`` says it goes (every head's open page has room and is
        this batch's own: a write at known slots plus length updates, no allocation, no copy).
        Returns the step's positions, int64 ``[batch, kv_heads, steps]``."""
        pool, table = self.pool, self.table
        steps = keys.shape[2]
        slots, positions = open_pages.take(steps, cpu=pool.writes_cpu_slots)
        pool.write(slots.reshape(-1), keys.reshape(-1, pool.head_dim), values.reshape(-1, pool.value_dim), positions.reshape(-1))
        if open_pages.row_range is not None:
            first, end = open_pages.row_range
            table.lengths[first:end] += steps
            table.logical[first:end] += steps
        else:
            table.lengths[rows] += steps
            table.logical[rows] += steps
        return positions

    def overwrite(self, rows: torch.Tensor, token_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the keys and values of stored tokens ``token_index`` (int ``[tokens]``, the same
        slots in every head, each below every head's length) of ``rows``; positions stay. The pages
        written must be writable in place (:meth:`~kvlib.storage.pools.page_pool.PagePool.writable`: held
        by these rows alone, not sealed); else ``ValueError`` and nothing changes."""
        pool, table = self.pool, self.table
        batch, heads, steps = keys.shape[:3]
        index = torch.as_tensor(token_index, dtype=torch.int64).cpu()
        if index.dim() != 1 or index.numel() != steps:
            raise ValueError(f"token_index must be [tokens={steps}], got {list(index.shape)}")
        if steps and bool(((index < 0) | (index >= table.lengths[rows].min())).any()):
            raise ValueError("token_index must name stored tokens of every head")
        slots = table.flat_slots(rows, index.expand(batch, heads, steps))
        pages = torch.unique(slots // pool.page_size)
        if not bool(pool.writable(pages).all()):
            raise ValueError("overwrite needs pages held by these sequences alone and not sealed")
        positions = pool.positions.view(-1)[to_arena_device(slots.flatten(), pool.device)]
        pool.write(slots.flatten(), keys.reshape(-1, pool.head_dim), values.reshape(-1, pool.value_dim), positions)
