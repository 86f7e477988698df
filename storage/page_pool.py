"""Page arena for one layer on one device: key, value and position pages with a free list.

A page holds ``page_size`` consecutive stored tokens of one KV head:

- ``keys[page]``: ``[page_size, head_dim]`` in the compute dtype,
- ``values[page]``: ``[page_size, value_dim]`` in the compute dtype,
- ``positions[page]``: ``[page_size]`` int64, the original absolute position of each token.

Invariants (checked by ``tests/storage/test_store_state_machine.py`` after every step):

- every page id in ``[0, capacity)`` is either *free* (reference count 0, on the free stack
  exactly once) or *in use* (reference count >= 1, not on the free stack);
- ``bytes_in_use() == pages_in_use * page_bytes``.

Allocation pops from and release pushes onto a :class:`~kvlib.storage.free_stack.FreeStack`, so
both cost O(1) per page and are vectorized over many pages. A growable pool grows to
:func:`grown` of what it needs when it runs out (a thirty-second more, at least 16 pages:
amortized O(1) per page, and at most about 3% of a large arena idle); a fixed pool raises :class:`~kvlib.errors.PoolExhaustedError`
before changing anything. A growable pool can also shrink (:meth:`PagePool.relocate`,
:meth:`PagePool.shrink`) once its owner has moved every page in use below the new capacity.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from kvlib.codec import Field
from kvlib.devices import to_arena_device
from kvlib.errors import PoolExhaustedError
from kvlib.kernels import paged_ops
from kvlib.kernels.arena_sources import arena_source_for
from kvlib.kernels.paged_attention import PagedLayer, PageReader
from kvlib.storage.free_stack import FreeStack
from kvlib.storage.key_summaries import KeySummaries

_POSITION_DTYPE = torch.int64
GROWTH_SHARE = 32
"""A growable pool grows by ``1 / GROWTH_SHARE`` of what it needs beyond what it has ..."""
GROWTH_PAGES = 16
"""... and by at least this many pages."""


class PlannedStep(Protocol):
    """What a pool reads of a planned decode step (:class:`kvlib.storage.step_plan.StepPlan`), for every
    layer: ``slots`` and ``position_slots`` int64 ``[layers, batch, kv_heads, tokens]`` (where each
    new token goes in the key and value arenas, and in the position arena), ``positions`` int64
    ``[batch, tokens]``, ``query_positions`` int64 ``[tokens]``, the block tables ``pages`` int64
    ``[layers, batch, kv_heads, max_pages]`` and ``lengths`` int64 ``[layers, batch, kv_heads]``."""

    slots: torch.Tensor
    position_slots: torch.Tensor
    positions: torch.Tensor
    query_positions: torch.Tensor
    pages: torch.Tensor
    lengths: torch.Tensor


def grown(pages: int) -> int:
    """The capacity a growable pool takes to hold ``pages`` pages with room to grow."""
    return pages + max(pages // GROWTH_SHARE, GROWTH_PAGES)


class PagePool:
    """Arena of KV pages for one layer on one device.

    Args:
        page_size: tokens per page.
        head_dim: key channels per token.
        value_dim: value channels per token (equal to ``head_dim`` for most models).
        dtype: compute dtype of keys and values.
        device: where the arena lives.
        capacity: pages allocated up front.
        fixed: if True the pool never grows (the scheduler's mode); otherwise it grows (:func:`grown`).
        key_summaries: keep each page's channel-wise key min and max on the device, current on
            every write, copy and free (:class:`~kvlib.storage.key_summaries.KeySummaries`, for
            ``quest``).
    """

    staged_bytes = 0
    """Bytes the last :meth:`paged_layer` copied to hand its pages over (none: they lie in the arena)."""

    device_pages: int | None = None
    """At most this many pages stay on ``device`` (None: every page does; tiered pools set a budget)."""

    writes_cpu_slots = False
    """Whether :meth:`write` wants its slots on the CPU (where it looks page state up) rather than
    on the arena device."""

    pages_in_compute_dtype = True
    """Whether every page holds its keys and values in the compute dtype (then :meth:`record_fields`
    are keys and values); a coded pool's sealed pages do not."""

    partner_layer: int | None = None
    """The earlier layer whose pool this pool's sealed pages lean on (None: none; see
    :class:`~kvlib.storage.partnered_pool.PartneredPagePool`)."""

    def __init__(
        self,
        *,
        page_size: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = 64,
        fixed: bool = False,
        key_summaries: bool = False,
    ) -> None:
        for name, value in (("page_size", page_size), ("head_dim", head_dim), ("value_dim", value_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(capacity, int) or capacity < (1 if fixed else 0):
            raise ValueError(f"capacity must be an int >= {1 if fixed else 0}, got {capacity!r}")
        self.page_size = page_size
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.dtype = dtype
        self.device = device
        self.fixed = fixed
        self.positions = torch.full((capacity, page_size), -1, dtype=_POSITION_DTYPE, device=device)
        self.refcount = torch.zeros(capacity, dtype=torch.int64)
        self._free = FreeStack(capacity)
        self._init_data(capacity)
        self.summaries = KeySummaries(capacity, page_size, head_dim, dtype, device) if key_summaries else None
        """Per-page key minima and maxima (None unless ``key_summaries``)."""

    def _init_data(self, capacity: int) -> None:
        """Create the key and value arenas for ``capacity`` pages."""
        self.keys = torch.zeros(capacity, self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(capacity, self.page_size, self.value_dim, dtype=self.dtype, device=self.device)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Pages in the arena, free or in use."""
        return self.refcount.shape[0]

    @property
    def free_pages(self) -> int:
        return self._free.free

    @property
    def pages_in_use(self) -> int:
        return self.capacity - self._free.free

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of keys and values in one page."""
        item = self.keys.element_size()
        return self.page_size * (self.head_dim + self.value_dim) * item

    @property
    def position_page_bytes(self) -> int:
        """Bytes of stored positions in one page."""
        return self.page_size * self.positions.element_size()

    @property
    def page_bytes(self) -> int:
        """All bytes one page holds: keys, values and positions."""
        return self.kv_page_bytes + self.position_page_bytes

    def page_footprint(self) -> int:
        """Bytes one full page of this pool holds (keys, values, positions; a sealed page with a codec)."""
        return self.page_bytes

    def bytes_in_use(self) -> int:
        """Bytes held by pages in use (keys, values, positions); free pages are not counted."""
        return self.data_bytes() + self.metadata_bytes() + self.pages_in_use * self.position_page_bytes

    def data_bytes(self) -> int:
        """Bytes of keys and values (payload) held by pages in use."""
        return self.pages_in_use * self.kv_page_bytes

    def metadata_bytes(self) -> int:
        """Bytes of codec metadata (scales, zero points, fitted state) held; none without a codec."""
        return 0

    def bytes_reserved(self) -> int:
        """Bytes of the whole arena, free pages included."""
        return self.capacity * self.page_bytes

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of keys and values held on each tier (``device``, ``host``, ``disk``): all on the
        device here."""
        return {"device": self.data_bytes(), "host": 0, "disk": 0}

    def free_page_ids(self) -> torch.Tensor:
        """The free stack's contents (a copy), for checks and debugging."""
        return self._free.contents()

    # -- allocation ----------------------------------------------------------------------------

    def can_allocate(self, count: int) -> bool:
        return not self.fixed or count <= self._free.free

    def reserve(self, count: int) -> None:
        """Make room for ``count`` more pages in one growth, for a caller about to take them a few
        at a time (a prefix restored block by block would otherwise grow the arena, and copy it,
        every few blocks). A fixed pool is left as it is: its allocations say when it is full."""
        if not self.fixed and count > self._free.free:
            self._grow(self.pages_in_use + count)

    def allocate(self, count: int, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Take ``count`` free pages (reference count 1 each); returns their ids, int64 on CPU.

        ``heads`` (int64 ``[count]``, optional) names the KV head each page will hold, for codecs
        with per-head state; pages allocated without it are taken to hold head 0.
        """
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > self._free.free:
            if self.fixed:
                raise PoolExhaustedError(f"page pool is full: {count} pages requested, {self._free.free} free of {self.capacity}")
            self._grow(self.pages_in_use + count)
        ids = self._free.pop(count)
        self.refcount[ids] = 1
        self._on_allocate(ids, heads)
        return ids

    def _on_allocate(self, ids: torch.Tensor, heads: torch.Tensor | None) -> None:
        """Hook: pages ``ids`` were just taken. Nothing to do without a codec."""

    def _on_free(self, ids: torch.Tensor) -> None:
        """Hook: pages ``ids`` just returned to the free stack. Nothing to do without a codec."""

    def writable(self, ids: torch.Tensor) -> torch.Tensor:
        """bool per id of ``ids`` (int64, CPU, pages in use): whether its slots may be written in
        place, i.e. it is referenced once (shared pages are copied before any write)."""
        return self.refcount[ids] == 1

    @property
    def reopens_partial_pages(self) -> bool:
        """Whether a truncation that ends inside a page this pool may not write in place (see
        :meth:`writable`) gives the head an open, private copy of it (:meth:`open_copies`): so
        that the copy's key summary covers only the tokens its head keeps. Only with key summaries
        here (a shared page is otherwise copied by the next append that writes it)."""
        return self.summaries is not None

    def open_copies(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy pages ``source`` onto freshly allocated ``target`` pages that may be written in
        place (a truncation's reopened pages): a plain copy here."""
        self.copy_pages(source, target)

    # -- sealing -------------------------------------------------------------------------------

    @property
    def seals(self) -> bool:
        """Whether :meth:`seal_full_pages` may encode pages now: never without a codec."""
        return False

    def seal_full_pages(self, ids: torch.Tensor, partner_ids: torch.Tensor | None, salience: torch.Tensor | None = None) -> int:
        """Seal those of the full pages ``ids`` (int64, CPU, in use, repeats allowed) that are
        still open; ``partner_ids[i]`` is the page of the :attr:`partner_layer` pool holding the
        same tokens as ``ids[i]`` (None without a partner layer); ``salience[i]`` float
        ``[page_size]`` the scores of page ``ids[i]``'s tokens, for a codec that
        :attr:`~kvlib.codec.PageCodec.uses_salience` (None: none given). Returns the pages sealed:
        none here, pages stay in the compute dtype."""
        return 0

    def incref(self, ids: torch.Tensor) -> None:
        """Add one reference per occurrence of each id; every id must be in use."""
        if ids.numel() == 0:
            return
        if bool((self.refcount[ids] < 1).any()):
            raise RuntimeError("incref of a free page: the block tables and the pool disagree")
        self.refcount.index_add_(0, ids, torch.ones_like(ids))

    def decref(self, ids: torch.Tensor) -> None:
        """Drop one reference per occurrence of each id; pages reaching zero return to the free list."""
        if ids.numel() == 0:
            return
        unique, counts = torch.unique(ids, return_counts=True)
        remaining = self.refcount[unique] - counts
        if bool((remaining < 0).any()):
            raise RuntimeError("page released more often than referenced: double free")
        self.refcount[unique] = remaining
        freed = unique[remaining == 0]
        self._free.push(freed)
        self._on_free(freed)
        if self.summaries is not None:
            self.summaries.clear(freed)

    def _grow(self, min_capacity: int) -> None:
        """Grow the arena to :func:`grown` of ``min_capacity`` pages; page ids stay valid."""
        new = grown(min_capacity)
        self._grow_data(new)
        self.positions = extend_rows(self.positions, new, -1)
        self.refcount = extend_rows(self.refcount, new, 0)
        self._free.grow(new)
        if self.summaries is not None:
            self.summaries.grow(new)

    def _grow_data(self, capacity: int) -> None:
        """Extend the key and value arenas to ``capacity`` pages."""
        self.keys = extend_rows(self.keys, capacity, 0)
        self.values = extend_rows(self.values, capacity, 0)

    # -- data ----------------------------------------------------------------------------------

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write tokens to flat slots (``page * page_size + offset``).

        ``slots``: int64 ``[n]`` on CPU; ``keys``: ``[n, head_dim]``; ``values``: ``[n, value_dim]``;
        ``positions``: int64 ``[n]``. Pages must be owned by the writer (copy-on-write is the
        store's job).
        """
        index = to_arena_device(slots, self.device)
        self.keys.view(-1, self.head_dim).index_copy_(0, index, keys)
        self.values.view(-1, self.value_dim).index_copy_(0, index, values)
        self.positions.view(-1).index_copy_(0, index, positions.to(self.device, _POSITION_DTYPE))
        if self.summaries is not None:
            self.summaries.add(slots, keys)

    @property
    def takes_planned_writes(self) -> bool:
        """Whether a planned decode step (:mod:`~kvlib.storage.step_plan`) may write this pool's pages
        with :meth:`write_planned` and attend over them with :meth:`attend_planned`: where its
        device's paged kernel reads it in place and it keeps no per-write state of its own (key
        summaries)."""
        return self.summaries is None and self.page_source() is not None

    planned_slots_stay = True
    """Whether :meth:`planned_slots` of pages stay where they are while other pages are allocated
    (a coded pool's raw rows move when its raw arena is resized)."""

    def planned_slots(self, slots: np.ndarray) -> np.ndarray:
        """The key and value arena slots of a planned step's tokens at flat page ``slots`` (int64,
        pages in use, open, this pool's own): the same slots here."""
        return slots

    def write_planned(self, plan: PlannedStep, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``layer``'s new keys and values (``[batch, kv_heads, tokens, head_dim | value_dim]``,
        the pool's dtype and device) where ``plan`` puts them: one operator
        (``kvlib::write_planned``, :func:`kvlib.kernels.paged_ops.write_planned`), nothing else (the block
        tables moved on when the step was planned)."""
        if keys.shape != plan.slots.shape[1:] + (self.head_dim,) or keys.dtype != self.dtype:
            raise ValueError(
                f"layer {layer}: keys must be {[*plan.slots.shape[1:], self.head_dim]} in {self.dtype}, got {list(keys.shape)}"
            )
        paged_ops.write_planned(
            self.keys, self.values, self.positions, plan.slots, plan.position_slots, layer, keys, values, plan.positions
        )

    def attend_planned(
        self,
        plan: PlannedStep,
        layer: int,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None = None,
        received: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` (``[batch, query_heads, tokens, head_dim]``) over ``layer``'s
        pages once ``plan`` wrote it, ``[batch, tokens, query_heads, value_dim]`` (``kvlib::paged_decode``,
        :func:`kvlib.kernels.paged_ops.paged_decode`; ``mask`` the model's mask over logical positions,
        None for causal by the new tokens' positions; ``received``: see
        :func:`~kvlib.kernels.paged_ops.paged_decode`)."""
        return paged_ops.paged_decode(
            query,
            self.keys,
            self.values,
            self.positions,
            plan.pages,
            plan.lengths,
            layer,
            mask,
            plan.query_positions,
            scale,
            softcap,
            received,
        )

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read tokens at flat slots: ``(keys [n, head_dim], values [n, value_dim], positions [n])``."""
        index = to_arena_device(slots, self.device)
        return (
            self.keys.view(-1, self.head_dim).index_select(0, index),
            self.values.view(-1, self.value_dim).index_select(0, index),
            self.positions.view(-1).index_select(0, index),
        )

    def gather_by_pages(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`gather` through :meth:`read_pages` (whole pages, then the slots' rows): for
        pools whose arenas are not indexed by page id (coded, tiered)."""
        pages, inverse = torch.unique(slots // self.page_size, return_inverse=True)
        keys, values = self.read_pages(pages)
        index = to_arena_device(inverse * self.page_size + slots % self.page_size, self.device)
        positions = self.positions.view(-1).index_select(0, to_arena_device(slots, self.device))
        return keys.view(-1, self.head_dim)[index], values.view(-1, self.value_dim)[index], positions

    def page_source(self) -> PageReader | None:
        """How the paged-attention kernel of the pool's device reads its pages in place
        (:func:`~kvlib.devices.paged_kernel`: the numba kernel on the CPU, the torch path on
        CUDA), or None for a pool whose pages it cannot read where they lie, or a device that
        reads layers densely (read those with :meth:`read_pages`). Here: the arenas, in the
        compute dtype. Valid until the pool next changes."""
        return arena_source_for(self.keys, self.values, self.positions)

    def paged_layer(self, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """A block table's tokens where the page kernel reads them: ``pages`` int64 ``[batch,
        kv_heads, n]`` (page ids in order, ``-1`` past each head's last) holding ``lengths`` int64
        ``[batch, kv_heads]`` tokens (only a head's last page may be partly filled). None where
        :meth:`page_source` is None. Valid until the next change to the pool."""
        source = self.page_source()
        return None if source is None else PagedLayer(source, pages, lengths)

    def read_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages ``ids`` (int64 on CPU) in the compute dtype: ``(keys [n, page_size, head_dim],
        values [n, page_size, value_dim])``."""
        index = to_arena_device(ids, self.device)
        return self.keys.index_select(0, index), self.values.index_select(0, index)

    def record_fields(self) -> dict[str, Field] | None:
        """What one page of this pool is in a prefix block record (:mod:`~kvlib.storage.prefix_block_record`):
        its fields by name, or None when its pages cannot go to one (they hold neither the compute
        dtype nor fields that mean the same to another process). Here keys and values in the
        compute dtype; None for a subclass whose pages are not in it and that says nothing more."""
        if not self.pages_in_compute_dtype:
            return None
        return {"keys": Field((self.page_size, self.head_dim), self.dtype), "values": Field((self.page_size, self.value_dim), self.dtype)}

    def record_pages(self, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The :meth:`record_fields` of full pages ``ids`` (int64, CPU), each ``[n, *shape]``, or
        None when one of them is in no state a record holds."""
        keys, values = self.read_pages(ids)
        return {"keys": keys, "values": values}

    def restore_pages(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        """Fill freshly allocated pages ``ids`` (int64, CPU) with the fields :meth:`record_pages`
        gave (any device) and ``positions`` (int64 ``[n, page_size]``): full pages again."""
        slots = (ids.unsqueeze(-1) * self.page_size + torch.arange(self.page_size)).flatten()
        keys = fields["keys"].reshape(-1, self.head_dim).to(self.device, self.dtype)
        values = fields["values"].reshape(-1, self.value_dim).to(self.device, self.dtype)
        self.write(slots, keys, values, to_arena_device(positions.reshape(-1), self.device))

    @property
    def shrinks(self) -> bool:
        """Whether :meth:`relocate` and :meth:`shrink` apply: a growable pool without per-page
        state beyond its arenas (codecs and tiers keep more, and do not shrink)."""
        return not self.fixed

    def relocate(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Move in-use pages ``source[i]`` onto free pages ``target[i]`` (int64 on CPU, distinct):
        data, positions, summaries and reference counts move, the sources become free. The
        owner rewrites its block tables to match."""
        if bool((self.refcount[target] != 0).any()) or bool((self.refcount[source] == 0).any()):
            raise ValueError("relocate moves pages in use onto free pages")
        self.copy_pages(source, target)
        if self.summaries is not None:
            self.summaries.clear(source)
        self.refcount[target] = self.refcount[source]
        self.refcount[source] = 0
        self._free = FreeStack.of(self.capacity, (self.refcount == 0).nonzero().squeeze(-1))

    def shrink(self, capacity: int) -> None:
        """Drop pages ``[capacity, self.capacity)``, which must all be free; arenas are copied
        to their new size so the memory is given back."""
        if bool((self.refcount[capacity:] != 0).any()):
            raise ValueError(f"shrink to {capacity} pages needs every page from {capacity} on free")
        self.keys = self.keys[:capacity].clone()
        self.values = self.values[:capacity].clone()
        self.positions = self.positions[:capacity].clone()
        self.refcount = self.refcount[:capacity].clone()
        free = self._free.contents()
        self._free = FreeStack.of(capacity, free[free < capacity])
        if self.summaries is not None:
            self.summaries.shrink(capacity)

    def copy_pages(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy whole pages ``source[i]`` onto ``target[i]`` (copy-on-write)."""
        src = to_arena_device(source, self.device)
        dst = to_arena_device(target, self.device)
        self.keys.index_copy_(0, dst, self.keys.index_select(0, src))
        self.values.index_copy_(0, dst, self.values.index_select(0, src))
        self.positions.index_copy_(0, dst, self.positions.index_select(0, src))
        if self.summaries is not None:
            self.summaries.copy(source, target)


def extend_rows(tensor: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """A copy of ``tensor`` with ``rows`` rows along dim 0, new rows set to ``fill``."""
    out = torch.full((rows, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    return out
