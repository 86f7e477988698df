"""A decode step planned once for every layer: where each new token goes and what attention reads.

vLLM's scheduler computes a *slot mapping* once per step and every layer consumes it; kvlib's
paged store does the same for a decode step of a batch of rows (:meth:`PagedStore.plan_step
<kvlib.storage.store.paged_store.PagedStore.plan_step>`), so that a layer's bookkeeping is one write and one
attention call:

- a :class:`DecodeLayout` is worked out when a step finds none that fits its rows: for every
  layer it gives each head room for the step's tokens in pages it alone holds (new pages and
  copy-on-write, :meth:`~kvlib.storage.layers.layer_pages.LayerPages.make_room`), and lays out, for the next ``room``
  tokens, the slot each one takes in every (layer, row, head), the positions they get, and the
  block tables and lengths the attention kernel reads, sent to the arenas' device once. It is
  built with numpy from the block tables' views, at most once per page of tokens per head;
- each step takes its tokens' slots from it (:meth:`DecodeLayout.take`: a few operators for all
  layers together), giving a :class:`StepPlan`; each layer then writes its new keys and values
  at those slots and attends over its pages (:mod:`kvlib.kernels.paged_ops`), and its block table's
  lengths move on in numpy (:meth:`~kvlib.storage.layers.block_table.BlockTable.advance`).

A held cap kept as a ring (:class:`Ring`, for policies that always drop a head's oldest token
past its earliest ``start``: StreamingLLM) plans, for a head at its cap, the slot of that oldest
token for the new one: the head's length stays at the cap, nothing is scored or compacted, and
the step attends over the cap (the oldest token made room before the step, as StreamingLLM's
reference code does before each forward). A layout's ``room`` new tokens of such a head take the
slots of its ``room`` oldest tokens past the first ``start``, oldest first (read from the stored
positions when the layout is made; ``room`` is at most ``cap - start``, so no new token is
replaced within one layout).

Invariants: a layout is valid only while the store changes nothing of its rows but planned
writes (every other change drops it); its slots lie in pages the head alone holds, open (a coded
pool's pages are written raw); all layers of a planned batch have the same KV heads and the
same logical length per row. Where any of this cannot hold (a tiered or partnered pool, a pool
that keeps key summaries, a head over its ring's cap, a ring page shared with another sequence),
there is no plan and the caller takes the general path for that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvlib.devices import to_arena_device
from kvlib.storage.layers.block_table import BlockTable
from kvlib.storage.layers.layer_pages import LayerPages
from kvlib.storage.pools.formats.page_format import PlannedStep
from kvlib.storage.pools.page_pool import PagePool


@dataclass(frozen=True)
class Ring:
    """A held cap kept as a ring of slots: ``caps`` int64 ``[layers, batch, kv_heads]``, each
    head's cap in tokens; the first ``start`` tokens of a head (by position) are never replaced."""

    caps: np.ndarray
    start: int


@dataclass
class StepPlan(PlannedStep):
    """One decode step of ``rows`` in every layer (tensors on the arenas' device unless noted).

    Attributes:
        rows: the batch's store rows (CPU), and ``rows_np`` the same as numpy.
        tokens: new tokens per row in this step.
        slots: int64 ``[layers, batch, kv_heads, tokens]``: each new token's flat slot in its
            layer's key and value arenas.
        position_slots: the same in its layer's position arena.
        positions: int64 ``[batch, tokens]``: the new tokens' positions (logical).
        query_positions: int64 ``[tokens]``: the newest position of each query index over the
            rows (each new token sees every stored token at or before it: causal attention).
        pages: int64 ``[layers, batch, kv_heads, max_pages]``: the block tables, ``-1`` padded.
        lengths: int64 ``[layers, batch, kv_heads]``: tokens stored once the step is written.
        stored: what each head's stored length grows by: ``tokens``, or int64 ``[layers,
            batch, kv_heads]`` (CPU numpy; 0 for a head at its ring's cap).
        pools: each layer's page pool: a layer writes its new tokens with
            ``pools[layer].format.write_planned(plan, layer, keys, values)`` and attends with
            ``pools[layer].format.attend_planned(plan, layer, query, mask, scale)``.
    """

    rows: torch.Tensor
    rows_np: np.ndarray
    tokens: int
    stored: int | np.ndarray
    pools: Sequence[PagePool]


@dataclass
class DecodeLayout:
    """The next ``room`` tokens of ``rows`` in every layer, laid out (see the module docstring);
    ``used`` of them taken so far. ``grows`` (CPU) and
    ``grows_device``: 1 for a head whose length grows with each token, 0 for a ring head (None:
    every head grows)."""

    pools: Sequence[PagePool]
    rows: torch.Tensor
    rows_np: np.ndarray
    key: tuple[int, ...]
    ring: Ring | None
    room: int
    slots: torch.Tensor
    position_slots: torch.Tensor
    positions: torch.Tensor
    pages: torch.Tensor
    lengths: torch.Tensor
    grows: np.ndarray | None
    grows_device: torch.Tensor | None
    slots_stay: bool
    """Whether appends to other rows leave the layout valid (no pool's planned slots move)."""
    used: int = 0

    @property
    def exhausted(self) -> bool:
        return self.used >= self.room

    def unaffected_by_append(self, rows: np.ndarray) -> bool:
        """Whether an append to ``rows`` (not planned) leaves this layout valid: none of its rows,
        and pools whose planned slots stay where they are."""
        return self.slots_stay and not bool(np.isin(rows, self.rows_np).any())

    def fits(self, rows: torch.Tensor, tokens: int) -> bool:
        """Whether ``tokens`` more tokens of ``rows`` fit the room left."""
        return self.used + tokens <= self.room and (rows is self.rows or tuple(rows.tolist()) == self.key)

    def take(self, tokens: int) -> StepPlan:
        """The plan of the next step: ``tokens`` tokens per row, from the room left."""
        start, self.used = self.used, self.used + tokens
        positions = self.positions[:, start : self.used].contiguous()  # strides that do not depend on the room (torch.compile guards them)
        if self.grows is None:
            self.lengths += tokens
            stored: int | np.ndarray = tokens
        else:
            self.lengths += self.grows_device * tokens
            stored = self.grows * tokens
        return StepPlan(
            slots=self.slots[..., start : self.used].contiguous(),
            position_slots=self.position_slots[..., start : self.used].contiguous(),
            positions=positions,
            query_positions=positions.amax(0),
            pages=self.pages,
            lengths=self.lengths,
            rows=self.rows,
            rows_np=self.rows_np,
            tokens=tokens,
            stored=stored,
            pools=self.pools,
        )


def build_layout(
    layers: Sequence[LayerPages],
    rows: torch.Tensor,
    tokens: int,
    device: torch.device,
    ring: Ring | None = None,
) -> DecodeLayout | None:
    """A :class:`DecodeLayout` of ``rows`` for at least ``tokens`` tokens, or None where a plan
    cannot hold (see the module docstring; nothing is changed then: every check comes before
    :meth:`~kvlib.storage.layers.layer_pages.LayerPages.make_room`, which allocates). ``layers``: every
    layer of the store, in order."""
    pools, tables = [pages.pool for pages in layers], [pages.table for pages in layers]
    rows_np = rows.numpy()
    heads = tables[0].num_heads
    if any(table.num_heads != heads for table in tables) or any(not pool.takes_planned_writes for pool in pools):
        return None
    logical = tables[0].logical_np[rows_np]
    if any(not np.array_equal(table.logical_np[rows_np], logical) for table in tables[1:]):
        return None
    lengths = np.stack([table.lengths_np[rows_np] for table in tables])  # [layers, batch, heads]
    at_cap = None
    if ring is not None:
        if ring.caps.shape != lengths.shape or bool((lengths > ring.caps).any()) or bool((ring.caps - ring.start < tokens).any()):
            return None
        at_cap = lengths == ring.caps
        if bool((~at_cap & (lengths + tokens > ring.caps)).any()):
            return None  # a head would reach its cap inside this step
    page_size = tables[0].page_size
    ringing = at_cap is not None and bool(at_cap.any())
    victims = None
    if ringing:  # before anything is allocated (a plan that fails after make_room would leak its pages)
        held = _block_tables(tables, rows_np)
        victims = _oldest(pools, held, lengths, at_cap, ring.start, int((ring.caps - ring.start)[at_cap].min()))
        if not _private(pools, held, victims, at_cap, page_size):
            return None
    steps = tokens if at_cap is None else np.where(at_cap, 0, tokens)
    for layer, pages in enumerate(layers):
        pages.make_room(rows, steps if at_cap is None else steps[layer])
    pages = _block_tables(tables, rows_np)
    capacity = np.where(pages >= 0, page_size, 0).sum(-1)  # slots each head holds in its pages
    room = capacity - lengths
    if at_cap is not None:
        room = np.where(at_cap, victims.shape[-1] if ringing else 0, np.minimum(room, ring.caps - lengths))
    room = int(room.min())
    if at_cap is not None and bool(at_cap.all()):  # every head rings: a page's worth of steps at a time
        room = min(room, max(page_size, tokens))
    ahead = np.arange(room)
    token_index = lengths[..., None] + ahead  # [layers, batch, heads, room]
    if ringing:
        token_index = np.where(at_cap[..., None], victims[..., :room], token_index)
    page_slots = np.take_along_axis(pages, token_index // page_size, axis=-1) * page_size + token_index % page_size
    kv_slots = np.stack([pool.planned_slots(page_slots[layer]) for layer, pool in enumerate(pools)])
    positions = logical[:, None] + ahead
    grows = None if at_cap is None else np.where(at_cap, 0, 1).astype(np.int64)
    return DecodeLayout(
        pools,
        rows,
        rows_np,
        tuple(rows_np.tolist()),
        ring,
        room,
        _on(kv_slots, device),
        _on(page_slots, device),
        _on(positions, device),
        _pages_on(pages, device),
        _on(lengths, device),
        grows,
        None if grows is None else _on(grows, device),
        all(pool.planned_slots_stay for pool in pools),
    )


def _block_tables(tables: Sequence[BlockTable], rows_np: np.ndarray) -> np.ndarray:
    """int64 ``[layers, batch, heads, max_pages]``: the rows' page ids in every layer, ``-1`` padded."""
    width = max(table.pages.shape[2] for table in tables)
    pages = np.full((len(tables), len(rows_np), tables[0].num_heads, width), -1, dtype=np.int64)
    for layer, table in enumerate(tables):
        pages[layer, :, :, : table.pages.shape[2]] = table.pages_np[rows_np]
    return pages


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy bookkeeping array as an int64 tensor of its own on ``device``."""
    return to_arena_device(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)), device)


def _pages_on(pages: np.ndarray, device: torch.device) -> torch.Tensor:
    """The block tables on ``device``; their width (pages per head) grows with the context, so
    ``torch.compile`` is told it varies from the first trace (one compilation serves every width)."""
    tensor = _on(pages, device)
    torch._dynamo.maybe_mark_dynamic(tensor, 3)
    return tensor


def _oldest(pools: Sequence[PagePool], pages: np.ndarray, lengths: np.ndarray, at_cap: np.ndarray, start: int, count: int) -> np.ndarray:
    """int64 ``[layers, batch, heads, count]``: for each ring head (``at_cap``), the slots of its
    ``count`` oldest tokens past its earliest ``start``, oldest first (by stored position); 0
    elsewhere."""
    page_size = pools[0].page_size
    oldest = np.zeros((*lengths.shape, count), dtype=np.int64)
    for layer, pool in enumerate(pools):
        at = np.nonzero(at_cap[layer])
        if not at[0].size:
            continue
        held = lengths[layer][at]  # [n]: every ring head holds its cap
        index = np.arange(int(held.max()))
        stored = index < held[:, None]
        slots = np.take_along_axis(pages[layer][at], np.broadcast_to(index // page_size, stored.shape), axis=-1) * page_size
        slots = np.where(stored, slots + index % page_size, 0)
        positions = pool.positions.view(-1)[to_arena_device(torch.from_numpy(slots), pool.device)].cpu().numpy()
        by_age = np.argsort(np.where(stored, positions, np.iinfo(np.int64).max), axis=-1, kind="stable")
        oldest[layer][at] = by_age[:, start : start + count]
    return oldest


def _private(pools: Sequence[PagePool], pages: np.ndarray, victims: np.ndarray, at_cap: np.ndarray, page_size: int) -> bool:
    """Whether every page holding a ring head's ``victims`` (token indices) is held by that head alone."""
    for layer, pool in enumerate(pools):
        written = np.take_along_axis(pages[layer], victims[layer] // page_size, axis=-1)[at_cap[layer]]
        written = np.unique(written[written >= 0])
        if written.size and not bool(pool.writable(torch.from_numpy(written)).all()):
            return False
    return True
