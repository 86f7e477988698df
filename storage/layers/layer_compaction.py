"""Compaction of one layer of the paged store: keep chosen tokens per head, free the rest, by
slot reuse (hole fill) or an in-order rewrite; and trimming an arena a compaction or a release
left mostly idle: :class:`LayerCompaction`, a part of :class:`~kvlib.storage.layers.layer_pages.LayerPages`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.errors import PoolExhaustedError
from kvlib.storage.layers.layer_state import LayerState
from kvlib.storage.layers.slot_reuse import HoleFill, hole_fill
from kvlib.storage.pools.page_indexing import first_occurrences, page_coordinates, sorted_keep
from kvlib.storage.pools.page_pool import DEFAULT_PAGES_PER_LAYER, grown

TRIM_BELOW = 0.5
"""A growable arena with less than this share of its pages in use after a compaction or a
release gives the idle part back (:meth:`trim`)."""

Moves = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(batch, head, hole, source)``: a hole fill's moves, each token from slot ``source`` to ``hole``."""


@dataclass
class Compaction:
    """What a :meth:`compact` did, for the store to follow (read mirrors, open pages, trimming)."""

    layout: torch.Tensor
    """int64 ``[batch, kv_heads, k]``: the old slot of each new slot of every head, -1 past its new length."""
    changed: bool
    """Whether any head dropped tokens (else nothing else changed)."""
    reorder: torch.Tensor
    """bool ``[batch, kv_heads]``: heads rewritten in order."""
    moves: Moves | None
    """The hole fills' moves (None when no head could fill holes)."""
    new_lengths: torch.Tensor
    """int64 ``[batch, kv_heads]``: tokens each head holds now."""


class LayerCompaction(LayerState):
    """Compaction of one layer (hole fill or in-order rewrite) and trimming its idle arena."""

    def compact(
        self, rows: torch.Tensor, keep: torch.Tensor, values: torch.Tensor | None, *, reuse_slots: bool, in_given_order: bool = False
    ) -> Compaction:
        """Keep only the stored tokens ``keep`` of each (row, head); free the rest (see
        :meth:`kvlib.storage.store.paged_store.PagedStore.compact` for the arguments and the two ways a head takes).
        ``in_given_order``: the kept tokens take the order ``keep`` gives them (heads whose order
        changes are rewritten in order from their first moved page; see
        :meth:`~kvlib.storage.store.paged_store.PagedStore.arrange`). ``ValueError`` or ``PoolExhaustedError``
        before any change."""
        layer, pool, table = self.layer, self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        kept = sorted_keep(keep, lengths, in_given_order=in_given_order)
        new_lengths = (kept >= 0).sum(-1)
        changed = new_lengths != lengths
        if in_given_order:
            reuse_slots = False
            changed |= ((kept != torch.arange(kept.shape[-1])) & (kept >= 0)).any(-1)
        if values is not None and tuple(values.shape) != (*kept.shape, pool.value_dim):
            raise ValueError(f"values must have shape {[*kept.shape, pool.value_dim]}, got {list(values.shape)}")
        if not bool(changed.any()):
            return Compaction(kept, False, torch.zeros_like(changed), None, new_lengths)
        width = kept.shape[-1]
        slot = torch.arange(width)
        in_place = (kept == slot).long().cumprod(-1).sum(-1)
        if values is not None:  # every kept value of a changed head may differ: rewrite it whole
            in_place = torch.zeros_like(in_place)
        first_page = in_place // page_size
        start = first_page * page_size
        plan = hole_fill(kept, lengths) if reuse_slots and values is None else None
        fill = torch.zeros_like(changed)
        if plan is not None:
            fill = self._fills_holes(rows, plan, changed & (2 * plan.moves <= new_lengths - start), new_lengths)
        reorder = changed & ~fill
        if plan is not None and not bool(reorder.any()):  # a decode step's eviction: holes filled, nothing rewritten
            return self._fill_holes(rows, plan, fill, lengths, new_lengths, kept)
        rewrite = reorder.unsqueeze(-1) & (slot >= start.unsqueeze(-1)) & (slot < new_lengths.unsqueeze(-1))

        old_pages_used, new_pages_used = table.pages_used(lengths), table.pages_used(new_lengths)
        page_slot = torch.arange(table.pages.shape[2])
        below_old = page_slot < old_pages_used.unsqueeze(-1)
        drop_page = reorder.unsqueeze(-1) & (page_slot >= first_page.unsqueeze(-1)) & below_old
        drop_page |= fill.unsqueeze(-1) & (page_slot >= new_pages_used.unsqueeze(-1)) & below_old
        dropped = table.pages[rows][drop_page]
        new_page_counts = torch.where(reorder, new_pages_used - first_page, 0).flatten()
        needed = int(new_page_counts.sum())
        unique, counts = torch.unique(dropped, return_counts=True)
        freed = int((pool.refcount[unique] == counts).sum())
        if not pool.can_allocate(needed - freed):
            raise PoolExhaustedError(f"layer {layer}: compaction needs {needed} pages, {pool.free_pages + freed} free")

        source = table.flat_slots(rows, kept.clamp(min=0))[rewrite]
        moved_keys, moved_values, moved_positions = pool.gather(source)
        if values is not None:
            moved_values = values.to(pool.device, pool.dtype)[rewrite.to(values.device)]
        moves = plan.only(fill) if plan is not None else None
        if moves is not None and moves[0].numel():
            b, h, hole, src = moves
            holes = table.pages[rows[b], h, hole // page_size] * page_size + hole % page_size
            filled = pool.gather(table.pages[rows[b], h, src // page_size] * page_size + src % page_size)
        pool.decref(dropped)
        b, h, j = drop_page.nonzero(as_tuple=True)
        table.pages[rows[b], h, j] = -1
        if needed:
            b, h, j = page_coordinates(first_page, new_page_counts, lengths.shape[1])
            table.pages[rows[b], h, j] = pool.allocate(needed, h)
        target = table.flat_slots(rows, torch.where(rewrite, slot, 0))[rewrite]
        pool.write(target, moved_keys, moved_values, moved_positions)
        if moves is not None and moves[0].numel():
            pool.write(holes, *filled)
        table.lengths[rows] = new_lengths
        sealed = table.sealed[rows]
        sealed = torch.where(reorder, sealed.clamp(max=first_page), sealed)
        table.sealed[rows] = torch.where(fill, torch.minimum(sealed, new_lengths // page_size), sealed)
        if pool.summaries is not None and bool(fill.any()):
            self._resummarize_filled_pages(rows, fill, moves)
        layout = kept if plan is None else torch.where(fill.unsqueeze(-1), plan.layout, kept)
        return Compaction(layout, True, reorder, moves, new_lengths)

    def _fill_holes(
        self, rows: torch.Tensor, plan: HoleFill, fill: torch.Tensor, lengths: torch.Tensor, new_lengths: torch.Tensor, kept: torch.Tensor
    ) -> Compaction:
        """:meth:`compact` when every changed head (``fill``) fills its holes: the moved tokens are
        written into the holes, pages past each head's new length are released, nothing is
        allocated or rewritten in order (what a decode step's eviction costs: a few small ops)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        moves = plan.only(fill)
        b, h, hole, src = moves
        if b.numel():
            holes = table.pages[rows[b], h, hole // page_size] * page_size + hole % page_size
            sources = table.pages[rows[b], h, src // page_size] * page_size + src % page_size
            pool.write(holes, *pool.gather(sources))
        page_slot = torch.arange(table.pages.shape[2])
        drop_page = (
            fill.unsqueeze(-1)
            & (page_slot >= table.pages_used(new_lengths).unsqueeze(-1))
            & (page_slot < table.pages_used(lengths).unsqueeze(-1))
        )
        db, dh, dj = drop_page.nonzero(as_tuple=True)
        if db.numel():
            pool.decref(table.pages[rows[db], dh, dj])
            table.pages[rows[db], dh, dj] = -1
        table.lengths[rows] = new_lengths
        sealed = table.sealed[rows]
        table.sealed[rows] = torch.where(fill, torch.minimum(sealed, new_lengths // page_size), sealed)
        if pool.summaries is not None:
            self._resummarize_filled_pages(rows, fill, moves)
        return Compaction(torch.where(fill.unsqueeze(-1), plan.layout, kept), True, torch.zeros_like(fill), moves, new_lengths)

    def _fills_holes(self, rows: torch.Tensor, plan: HoleFill, cheap: torch.Tensor, new_lengths: torch.Tensor) -> torch.Tensor:
        """bool ``[batch, heads]``: the heads among ``cheap`` whose hole fill writes only pages
        writable in place (the holes' pages, and the new last page if it is partly kept: a
        truncated page is rewritten by later appends and its key summary redone)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        fill = cheap.clone()
        b, h, hole, _ = plan.only(cheap)
        if b.numel():
            blocked = ~pool.writable(table.pages[rows[b], h, hole // page_size])
            fill[b[blocked], h[blocked]] = False
        b, h = (fill & (new_lengths % page_size != 0)).nonzero(as_tuple=True)
        if b.numel():
            blocked = ~pool.writable(table.pages[rows[b], h, new_lengths[b, h] // page_size])
            fill[b[blocked], h[blocked]] = False
        return fill

    def _resummarize_filled_pages(self, rows: torch.Tensor, fill: torch.Tensor, moves: Moves) -> None:
        """Recompute the key summaries of the pages a hole fill wrote or cut short (heads ``fill``):
        each summary then covers only the tokens its page still holds."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        b, h, hole, _ = moves
        page = hole // page_size
        lb, lh = (fill & (lengths % page_size != 0)).nonzero(as_tuple=True)
        b, h, page = torch.cat([b, lb]), torch.cat([h, lh]), torch.cat([page, lengths[lb, lh] // page_size])
        ids, first = first_occurrences(table.pages[rows[b], h, page])
        if ids.numel() == 0:
            return
        held = (lengths[b, h] - page * page_size).clamp(max=page_size)[first]
        keys, _ = pool.read_pages(ids)
        pool.summaries.recompute(ids, keys, held)

    def trim(self) -> bool:
        """Give back a layer's idle arena memory when less than :data:`TRIM_BELOW` of it is in use:
        pages in use at or past the new capacity (:func:`~kvlib.storage.pools.page_pool.grown` of the
        pages in use) move to free pages below it, ``table`` follows, and the arena is cut there.
        Nothing happens for pools that do not shrink (fixed, coded, tiered) or when something
        besides ``table`` (a prefix index) holds pages of the pool, whose ids must stay. Returns
        whether pages moved."""
        pool, table = self.pool, self.table
        used = pool.pages_in_use
        if not pool.shrinks or pool.capacity <= DEFAULT_PAGES_PER_LAYER or used >= pool.capacity * TRIM_BELOW:
            return False
        held_by_tables = torch.bincount(table.pages[table.pages >= 0], minlength=pool.capacity)
        if not torch.equal(held_by_tables, pool.refcount):
            return False
        capacity = max(grown(used), DEFAULT_PAGES_PER_LAYER)
        held = (pool.refcount > 0).nonzero().squeeze(-1)
        source = held[held >= capacity]
        target = (pool.refcount[:capacity] == 0).nonzero().squeeze(-1)[: source.numel()]
        pool.relocate(source, target)
        moved = torch.arange(pool.capacity)
        moved[source] = target
        table.pages = torch.where(table.pages >= 0, moved[table.pages.clamp(min=0)], -1)
        pool.shrink(capacity)
        return True
