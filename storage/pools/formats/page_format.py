"""How a :class:`~kvlib.storage.pools.page_pool.PagePool` holds its pages' keys and values: its *format*
part, one small class per way of holding them.

The pool keeps what every pool keeps (reference counts, the free stack, the positions arena
indexed by page id, key summaries, growth); its format keeps the keys and values and answers
everything that depends on where and how they lie:

- :class:`ArenaPages`: every page in the compute dtype in one device arena indexed by page id;
- :class:`~kvlib.storage.pools.formats.tiered_format.TieredPages`: the same pages spread over device, host and
  disk tiers within page budgets (:class:`~kvlib.storage.pools.formats.tiered_format.TierBudgets`);
- :class:`~kvlib.storage.pools.formats.coded_format.CodedPages`: full pages sealed as a codec's fields;
- :class:`~kvlib.storage.pools.formats.tiered_coded_format.TieredCodedPages`: sealed fields moved, encoded,
  over tiers (held in a pool of byte pages whose format is ``TieredPages``);
- :class:`~kvlib.storage.pools.formats.partnered_format.PartneredPages`: sealed pages leaning on a partner page
  of an earlier layer (MiniCache).

A format is bound to one pool (:meth:`PageFormat.bind`) and reads the pool's shape, positions,
reference counts and summaries through it; the pool calls it after it changed its own state
(``allocated``, ``freed``, ``grow``), so a format never touches the free stack. Every method
here is the default the formats share; a format overrides what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvlib.codec import Field, PageCodec
from kvlib.devices import to_arena_device
from kvlib.kernels import paged_ops
from kvlib.kernels.arena_sources import arena_source_for
from kvlib.kernels.pages import PagedLayer, PageReader


class BoundPool(Protocol):
    """What a format reads of the pool it is bound to (:class:`~kvlib.storage.pools.page_pool.PagePool`,
    which builds its format, so the format names it by what it reads): the pool's page bookkeeping."""

    positions: torch.Tensor
    """int64 ``[capacity, page_size]``: each stored token's position, ``-1`` for an empty slot."""
    refcount: torch.Tensor
    """int64 ``[capacity]``: sequences referencing each page (0: free)."""

    @property
    def capacity(self) -> int: ...

    @property
    def pages_in_use(self) -> int: ...

    @property
    def kv_page_bytes(self) -> int: ...

    @property
    def position_page_bytes(self) -> int: ...

    @property
    def page_bytes(self) -> int: ...


@dataclass
class PlannedStep:
    """What a pool reads of a planned decode step (the base of :class:`kvlib.storage.store.step_plan.StepPlan`), for every
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


class PageFormat:
    """The default part: what a format does unless it says otherwise (see the module docstring).
    Its attributes and methods are the pool's interface beside the pool's own methods (read
    through the pool: ``pool.codec`` is ``pool.format.codec``)."""

    device_pages: int | None = None
    """At most this many pages stay on the pool's device (None: every page does; tiers set a budget)."""
    writes_cpu_slots = False
    """Whether the pool's ``write`` wants its slots on the CPU (where the format looks page state
    up) rather than on the arena device."""
    pages_in_compute_dtype = True
    """Whether every page holds its keys and values in the compute dtype (a codec's sealed pages do not)."""
    partner_layer: int | None = None
    """The earlier layer whose pool this pool's sealed pages lean on (None: none)."""
    planned_slots_stay = True
    """Whether :meth:`planned_slots` of pages stay put while other pages are allocated."""
    reopens_partial_pages = False
    """Whether a truncation ending inside a page the pool may not write reopens it (beside key summaries)."""
    shrinks = False
    """Whether a growable pool of this format may relocate pages and shrink (see ``PagePool.shrinks``)."""
    seals = False
    """Whether :meth:`seal_full_pages` may encode pages now (never without a codec)."""
    codec: PageCodec | None = None
    """The codec sealed pages are held in (None: pages stay in the compute dtype)."""
    staged_bytes = 0
    """Bytes the last :meth:`paged_layer` copied to hand its pages over (none: they lie in the arenas)."""

    pool: BoundPool
    """The pool this format belongs to (its positions, reference counts and capacity are read there)."""
    page_size: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device
    """The pool's shape, copied at :meth:`bind` (it never changes)."""
    keys: torch.Tensor
    """The device arena of keys the format writes (``[rows, page_size, head_dim]``)."""
    values: torch.Tensor
    """The device arena of values the format writes (``[rows, page_size, value_dim]``)."""

    def bind(self, pool: BoundPool, capacity: int) -> None:
        """Become ``pool``'s format (once, from its constructor) and create arenas for ``capacity`` pages."""
        if getattr(self, "pool", None) is not None:
            raise ValueError("a page format belongs to one pool: build a new one for each")
        self.pool = pool
        self.page_size, self.head_dim, self.value_dim = pool.page_size, pool.head_dim, pool.value_dim
        self.dtype, self.device = pool.dtype, pool.device
        self.create(capacity)

    def create(self, capacity: int) -> None:
        """Create the arenas for ``capacity`` pages (called once, by :meth:`bind`)."""
        raise NotImplementedError

    # -- the pool's changes --------------------------------------------------------------------

    def grow(self, capacity: int) -> None:
        """The pool grew to ``capacity`` page ids: extend what is indexed by page id."""

    def allocated(self, ids: torch.Tensor, heads: torch.Tensor | None) -> None:
        """Pages ``ids`` were just taken (``heads``: the KV head of each, None for head 0); may
        raise :class:`~kvlib.errors.PoolExhaustedError` (the pool then frees them again)."""

    def freed(self, ids: torch.Tensor) -> None:
        """Pages ``ids`` just returned to the free stack."""

    def writable(self, ids: torch.Tensor, private: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` may be written in place, given which are referenced once (``private``)."""
        return private

    def shrink(self, capacity: int) -> None:
        """Drop arenas past ``capacity`` pages (only where :attr:`shrinks`)."""
        raise NotImplementedError(f"{type(self).__name__} does not shrink")

    # -- data ----------------------------------------------------------------------------------

    def write(self, slots: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys ``[n, head_dim]`` and values ``[n, value_dim]`` at flat slots ``slots``
        (int64, CPU; ``index``: the same on the arena device)."""
        raise NotImplementedError

    def read_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages ``ids`` in the compute dtype (see :meth:`PagePool.read_pages`)."""
        raise NotImplementedError

    def gather(self, slots: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at flat ``slots`` (``index`` on the device), through :meth:`read_pages`
        (whole pages, then the slots' rows): for formats whose arenas are not indexed by page id."""
        pages, inverse = torch.unique(slots // self.page_size, return_inverse=True)
        keys, values = self.read_pages(pages)
        rows = to_arena_device(inverse * self.page_size + slots % self.page_size, self.device)
        return keys.view(-1, self.head_dim)[rows], values.view(-1, self.value_dim)[rows]

    def copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys and values of pages ``source`` onto ``target`` (CPU; ``src`` / ``dst`` on the device)."""
        raise NotImplementedError

    def open_copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages ``source`` onto freshly allocated ``target`` pages that may be written in
        place: a plain :meth:`copy` unless the format seals pages."""
        self.copy(source, target, src, dst)

    def page_source(self) -> PageReader | None:
        """How the paged kernel reads the pages in place (None: it cannot; see :meth:`PagePool.page_source`)."""
        return None

    def paged_layer(self, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """A block table's tokens where the page kernel reads them, through :meth:`page_source`."""
        source = self.page_source()
        return None if source is None else PagedLayer(source, pages, lengths)

    def planned_slots(self, slots: np.ndarray) -> np.ndarray:
        """Arena slots of a planned step's tokens at flat page ``slots``: the same slots by default."""
        return slots

    def write_planned(self, plan: PlannedStep, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``layer``'s new keys and values (``[batch, kv_heads, tokens, head_dim | value_dim]``,
        the pool's dtype and device) where ``plan`` puts them (at :meth:`planned_slots` of the
        arenas this format writes tokens into, a coded format's raw arenas included): one operator
        (``kvlib::write_planned``, :func:`kvlib.kernels.paged_ops.write_planned`), nothing else (the
        block tables moved on when the step was planned)."""
        if keys.shape != plan.slots.shape[1:] + (self.head_dim,) or keys.dtype != self.dtype:
            raise ValueError(
                f"layer {layer}: keys must be {[*plan.slots.shape[1:], self.head_dim]} in {self.dtype}, got {list(keys.shape)}"
            )
        paged_ops.write_planned(
            self.keys, self.values, self.pool.positions, plan.slots, plan.position_slots, layer, keys, values, plan.positions
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
        """Attention over ``layer``'s pages once ``plan`` wrote it (the plan holds the pools it wrote: ``plan.pools[layer].format``):
        one decode operator over the arenas (``kvlib::paged_decode``; a coded format overrides it)."""
        return paged_ops.paged_decode(
            query,
            self.keys,
            self.values,
            self.pool.positions,
            plan.pages,
            plan.lengths,
            layer,
            mask,
            plan.query_positions,
            scale,
            softcap,
            received,
        )

    # -- sealing and records -------------------------------------------------------------------

    def seal_full_pages(self, ids: torch.Tensor, partner_ids: torch.Tensor | None, salience: torch.Tensor | None) -> int:
        """Seal full pages (see :meth:`PagePool.seal_full_pages`): none without a codec."""
        return 0

    def record_fields(self) -> dict[str, Field] | None:
        """Keys and values in the compute dtype (see :meth:`PagePool.record_fields`)."""
        pool = self.pool
        return {"keys": Field((pool.page_size, pool.head_dim), pool.dtype), "values": Field((pool.page_size, pool.value_dim), pool.dtype)}

    def record_pages(self, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        keys, values = self.read_pages(ids)
        return {"keys": keys, "values": values}

    def restore_pages(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        """Fill freshly allocated pages from what :meth:`record_pages` gave: written as tokens."""
        pool = self.pool
        slots = (ids.unsqueeze(-1) * pool.page_size + torch.arange(pool.page_size)).flatten()
        keys = fields["keys"].reshape(-1, pool.head_dim).to(pool.device, pool.dtype)
        values = fields["values"].reshape(-1, pool.value_dim).to(pool.device, pool.dtype)
        pool.write(slots, keys, values, to_arena_device(positions.reshape(-1), pool.device))

    # -- sizes ---------------------------------------------------------------------------------

    def page_footprint(self) -> int:
        return self.pool.page_bytes

    def data_bytes(self) -> int:
        return self.pool.pages_in_use * self.pool.kv_page_bytes

    def metadata_bytes(self) -> int:
        return 0

    def bytes_reserved(self) -> int:
        return self.pool.capacity * self.pool.page_bytes

    def tier_bytes(self) -> dict[str, int]:
        return {"device": self.data_bytes(), "host": 0, "disk": 0}


class ArenaPages(PageFormat):
    """Every page's keys and values in the compute dtype, in device arenas indexed by page id
    (``keys[page]`` ``[page_size, head_dim]``, ``values[page]`` ``[page_size, value_dim]``);
    read in place by the paged kernel, and the one format a growable pool may shrink."""

    shrinks = True

    def create(self, capacity: int) -> None:
        self.keys = torch.zeros(capacity, self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(capacity, self.page_size, self.value_dim, dtype=self.dtype, device=self.device)

    def grow(self, capacity: int) -> None:
        self.keys = extend_rows(self.keys, capacity, 0)
        self.values = extend_rows(self.values, capacity, 0)

    def shrink(self, capacity: int) -> None:
        self.keys = self.keys[:capacity].clone()
        self.values = self.values[:capacity].clone()

    def write(self, slots: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.view(-1, self.head_dim).index_copy_(0, index, keys)
        self.values.view(-1, self.value_dim).index_copy_(0, index, values)

    def gather(self, slots: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.view(-1, self.head_dim).index_select(0, index), self.values.view(-1, self.value_dim).index_select(0, index)

    def read_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = to_arena_device(ids, self.device)
        return self.keys.index_select(0, index), self.values.index_select(0, index)

    def copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.keys.index_copy_(0, dst, self.keys.index_select(0, src))
        self.values.index_copy_(0, dst, self.values.index_select(0, src))

    def page_source(self) -> PageReader | None:
        """The arenas, in the compute dtype (None on a device that reads layers densely)."""
        return arena_source_for(self.keys, self.values, self.pool.positions)


def extend_rows(tensor: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """A copy of ``tensor`` with ``rows`` rows along dim 0, new rows set to ``fill`` (each row
    written once: the old ones copied, only the new ones filled)."""
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    out[tensor.shape[0] :] = fill
    return out
