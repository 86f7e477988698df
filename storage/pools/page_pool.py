"""The page pool of one layer on one device: page ids with reference counts, a free list, the
positions of every page, and a *format* part holding the keys and values.

A page holds ``page_size`` consecutive stored tokens of one KV head: ``positions[page]``
(``[page_size]`` int64, the original absolute position of each token) here, its keys and values
where the pool's :class:`~kvlib.storage.pools.formats.page_format.PageFormat` keeps them (by default
:class:`~kvlib.storage.pools.formats.page_format.ArenaPages`: ``keys[page]`` ``[page_size, head_dim]`` and
``values[page]`` ``[page_size, value_dim]`` in the compute dtype). A codec, tiers or a partner
layer are formats the pool is given (:mod:`~kvlib.storage.store.pool_factory` composes them), not
classes of pool: there is one pool class, with one constructor.

Invariants (checked by ``tests/storage/store/test_store_state_machine.py`` after every step):

- every page id in ``[0, capacity)`` is either *free* (reference count 0, on the free stack
  exactly once) or *in use* (reference count >= 1, not on the free stack);
- ``bytes_in_use() == pages_in_use * page_bytes``.

Allocation pops from and release pushes onto a :class:`~kvlib.storage.pools.free_stack.FreeStack`, so
both cost O(1) per page and are vectorized over many pages. A growable pool grows to
:func:`grown` of what it needs when it runs out (a thirty-second more, at least 16 pages:
amortized O(1) per page, and at most about 3% of a large arena idle); a fixed pool raises :class:`~kvlib.errors.PoolExhaustedError`
before changing anything. A growable pool can also shrink (:meth:`PagePool.relocate`,
:meth:`PagePool.shrink`) once its owner has moved every page in use below the new capacity.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.devices import to_arena_device
from kvlib.errors import PoolExhaustedError
from kvlib.kernels.pages import PagedLayer, PageReader
from kvlib.storage.pools.formats.page_format import ArenaPages, PageFormat, PlannedStep, extend_rows
from kvlib.storage.pools.free_stack import FreeStack
from kvlib.storage.pools.key_summaries import KeySummaries

__all__ = ["GROWTH_PAGES", "GROWTH_SHARE", "PagePool", "PlannedStep", "extend_rows", "grown"]

_POSITION_DTYPE = torch.int64
DEFAULT_PAGES_PER_LAYER = 64
"""Pages each layer's arena holds when a store is built (a growable arena grows from there)."""
GROWTH_SHARE = 32
"""A growable pool grows by ``1 / GROWTH_SHARE`` of what it needs beyond what it has ..."""
GROWTH_PAGES = 16
"""... and by at least this many pages."""


def grown(pages: int) -> int:
    """The capacity a growable pool takes to hold ``pages`` pages with room to grow."""
    return pages + max(pages // GROWTH_SHARE, GROWTH_PAGES)


class PagePool:
    """Pages of one layer on one device: ids, reference counts, positions, and ``format``.

    Args:
        page_size: tokens per page.
        head_dim: key channels per token.
        value_dim: value channels per token (equal to ``head_dim`` for most models).
        dtype: compute dtype of keys and values.
        device: where the arenas live.
        capacity: pages allocated up front.
        fixed: if True the pool never grows (the scheduler's mode); otherwise it grows (:func:`grown`).
        key_summaries: keep each page's channel-wise key min and max on the device, current on
            every write, copy and free (:class:`~kvlib.storage.pools.key_summaries.KeySummaries`, for
            ``quest``).
        format: how the keys and values are held (a fresh :class:`~kvlib.storage.pools.formats.page_format.PageFormat`,
            bound to this pool; default :class:`~kvlib.storage.pools.formats.page_format.ArenaPages`).

    The pool's methods are its own; the rest of its interface is its format's, read through
    the pool (``pool.data_bytes()`` is ``pool.format.data_bytes()``): the attributes and methods
    of :class:`~kvlib.storage.pools.formats.page_format.PageFormat` (sizes, records, ``codec``,
    ``device_pages``, ``seals``, ...) and what one format adds (a codec's ``sealed``, a tier's
    ``rank`` or ``pages_on_host``).
    """

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
        format: PageFormat | None = None,
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
        self.summaries = KeySummaries(capacity, page_size, head_dim, dtype, device) if key_summaries else None
        """Per-page key minima and maxima (None unless ``key_summaries``)."""
        self.format = ArenaPages() if format is None else format
        self.format.bind(self, capacity)

    def __getattr__(self, name: str):
        """What the format adds (called only for names the pool itself does not have)."""
        format = self.__dict__.get("format")
        if format is None:
            raise AttributeError(name)
        return getattr(format, name)

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
        """Bytes of keys and values in one page in the compute dtype."""
        return self.page_size * (self.head_dim + self.value_dim) * self.dtype.itemsize

    @property
    def position_page_bytes(self) -> int:
        """Bytes of stored positions in one page."""
        return self.page_size * self.positions.element_size()

    @property
    def page_bytes(self) -> int:
        """All bytes one page in the compute dtype holds: keys, values and positions."""
        return self.kv_page_bytes + self.position_page_bytes

    def bytes_in_use(self) -> int:
        """Bytes held by pages in use (keys, values, metadata, positions); free pages are not counted."""
        return self.data_bytes() + self.metadata_bytes() + self.pages_in_use * self.position_page_bytes

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
        with per-head state; pages allocated without it are taken to hold head 0. If the format
        cannot place them (a tier full: :class:`~kvlib.errors.PoolExhaustedError`) they go back
        to the free stack and the error propagates.
        """
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > self._free.free:
            if self.fixed:
                raise PoolExhaustedError(f"page pool is full: {count} pages requested, {self._free.free} free of {self.capacity}")
            self._grow(self.pages_in_use + count)
        ids = self._free.pop(count)
        self.refcount.numpy()[ids.numpy()] = 1
        try:
            self.format.allocated(ids, heads)
        except PoolExhaustedError:
            self.format.freed(ids)
            self.refcount.numpy()[ids.numpy()] = 0
            self._free.push(ids)
            raise
        return ids

    def writable(self, ids: torch.Tensor) -> torch.Tensor:
        """bool per id of ``ids`` (int64, CPU, pages in use): whether its slots may be written in
        place, i.e. it is referenced once (shared pages are copied before any write) and its
        format lets it be written (a sealed page is immutable)."""
        return self.format.writable(ids, self.refcount[ids] == 1)

    @property
    def reopens_partial_pages(self) -> bool:
        """Whether a truncation that ends inside a page this pool may not write in place (see
        :meth:`writable`) gives the head an open, private copy of it (:meth:`open_copies`): with
        key summaries (so that the copy's summary covers only the tokens its head keeps), and
        where the format says so (a sealed page reopens, to append after the kept tokens)."""
        return self.summaries is not None or self.format.reopens_partial_pages

    def open_copies(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy pages ``source`` onto freshly allocated ``target`` pages that may be written in
        place (a truncation's reopened pages): a plain copy unless the format seals pages."""
        src, dst = to_arena_device(source, self.device), to_arena_device(target, self.device)
        self.format.open_copy(source, target, src, dst)
        self.positions.index_copy_(0, dst, self.positions.index_select(0, src))
        if self.summaries is not None:
            self.summaries.copy(source, target)

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
        refcount = self.refcount.numpy()  # host bookkeeping: numpy, no trip through torch's dispatcher
        unique, counts = np.unique(ids.numpy(), return_counts=True)
        remaining = refcount[unique] - counts
        if (remaining < 0).any():
            raise RuntimeError("page released more often than referenced: double free")
        refcount[unique] = remaining
        freed = torch.from_numpy(unique[remaining == 0])
        self._free.push(freed)
        self.format.freed(freed)
        if self.summaries is not None:
            self.summaries.clear(freed)

    def _grow(self, min_capacity: int) -> None:
        """Grow to :func:`grown` of ``min_capacity`` pages; page ids stay valid."""
        new = grown(min_capacity)
        self.format.grow(new)
        self.positions = extend_rows(self.positions, new, -1)
        self.refcount = extend_rows(self.refcount, new, 0)
        self._free.grow(new)
        if self.summaries is not None:
            self.summaries.grow(new)

    def seal_full_pages(self, ids: torch.Tensor, partner_ids: torch.Tensor | None, salience: torch.Tensor | None = None) -> int:
        """Seal those of the full pages ``ids`` (int64, CPU, in use, repeats allowed) that are
        still open; ``partner_ids[i]`` is the page of the :attr:`partner_layer` pool holding the
        same tokens as ``ids[i]`` (None without a partner layer); ``salience[i]`` float
        ``[page_size]`` the scores of page ``ids[i]``'s tokens, for a codec that
        :attr:`~kvlib.codec.PageCodec.uses_salience` (None: none given). Returns the pages sealed
        (none without a codec: pages stay in the compute dtype)."""
        return self.format.seal_full_pages(ids, partner_ids, salience)

    # -- data ----------------------------------------------------------------------------------

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write tokens to flat slots (``page * page_size + offset``).

        ``slots``: int64 ``[n]`` on CPU; ``keys``: ``[n, head_dim]``; ``values``: ``[n, value_dim]``;
        ``positions``: int64 ``[n]``. Pages must be owned by the writer (copy-on-write is the
        store's job).
        """
        index = to_arena_device(slots, self.device)
        self.format.write(slots, index, keys, values)
        self.positions.view(-1).index_copy_(0, index, positions.to(self.device, _POSITION_DTYPE))
        if self.summaries is not None:  # from the keys as written, before any encoding
            self.summaries.add(slots, keys)

    @property
    def takes_planned_writes(self) -> bool:
        """Whether a planned decode step (:mod:`~kvlib.storage.store.step_plan`) may write this pool's pages
        with its format's ``write_planned`` and attend over them with its ``attend_planned``: where its
        device's paged kernel reads it in place and it keeps no per-write state of its own (key
        summaries)."""
        return self.summaries is None and self.page_source() is not None

    @property
    def planned_slots_stay(self) -> bool:
        """Whether :meth:`planned_slots` of pages stay where they are while other pages are
        allocated (a coded format's raw rows move when its raw arena is resized)."""
        return self.format.planned_slots_stay

    def planned_slots(self, slots: np.ndarray) -> np.ndarray:
        """The key and value arena slots of a planned step's tokens at flat page ``slots`` (int64,
        pages in use, open, this pool's own): the same slots for arenas indexed by page id."""
        return self.format.planned_slots(slots)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read tokens at flat slots: ``(keys [n, head_dim], values [n, value_dim], positions [n])``."""
        index = to_arena_device(slots, self.device)
        keys, values = self.format.gather(slots, index)
        return keys, values, self.positions.view(-1).index_select(0, index)

    def page_source(self) -> PageReader | None:
        """How the paged-attention kernel of the pool's device reads its pages in place
        (:func:`~kvlib.devices.paged_kernel`: the numba kernel on the CPU, the torch path or
        Triton on CUDA), or None for a format whose pages it cannot read where they lie, or a
        device that reads layers densely (read those with :meth:`read_pages`). Valid until the
        pool next changes."""
        return self.format.page_source()

    def paged_layer(self, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """A block table's tokens where the page kernel reads them: ``pages`` int64 ``[batch,
        kv_heads, n]`` (page ids in order, ``-1`` past each head's last) holding ``lengths`` int64
        ``[batch, kv_heads]`` tokens (only a head's last page may be partly filled). None where
        the kernel cannot read them in place. Valid until the next change to the pool."""
        return self.format.paged_layer(pages, lengths)

    def read_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages ``ids`` (int64 on CPU) in the compute dtype: ``(keys [n, page_size, head_dim],
        values [n, page_size, value_dim])``; free pages read as zeros."""
        return self.format.read_pages(ids)

    @property
    def shrinks(self) -> bool:
        """Whether :meth:`relocate` and :meth:`shrink` apply: a growable pool whose format keeps
        no per-page state beyond arenas indexed by page id (codecs and tiers keep more)."""
        return not self.fixed and self.format.shrinks

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
        self.format.shrink(capacity)
        self.positions = self.positions[:capacity].clone()
        self.refcount = self.refcount[:capacity].clone()
        free = self._free.contents()
        self._free = FreeStack.of(capacity, free[free < capacity])
        if self.summaries is not None:
            self.summaries.shrink(capacity)

    def copy_pages(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy whole pages ``source[i]`` onto ``target[i]`` (copy-on-write; a sealed page stays sealed)."""
        src, dst = to_arena_device(source, self.device), to_arena_device(target, self.device)
        self.format.copy(source, target, src, dst)
        self.positions.index_copy_(0, dst, self.positions.index_select(0, src))
        if self.summaries is not None:
            self.summaries.copy(source, target)
