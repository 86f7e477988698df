"""The coded page format: a pool's sealed pages held encoded by a :class:`~kvlib.codec.PageCodec`.

A page in use is either

- *open*: its keys and values sit in the compute dtype in a raw arena sized for open pages
  only (``raw_row[page]`` is its row there), and it may be written; or
- *sealed*: it is full, its keys and values exist only as the codec's fields
  (``encoded[name][page]``), and it is never written again (appends go to open pages,
  compaction and copy-on-write write fresh pages).

Positions of every page stay int64 in ``positions`` (they are bookkeeping, never encoded).

Invariants (beside :class:`~kvlib.storage.PagePool`'s; ``tests/storage/store/test_store_state_machine.py``): a page in use has ``raw_row >= 0``
exactly when it is not sealed; free pages are neither sealed nor hold a raw row; the raw rows
held are distinct. ``data_bytes()`` counts open pages at the compute dtype and sealed pages at
the codec's payload bytes; ``metadata_bytes()`` counts sealed pages' scales and zero points and
the codec's fitted state. The raw arena grows on demand and shrinks again once sealing leaves
it mostly empty (a prefill's pages are raw only between the layer's append and its seal).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvlib.codec import Field, PageCodec, arena_dtype
from kvlib.devices import PagedKernel, paged_kernel, to_arena_device
from kvlib.kernel_readers import KernelReader
from kvlib.kernels import paged_ops
from kvlib.kernels.paged_attention import coded_source
from kvlib.kernels.pages import PageReader
from kvlib.storage.pools.formats.page_format import PageFormat, PlannedStep, extend_rows
from kvlib.storage.pools.free_stack import FreeStack
from kvlib.storage.pools.page_indexing import first_occurrences
from kvlib.storage.pools.read_plan import ReadPlan

_MIN_RAW_PAGES = 16

CODED_SOURCES: dict[PagedKernel, Callable[[CodedPages], PageReader | None]] = {
    PagedKernel.NUMBA: lambda pool: pool.numba_source(),
}
"""How each paged kernel reads a coded pool's pages (a kernel not listed reads them densely)."""
try:  # triton is optional (torch's CUDA builds bring it): without it a coded pool on CUDA is read densely
    from kvlib.kernels.paged_attention_triton import has_triton_loaders, triton_coded_source

    CODED_SOURCES[PagedKernel.TRITON] = lambda pool: pool.triton_source()
except ImportError:
    pass


class CodedPages(PageFormat):
    """The format of a pool that encodes sealed pages with ``codec`` (see the module docstring).
    Per-page state beyond arenas indexed by page id (raw rows, fields) is not relocated: the
    pool does not shrink."""

    pages_in_compute_dtype = False

    writes_cpu_slots = True
    """:meth:`write` looks each page's raw row up in CPU bookkeeping."""

    reopens_partial_pages = True
    """A truncation ending inside a sealed page reopens it: appends then write after the kept
    tokens, and a sharer for which the page is still full may keep it sealed."""

    def __init__(self, codec: PageCodec) -> None:
        self.codec = codec

    def create(self, capacity: int) -> None:
        self.encoded: dict[str, torch.Tensor] = {}
        """Field arenas ``[capacity, *field.shape]``, created at the first seal (a fitted codec
        knows its fields only once fitted)."""
        self.sealed = torch.zeros(capacity, dtype=torch.bool)
        self.raw_row = torch.full((capacity,), -1, dtype=torch.int64)
        self.page_heads = torch.zeros(capacity, dtype=torch.int64)
        raw = _MIN_RAW_PAGES
        self.keys = torch.zeros(raw, self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(raw, self.page_size, self.value_dim, dtype=self.dtype, device=self.device)
        self._raw_free = FreeStack(raw)
        self.version = 0
        """Bumped whenever a page changes state (allocated, freed, sealed) or raw rows move."""
        self._plan: ReadPlan | None = None
        self.kernel_readers: tuple[KernelReader, KernelReader] | None = None
        """How the paged kernels read the sealed keys and values (:meth:`~kvlib.codec.PageCodec.kernel_readers`
        of the field arenas), kept while the arenas are the same tensors; None until the codec is
        ready, and for a codec the kernels cannot read in place."""
        self._readers_of: tuple[torch.Tensor, ...] | None = None
        self.kernel_sealed, self.kernel_raw_row = self.sealed, self.raw_row
        """``sealed`` and ``raw_row`` where the kernels read them: the bookkeeping itself on the CPU,
        copies on the arenas' device kept in step with it elsewhere (:meth:`_changed`)."""

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def sealed_pages(self) -> int:
        return int(self.sealed.sum())

    @property
    def open_pages(self) -> int:
        return self.pool.pages_in_use - self.sealed_pages

    def page_footprint(self) -> int:
        if not self.codec.ready and not self.encoded:  # fields unknown until fitted
            return self.pool.page_bytes
        return self.codec.page_bytes() + self.pool.position_page_bytes

    def data_bytes(self) -> int:
        sealed = self.sealed_pages
        coded = sealed * self.codec.page_bytes(metadata=False) if sealed else 0
        return (self.pool.pages_in_use - sealed) * self.pool.kv_page_bytes + coded

    def metadata_bytes(self) -> int:
        sealed = self.sealed_pages
        return (sealed * self.codec.page_bytes(metadata=True) if sealed else 0) + self.codec.state_bytes()

    def bytes_reserved(self) -> int:
        raw = self.keys.shape[0] * self.pool.kv_page_bytes
        encoded = sum(t.numel() * t.element_size() for t in self.encoded.values())
        return raw + encoded + self.pool.capacity * self.pool.position_page_bytes

    # -- the pool's changes --------------------------------------------------------------------

    def allocated(self, ids: torch.Tensor, heads: torch.Tensor | None) -> None:
        if self._raw_free.free < ids.numel():
            self._resize_raw(max(2 * self.keys.shape[0], self.keys.shape[0] - self._raw_free.free + ids.numel()))
        self.raw_row[ids] = self._raw_free.pop(ids.numel())
        self.sealed[ids] = False
        self.page_heads[ids] = 0 if heads is None else heads
        self._changed()

    def freed(self, ids: torch.Tensor) -> None:
        held = self.raw_row[ids]
        self._raw_free.push(held[held >= 0])
        self.raw_row[ids] = -1
        self.sealed[ids] = False
        self._changed()

    def grow(self, capacity: int) -> None:
        self.encoded = {name: extend_rows(t, capacity, 0) for name, t in self.encoded.items()}
        self.sealed = extend_rows(self.sealed, capacity, False)
        self.raw_row = extend_rows(self.raw_row, capacity, -1)
        self.page_heads = extend_rows(self.page_heads, capacity, 0)
        self._changed()

    def _changed(self) -> None:
        """A page changed state, raw rows moved or arenas were replaced: bump :attr:`version`,
        bring the kernels' copies of ``sealed`` and ``raw_row`` up to date (off the CPU: copied
        into device tensors that stay put while the capacity does) and drop readers of replaced
        field arenas."""
        self.version += 1
        if self.device.type == "cpu":
            self.kernel_sealed, self.kernel_raw_row = self.sealed, self.raw_row
        elif self.kernel_sealed.device != self.device or self.kernel_sealed.shape != self.sealed.shape:
            self.kernel_sealed = to_arena_device(self.sealed, self.device)
            self.kernel_raw_row = to_arena_device(self.raw_row, self.device)
        else:
            self.kernel_sealed.copy_(self.sealed, non_blocking=True)
            self.kernel_raw_row.copy_(self.raw_row, non_blocking=True)
        self._refresh_readers()

    def _refresh_readers(self) -> None:
        """Rebuild :attr:`kernel_readers` where the field arenas are other tensors than those they
        were built of (or the codec became ready since)."""
        arenas = tuple(self.encoded.values())
        built = self._readers_of
        if built is not None and len(built) == len(arenas) and all(a is b for a, b in zip(built, arenas)):
            return
        if not self.codec.ready:
            self.kernel_readers, self._readers_of = None, None
            return
        self.kernel_readers = self.codec.kernel_readers(self.encoded or self._field_arenas(0))
        self._readers_of = arenas

    def _resize_raw(self, rows: int) -> None:
        """Give the raw arena ``rows`` rows, moving the rows in use to the front."""
        held = (self.raw_row >= 0).nonzero().squeeze(-1)
        old_rows = self.raw_row[held]
        keys = torch.zeros(rows, self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        values = torch.zeros(rows, self.page_size, self.value_dim, dtype=self.dtype, device=self.device)
        source = to_arena_device(old_rows, self.device)
        keys[: held.numel()] = self.keys.index_select(0, source)
        values[: held.numel()] = self.values.index_select(0, source)
        self.keys, self.values = keys, values
        self.raw_row[held] = torch.arange(held.numel())
        self._raw_free = FreeStack(rows)
        self._raw_free.pop(held.numel())
        self._changed()

    def writable(self, ids: torch.Tensor, private: torch.Tensor) -> torch.Tensor:
        """Referenced once and open: a sealed page is immutable."""
        return private & ~self.sealed[ids]

    # -- data ----------------------------------------------------------------------------------

    def _raw_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Raw-arena slots of arena ``slots`` (int64 on the CPU: page state is CPU bookkeeping)."""
        pages = slots // self.page_size
        if bool(self.sealed[pages].any()):
            raise RuntimeError("write to a sealed page: sealed pages are immutable (the store and the pool disagree)")
        return self.raw_row[pages] * self.page_size + slots % self.page_size

    def write(self, slots: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Open pages' raw rows (sealed pages are immutable)."""
        raw = to_arena_device(self._raw_slots(slots), self.device)
        self.keys.view(-1, self.head_dim).index_copy_(0, raw, keys)
        self.values.view(-1, self.value_dim).index_copy_(0, raw, values)

    planned_slots_stay = False

    def planned_slots(self, slots: np.ndarray) -> np.ndarray:
        """Raw-arena slots of open pages' flat ``slots`` (their keys and values are written raw)."""
        rows = self.raw_row.numpy()[slots // self.page_size]
        if bool((rows < 0).any()):
            raise RuntimeError("planned write to a sealed page: sealed pages are immutable (the store and the pool disagree)")
        return rows * self.page_size + slots % self.page_size

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
        """One ``kvlib::paged_decode_coded`` over the open pages' raw arenas and the codec's fields,
        read by its :attr:`kernel_readers` (set while :meth:`page_source` gives a source, which a
        planned step checked)."""
        keys, values = self.kernel_readers
        return paged_ops.paged_decode_coded(
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
            self.kernel_sealed,
            self.kernel_raw_row,
            keys,
            values,
            received,
        )

    def page_source(self) -> PageReader | None:
        """Open pages read raw and sealed pages read inside the kernel, from the arenas where they
        lie: the numba kernel's readers on the CPU (:func:`~kvlib.kernels.paged_attention.coded_source`,
        the codec's scales folded in), the Triton kernels' tile loaders on CUDA
        (:func:`~kvlib.kernels.paged_attention_triton.triton_coded_source`). None for a codec that is
        not fitted yet or has no reader for the kernel, and on a device whose kernel reads float
        arenas only (the torch path): attention then reads through :meth:`read_pages` (a dense
        copy of the decoded pages)."""
        self._refresh_readers()
        kernel = paged_kernel(self.device)
        if self.kernel_readers is None or kernel not in CODED_SOURCES:
            return None
        return CODED_SOURCES[kernel](self)

    def numba_source(self) -> PageReader:
        """The numba kernel's :class:`~kvlib.kernels.paged_attention.PageSource` of this pool's pages (CPU)."""
        return coded_source(self.keys, self.values, self.sealed, self.raw_row, self.pool.positions, *self.kernel_readers)

    def triton_source(self) -> PageReader | None:
        """The Triton kernels' source of this pool's pages (CUDA), or None for a codec without
        Triton tile loaders."""
        keys, values = self.kernel_readers
        if not has_triton_loaders(keys, values):
            return None
        return triton_coded_source(self.keys, self.values, self.kernel_sealed, self.kernel_raw_row, self.pool.positions, keys, values)

    def _field_arenas(self, rows: int) -> dict[str, torch.Tensor]:
        """Zeroed arenas of ``rows`` pages for each of the codec's fields (one-byte floats as bytes)."""
        return {
            name: torch.zeros(rows, *field.shape, dtype=arena_dtype(field.dtype), device=self.device)
            for name, field in self.codec.fields.items()
        }

    def read_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages in the compute dtype: sealed pages decoded, open pages copied, free pages zero.

        Where each page is read from (a :class:`ReadPlan`) is worked out once and reused while
        the same ids are read and no page changed state: a decode step reads the same pages as
        the step before it until one fills.
        """
        plan = self._plan
        if plan is None or plan.version != self.version or plan.ids.shape != ids.shape or not torch.equal(plan.ids, ids):
            plan = self._plan = ReadPlan.of(ids, self.sealed, self.raw_row, self.page_heads, self.version, self.device)
        keys = torch.empty(ids.numel(), self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        values = torch.empty(ids.numel(), self.page_size, self.value_dim, dtype=self.dtype, device=self.device)
        if plan.pages.numel():
            self._decode_sealed(plan.pages, plan.heads, keys, values, plan.sealed_rows)
        if plan.free is not None:
            keys.index_fill_(0, plan.free, 0)
            values.index_fill_(0, plan.free, 0)
        if plan.open_source is not None:
            keys.index_copy_(0, plan.open_target, self.keys.index_select(0, plan.open_source))
            values.index_copy_(0, plan.open_target, self.values.index_select(0, plan.open_source))
        return keys, values

    def record_fields(self) -> dict[str, Field] | None:
        """The codec's fields: a sealed page goes to a block record as it is held. None for a
        codec that fits itself to data (its fields mean nothing without the fitted state)."""
        return None if self.codec.learns else self.codec.fields

    def record_pages(self, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The encoded fields of pages ``ids`` as the arenas hold them (one-byte floats as bytes),
        or None unless every one is sealed (an open page is not what a restored sealed one reads)."""
        if ids.numel() == 0 or not self.encoded or not bool(self.sealed[ids].all()):
            return None
        index = to_arena_device(ids, self.device)
        return {name: arena.index_select(0, index) for name, arena in self.encoded.items()}

    def restore_pages(self, ids: torch.Tensor, fields: dict[str, torch.Tensor], positions: torch.Tensor) -> None:
        """Seal freshly allocated pages ``ids`` with stored ``fields`` (no encoding: they are the
        codec's output) at ``positions`` (int64 ``[n, page_size]``)."""
        self.pool.positions.index_copy_(0, to_arena_device(ids, self.device), positions.to(self.device, torch.int64))
        codec_fields = self.codec.fields
        self.seal(ids, {name: fields[name].to(self.device).view(codec_fields[name].dtype) for name in codec_fields})

    def _decode_sealed(
        self, pages: torch.Tensor, heads: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Decode sealed ``pages`` into ``keys[rows]`` and ``values[rows]``."""
        self.codec.decode_into(self.encoded, pages, heads, keys, values, rows)

    def copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages onto freshly allocated ``target`` pages: a sealed source stays sealed in its
        copy (its fields are copied), an open one is copied raw."""
        sealed = self.sealed[source]
        self.page_heads[target] = self.page_heads[source]
        if bool(sealed.any()):
            src, dst = source[sealed], target[sealed]
            self._copy_sealed(src, dst)
            self._raw_free.push(self.raw_row[dst])
            self.raw_row[dst] = -1
            self.sealed[dst] = True
            self._changed()
        if not bool(sealed.all()):
            src = to_arena_device(self.raw_row[source[~sealed]], self.device)
            dst = to_arena_device(self.raw_row[target[~sealed]], self.device)
            self.keys.index_copy_(0, dst, self.keys.index_select(0, src))
            self.values.index_copy_(0, dst, self.values.index_select(0, src))

    def _copy_sealed(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the encoded fields of sealed pages ``source`` onto pages ``target`` (in use, not sealed yet)."""
        src_index, dst_index = to_arena_device(source, self.device), to_arena_device(target, self.device)
        for t in self.encoded.values():
            t.index_copy_(0, dst_index, t.index_select(0, src_index))

    def open_copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Write the decoded contents of pages ``source`` into freshly allocated open ``target``
        pages (to append after a truncation that left a sealed page partly kept)."""
        keys, values = self.read_pages(source)
        rows = to_arena_device(self.raw_row[target], self.device)
        self.keys.index_copy_(0, rows, keys)
        self.values.index_copy_(0, rows, values)
        self.page_heads[target] = self.page_heads[source]

    def raw_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of open pages ``ids`` (copies, ``[n, page_size, dim]``)."""
        rows = self.raw_row[ids]
        if bool((rows < 0).any()):
            raise RuntimeError("raw read of a page that is sealed or free: the store and the pool disagree")
        source = to_arena_device(rows, self.device)
        return self.keys.index_select(0, source), self.values.index_select(0, source)

    @property
    def seals(self) -> bool:
        """Pages are sealed once the codec is fitted."""
        return self.codec.ready

    def seal_full_pages(self, ids: torch.Tensor, partner_ids: torch.Tensor | None, salience: torch.Tensor | None) -> int:
        """Encode the distinct pages of ``ids`` not sealed yet (``partner_ids``: None, no partner),
        with the ``salience`` of their first occurrence in ``ids``."""
        ids, first = first_occurrences(ids)
        still_open = ~self.sealed[ids]
        ids = ids[still_open]
        if salience is not None:
            salience = salience[to_arena_device(first[still_open], salience.device)]
        self.seal(ids, salience=salience)
        return int(ids.numel())

    def seal(self, ids: torch.Tensor, encoded: dict[str, torch.Tensor] | None = None, salience: torch.Tensor | None = None) -> None:
        """Encode open, full pages ``ids`` (distinct, in use) and release their raw rows;
        ``encoded`` gives their fields when a codec spanning two layers computed them; ``salience``
        ``[len(ids), page_size]``: their tokens' scores, for a codec that reads them."""
        if ids.numel() == 0:
            return
        rows = self.raw_row[ids]
        if bool((rows < 0).any()):
            raise RuntimeError("seal of a page that is sealed or free: the store and the pool disagree")
        if encoded is None:
            keys, values = self.raw_pages(ids)
            encoded = self.codec.encode(keys, values, to_arena_device(self.page_heads[ids], self.device), salience)
        self._store_sealed(ids, encoded)
        self._raw_free.push(rows)
        self.raw_row[ids] = -1
        self.sealed[ids] = True
        self._changed()
        held = self.keys.shape[0] - self._raw_free.free
        if self.keys.shape[0] > _MIN_RAW_PAGES and 4 * held < self.keys.shape[0]:
            self._resize_raw(max(_MIN_RAW_PAGES, 2 * held))

    def _store_sealed(self, ids: torch.Tensor, encoded: dict[str, torch.Tensor]) -> None:
        """Keep the ``encoded`` fields (``[len(ids), *field.shape]``) of pages ``ids``, being sealed:
        in the field arenas, at the pages' ids."""
        target = to_arena_device(ids, self.device)
        if not self.encoded:
            self.encoded = self._field_arenas(self.pool.capacity)
        fields = self.codec.fields
        for name, t in encoded.items():
            arena = self.encoded[name]
            field = t.to(fields[name].dtype)
            arena.index_copy_(0, target, field.view(arena.dtype) if field.dtype != arena.dtype else field)
