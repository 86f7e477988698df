"""One layer of the paged store as one object: :class:`LayerPages`.

It owns the layer's pool (page arenas of keys, values and each stored token's original
position, on one or more tiers), its block table (per sequence row and KV head: page ids,
stored and logical lengths, pages considered for sealing) and where the last append's batch
writes next; its methods are the store's operations on one layer: writes (appends,
copy-on-write, room for planned steps, overwrites), reads (dense, positional and sparse, page
selections, key bounds, page scores), compaction (hole fill or in-order rewrite) and trimming,
truncation, sealing, and the rows' references (prefix pages, forks, releases). A
:class:`~kvlib.storage.store.paged_store.PagedStore` holds one per layer and adds what spans layers
(sequence ids, read caches, step plans, prefetch, memory accounting).

Invariants: every block-table entry ``>= 0`` names a page in use in ``pool``, and a page's
reference count is at least the number of entries naming it (more where a prefix index or
another holder keeps it); the methods take block-table rows (int64 ``[batch]``, validated by the
store) and leave the layer unchanged when they raise; only :meth:`LayerPages.seal` reads another
layer (its partner's table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvlib.devices import check_tensor, to_arena_device
from kvlib.errors import PoolExhaustedError
from kvlib.storage.layers.block_table import BlockTable
from kvlib.storage.layers.open_pages import OpenPages
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.layers.slot_reuse import HoleFill, hole_fill
from kvlib.storage.pools.page_indexing import first_occurrences, heads_to_copy, page_coordinates, sorted_keep
from kvlib.storage.pools.page_pool import DEFAULT_PAGES_PER_LAYER, PagePool, grown

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


class LayerPages:
    """One layer's ``pool``, block ``table`` and ``open_pages`` (``layer`` is its index, for
    messages), with the store's operations on them."""

    def __init__(self, layer: int, pool: PagePool, table: BlockTable) -> None:
        self.layer = layer
        self.pool = pool
        self.table = table
        self.open_pages: OpenPages | None = None
        """Where the last append's batch writes next (None: the next append takes the general path)."""

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.pool.page_size

    # -- writes -------------------------------------------------------------------------

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

    def make_room(self, rows: torch.Tensor, steps: int | np.ndarray) -> None:
        """Give every head of ``rows`` room for ``steps`` more tokens (an int, or int64 ``[batch,
        kv_heads]``) in pages it alone holds, lengths unchanged: a partly filled last page shared with
        another sequence is copied first (copy-on-write), heads that would fill their last page get
        new ones. ``PoolExhaustedError`` before any change when a fixed pool lacks the pages.
        The block table is read and written through its numpy views."""
        layer, pool, table = self.layer, self.pool, self.table
        page_size = pool.page_size
        rows_np = rows.numpy()
        lengths = table.lengths_np[rows_np]
        have, need = table.pages_used(lengths), table.pages_used(lengths + steps)
        open_index = lengths // page_size
        is_open = (lengths % page_size != 0) & (np.asarray(steps) > 0)
        open_pages = np.take_along_axis(table.pages_np[rows_np], np.where(is_open, open_index, 0)[..., None], 2)[..., 0]
        refcount = pool.refcount.numpy()
        shared = is_open.copy()
        shared[is_open] = refcount[open_pages[is_open]] > 1
        b, h = heads_to_copy(refcount, open_pages, shared)
        new_page_counts = (need - have).reshape(-1)
        copies = b.size
        fresh = int(new_page_counts.sum())
        if not pool.can_allocate(copies + fresh):
            raise PoolExhaustedError(f"layer {layer}: append needs {copies + fresh} pages, {pool.free_pages} free")
        table.ensure_pages(int(need.max()))
        if copies:
            source = torch.from_numpy(open_pages[b, h])
            copied = pool.allocate(copies, torch.from_numpy(h))
            pool.copy_pages(source, copied)
            pool.decref(source)
            table.pages_np[rows_np[b], h, open_index[b, h]] = copied.numpy()
        if fresh:
            b, h, j = page_coordinates(have, new_page_counts, table.num_heads)
            table.pages_np[rows_np[b], h, j] = pool.allocate(fresh, torch.from_numpy(h)).numpy()

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

    # -- reads --------------------------------------------------------------------------

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

    # -- compaction and trimming --------------------------------------------------------

    def compact(
        self, rows: torch.Tensor, keep: torch.Tensor, values: torch.Tensor | None, *, reuse_slots: bool, in_given_order: bool = False
    ) -> Compaction:
        """Keep only the stored tokens ``keep`` of each (row, head); free the rest (see
        :meth:`kvlib.storage.store.paged_store.PagedStore.compact` for the arguments and the two ways a head takes).
        ``in_given_order``: the kept tokens take the order ``keep`` gives them (heads whose order
        changes are rewritten in order from their first moved page; see
        :meth:`~kvlib.storage.store.paged_store.PagedStore.arrange`). ``ValueError`` or ``PoolExhaustedError``
        before any change. The bookkeeping runs on the block table's numpy views; the pool
        (reference counts, arenas) takes torch tensors."""
        layer, pool, table = self.layer, self.pool, self.table
        page_size = pool.page_size
        rows_np = rows.numpy()
        lengths = table.lengths_np[rows_np]
        kept = sorted_keep(keep, lengths, in_given_order=in_given_order)
        new_lengths = (kept >= 0).sum(-1)
        changed = new_lengths != lengths
        width = kept.shape[-1]
        slot = np.arange(width)
        if in_given_order:
            reuse_slots = False
            changed |= ((kept != slot) & (kept >= 0)).any(-1)
        if values is not None and tuple(values.shape) != (*kept.shape, pool.value_dim):
            raise ValueError(f"values must have shape {[*kept.shape, pool.value_dim]}, got {list(values.shape)}")
        if not changed.any():
            return Compaction(
                torch.from_numpy(kept), False, torch.zeros(changed.shape, dtype=torch.bool), None, torch.from_numpy(new_lengths)
            )
        in_place = np.cumprod(kept == slot, axis=-1).sum(-1)
        if values is not None:  # every kept value of a changed head may differ: rewrite it whole
            in_place = np.zeros_like(in_place)
        first_page = in_place // page_size
        start = first_page * page_size
        plan = hole_fill(kept, lengths) if reuse_slots and values is None else None
        fill = np.zeros_like(changed)
        if plan is not None:
            fill = self._fills_holes(rows_np, plan, changed & (2 * plan.moves <= new_lengths - start), new_lengths)
        reorder = changed & ~fill
        moves = plan.only(fill) if plan is not None else None
        rewrite = reorder[..., None] & (slot >= start[..., None]) & (slot < new_lengths[..., None])
        page_slot = np.arange(table.pages_np.shape[2])
        new_pages_used = table.pages_used(new_lengths)
        below_old = page_slot < table.pages_used(lengths)[..., None]
        drop_page = reorder[..., None] & (page_slot >= first_page[..., None]) & below_old
        drop_page |= fill[..., None] & (page_slot >= new_pages_used[..., None]) & below_old
        dropped = table.pages_np[rows_np][drop_page]
        new_page_counts = np.where(reorder, new_pages_used - first_page, 0).reshape(-1)
        needed = int(new_page_counts.sum())
        if needed:
            unique, counts = np.unique(dropped, return_counts=True)
            freed = int((pool.refcount.numpy()[unique] == counts).sum())
            if not pool.can_allocate(needed - freed):
                raise PoolExhaustedError(f"layer {layer}: compaction needs {needed} pages, {pool.free_pages + freed} free")

        rewritten = rewrite.any()  # False for a decode step's eviction: holes filled, nothing rewritten
        if rewritten:
            moved_keys, moved_values, moved_positions = pool.gather(torch.from_numpy(self._slots(rows_np, kept.clip(min=0))[rewrite]))
            if values is not None:
                moved_values = values.to(pool.device, pool.dtype)[torch.from_numpy(rewrite).to(values.device)]
        if moves is not None and moves[0].size:  # before any page is released (a source may lie in one)
            b, h, hole, src = moves
            holes = table.pages_np[rows_np[b], h, hole // page_size] * page_size + hole % page_size
            sources = table.pages_np[rows_np[b], h, src // page_size] * page_size + src % page_size
            pool.write(torch.from_numpy(holes), *pool.gather(torch.from_numpy(sources)))
        if dropped.size:
            pool.decref(torch.from_numpy(dropped))
            b, h, j = np.nonzero(drop_page)
            table.pages_np[rows_np[b], h, j] = -1
        if needed:
            b, h, j = page_coordinates(first_page, new_page_counts, table.num_heads)
            table.pages_np[rows_np[b], h, j] = pool.allocate(needed, torch.from_numpy(h)).numpy()
        if rewritten:
            target = self._slots(rows_np, np.where(rewrite, slot, 0))[rewrite]
            pool.write(torch.from_numpy(target), moved_keys, moved_values, moved_positions)
        table.lengths_np[rows_np] = new_lengths
        sealed = table.sealed_np[rows_np]
        sealed = np.where(reorder, np.minimum(sealed, first_page), sealed)
        table.sealed_np[rows_np] = np.where(fill, np.minimum(sealed, new_lengths // page_size), sealed)
        moved = None if moves is None else tuple(torch.from_numpy(part) for part in moves)
        if pool.summaries is not None and fill.any():
            self._resummarize_filled_pages(rows, torch.from_numpy(fill), moved)
        layout = kept if plan is None else np.where(fill[..., None], plan.layout, kept)
        return Compaction(torch.from_numpy(layout), True, torch.from_numpy(reorder), moved, torch.from_numpy(new_lengths))

    def _fills_holes(self, rows: np.ndarray, plan: HoleFill, cheap: np.ndarray, new_lengths: np.ndarray) -> np.ndarray:
        """bool ``[batch, heads]``: the heads among ``cheap`` whose hole fill writes only pages
        writable in place (the holes' pages, and the new last page if it is partly kept: a
        truncated page is rewritten by later appends and its key summary redone)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        fill = cheap.copy()
        b, h, hole, _ = plan.only(cheap)
        if b.size:
            blocked = ~pool.writable(torch.from_numpy(table.pages_np[rows[b], h, hole // page_size])).numpy()
            fill[b[blocked], h[blocked]] = False
        b, h = np.nonzero(fill & (new_lengths % page_size != 0))
        if b.size:
            blocked = ~pool.writable(torch.from_numpy(table.pages_np[rows[b], h, new_lengths[b, h] // page_size])).numpy()
            fill[b[blocked], h[blocked]] = False
        return fill

    def _slots(self, rows: np.ndarray, token_index: np.ndarray) -> np.ndarray:
        """Arena slots of tokens ``token_index [batch, heads, tokens]`` of ``rows`` (as
        :meth:`~kvlib.storage.layers.block_table.BlockTable.flat_slots`, on the numpy views)."""
        page_size = self.pool.page_size
        page_ids = np.take_along_axis(self.table.pages_np[rows], token_index // page_size, 2)
        return page_ids * page_size + token_index % page_size

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

    # -- truncation ---------------------------------------------------------------------

    def truncate(self, rows: torch.Tensor, length: int | torch.Tensor) -> torch.Tensor:
        """Forget every stored token of ``rows`` whose position is ``>= length`` and cap their logical
        lengths at ``length`` (an int for every row, or int64 ``[batch]``, one per row); returns the
        new stored lengths, int64 ``[batch, kv_heads]``.

        The tokens dropped must be a suffix of each head; otherwise ``ValueError`` and nothing
        changes (as when a fixed pool lacks the pages to reopen: ``PoolExhaustedError``). No token
        moves: pages past the new end are released, a partly kept page stays as it is unless the
        pool reopens it (:meth:`_pages_to_reopen`).
        """
        layer, pool, table = self.layer, self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        positions = self.stored_positions(rows)
        slot = torch.arange(positions.shape[-1])
        stored = slot < lengths.unsqueeze(-1)
        limit = length if isinstance(length, int) else length.view(-1, 1, 1)
        kept = stored & (positions < limit)
        new_lengths = kept.sum(-1)
        if not bool((kept == (slot < new_lengths.unsqueeze(-1))).all()):
            shown = length if isinstance(length, int) else length.tolist()
            raise ValueError(f"layer {layer}: tokens at positions >= {shown} are not a suffix of every head")
        page_slot = torch.arange(table.pages.shape[2])
        drop = (page_slot >= table.pages_used(new_lengths).unsqueeze(-1)) & (page_slot < table.pages_used(lengths).unsqueeze(-1))
        dropped = table.pages[rows][drop]
        reopen = self._pages_to_reopen(rows, new_lengths)
        if reopen is not None:
            unique, counts = torch.unique(dropped, return_counts=True)
            freed = int((pool.refcount[unique] == counts).sum())
            if not pool.can_allocate(int(reopen.sum()) - freed):
                raise PoolExhaustedError(
                    f"layer {layer}: truncation needs {int(reopen.sum())} pages to reopen, {pool.free_pages + freed} free"
                )
        pool.decref(dropped)
        b, h, j = drop.nonzero(as_tuple=True)
        table.pages[rows[b], h, j] = -1
        table.lengths[rows] = new_lengths
        table.logical[rows] = (
            table.logical[rows].clamp(max=length) if isinstance(length, int) else torch.minimum(table.logical[rows], length)
        )
        table.sealed[rows] = table.sealed[rows].clamp(max=new_lengths // page_size)
        if reopen is not None:
            self._reopen(rows, reopen)
        if pool.summaries is not None:
            self._resummarize_last_pages(rows, new_lengths != lengths)
        return new_lengths

    def _pages_to_reopen(self, rows: torch.Tensor, new_lengths: torch.Tensor) -> torch.Tensor | None:
        """bool ``[batch, heads]``: heads a truncation to ``new_lengths`` leaves in the middle of a
        page the pool may not write in place (sealed or shared), for a pool that reopens such pages
        (:attr:`~kvlib.storage.pools.page_pool.PagePool.reopens_partial_pages`; else None). Such a head
        gets an open, private copy of that page, so that appends can write after it, a sharer for
        which the page is still full may seal it without sealing a partial page, and the copy's key
        summary covers only the tokens its head holds."""
        pool, table = self.pool, self.table
        if not pool.reopens_partial_pages:
            return None
        partial = new_lengths % pool.page_size != 0
        last_index = torch.where(partial, new_lengths // pool.page_size, 0)
        last = table.pages[rows].gather(2, last_index.unsqueeze(-1)).squeeze(-1)
        partial[partial.clone()] = ~pool.writable(last[partial])
        return partial

    def _reopen(self, rows: torch.Tensor, reopen: torch.Tensor) -> None:
        """Replace the last page of each head in ``reopen`` by an open, private copy (see
        :meth:`_pages_to_reopen`; a summarized pool's copy has its summary redone by the truncation)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        b, h = reopen.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        old = table.pages[rows[b], h, lengths[b, h] // page_size]
        new = pool.allocate(b.numel(), h)
        pool.open_copies(old, new)
        pool.decref(old)
        table.pages[rows[b], h, lengths[b, h] // page_size] = new

    def _resummarize_last_pages(self, rows: torch.Tensor, changed: torch.Tensor) -> None:
        """Recompute the key summaries of the partly filled last pages of the heads ``changed``
        (bool ``[batch, heads]``) from the tokens they still hold (after a truncation; such pages
        are private by then, see :meth:`_pages_to_reopen`)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        partial = changed & (lengths % page_size != 0)
        b, h = partial.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        ids = table.pages[rows[b], h, lengths[b, h] // page_size]
        keys, _ = pool.read_pages(ids)
        pool.summaries.recompute(ids, keys, lengths[b, h] % page_size)

    # -- sealing ------------------------------------------------------------------------

    def seal(self, rows: torch.Tensor, salience: Callable[[], torch.Tensor] | None = None, partner: LayerPages | None = None) -> int:
        """Seal the full pages of ``rows`` not considered before (past ``table.sealed``), with
        :meth:`~kvlib.storage.pools.page_pool.PagePool.seal_full_pages`; returns how many pages (or
        pairs) were sealed: 0 for a pool that does not seal now. ``partner``: the layer that
        ``pool.partner_layer`` names, for a pool that seals in pairs (None otherwise).

        ``salience``, called only when some page is to be sealed, gives float ``[len(rows),
        kv_heads, slots]`` scores of the layer's stored slots (slot ``s`` of a head lies in its
        table's page ``s // page_size``); each page sealed gets its tokens' scores.

        With a partner layer, a page counts as full once both it and its partner page are (the
        shorter of the two heads decides), and ``sealed`` counters then mean "considered", not
        "sealed": a page whose partner does not hold the same tokens stays open.
        """
        pool, table = self.pool, self.table
        if not pool.seals:
            return 0
        if partner is None:  # the common case, looked up in numpy: a decode step seals a page a page_size of steps
            rows_np = rows.numpy()
            if not bool((table.lengths_np[rows_np] // table.page_size > table.sealed_np[rows_np]).any()):
                return 0
        paired = [table] if partner is None else [table, partner.table]
        page_size = table.page_size
        full = torch.stack([t.lengths[rows] for t in paired]).amin(0) // page_size
        done = table.sealed[rows]
        if not bool((full > done).any()):
            return 0
        width = min(t.pages.shape[2] for t in paired)
        page_slot = torch.arange(width)
        candidate = (page_slot >= done.unsqueeze(-1)) & (page_slot < full.unsqueeze(-1))
        ids = [t.pages[rows][:, :, :width][candidate] for t in paired]
        table.sealed[rows] = torch.maximum(done, full)
        scores = None if salience is None else page_scores(salience(), candidate, page_size)
        return pool.seal_full_pages(ids[0], ids[1] if partner is not None else None, scores)

    # -- rows: prefix pages, forks, releases --------------------------------------------

    def attach_prefix(self, row: torch.Tensor, pages: torch.Tensor, seq: int) -> None:
        """Give the empty row ``row`` (int64 ``[1]``, sequence ``seq``) the full pages ``pages``
        (int64 ``[kv_heads, n]``, in use) as its first ``n * page_size`` tokens, by reference;
        ``ValueError`` before any change for a row that holds tokens or pages of the wrong shape."""
        pool, table = self.pool, self.table
        if int(table.lengths[row].sum()) or int(table.logical[row].sum()):
            raise ValueError(f"attach_prefix needs an empty sequence; {seq} holds tokens in layer {self.layer}")
        if pages.dim() != 2 or pages.shape[0] != table.num_heads:
            raise ValueError(f"pages must be [kv_heads={table.num_heads}, n], got {list(pages.shape)}")
        count = pages.shape[1]
        pool.incref(pages.flatten())
        table.ensure_pages(count)
        table.pages[row, :, :count] = pages
        table.lengths[row] = count * self.page_size
        table.logical[row] = count * self.page_size

    def fork_row(self, source: int, target: int) -> None:
        """Make row ``target`` share every page of row ``source`` by reference (copy-on-write)."""
        self.table.copy_row(source, target)
        self.pool.incref(self.table.referenced_pages(torch.tensor([target])))

    def release(self, rows: torch.Tensor) -> None:
        """Release the page references of ``rows`` and clear their block-table rows."""
        self.pool.decref(self.table.referenced_pages(rows))
        self.table.clear(rows)

    def reset_table(self) -> None:
        """A new store's block table (no rows, one page column): for a store with no live sequence."""
        self.table = BlockTable(self.table.num_heads, self.page_size)
        self.open_pages = None

    def table_bytes(self) -> int:
        """Bytes of the block table (page ids, lengths, logical lengths, sealed counters)."""
        table = self.table
        return sum(part.numel() * part.element_size() for part in (table.pages, table.lengths, table.logical, table.sealed))


def page_scores(scores: torch.Tensor, candidate: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[n, page_size]``: the slot ``scores [batch, heads, slots]`` of the pages ``candidate``
    (bool ``[batch, heads, pages]``) marks, in its order; slots past ``scores``' last are ``-inf``."""
    batch, heads, pages = candidate.shape
    width = pages * page_size
    if scores.shape[-1] < width:
        scores = torch.nn.functional.pad(scores, (0, width - scores.shape[-1]), value=-torch.inf)
    return scores[..., :width].reshape(batch, heads, pages, page_size)[candidate.to(scores.device)]
