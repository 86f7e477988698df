"""The tiered page format: a pool's pages split over three tiers, a device arena with a page
budget, a host arena, and (optionally) page records on disk behind the host.

Every page in use has its keys and values in exactly one tier: ``device_row[page] >= 0`` (a row
of the device arena), ``host_row[page] >= 0`` (a row of the pool's :mod:`~kvlib.storage.pools.host_arena`)
or ``on_disk[page]`` (a record of the layer's spill, :mod:`kvlib.storage.pools.disk_pages`). Positions
stay in the pool's arena for every page (bookkeeping). The budgets are a :class:`TierBudgets`,
which the coded format's tiers (:mod:`~kvlib.storage.pools.formats.tiered_coded_format`) take too.

Placement: the pool keeps each page's facts (:class:`~kvlib.placement.PageStats`) and moves pages
in the order of its placement rule (:mod:`kvlib.placement`; default
:func:`~kvlib.placement.lowest_score_first`): device pages that leave first go to the host when
a page needs a device row, host pages that leave first go to disk (one transaction; past
``disk_pages``: :class:`~kvlib.errors.PoolExhaustedError`, nothing moved) when the host is full;
:meth:`TieredPages.rank` scores pages and brings those the order keeps onto the device.

Writes go to the device (a host or spilled page written is brought back first, its record
deleted; freeing deletes it too). Reads copy host and spilled pages straight into the read
buffer without moving them (a decode step reads every page; moving them would thrash the device).
Attention reads the pages in place (:meth:`TieredPages.paged_layer`, staging only off-device
pages: :mod:`kvlib.storage.pools.staging_arena`). :meth:`TieredPages.prefetch` starts copying host
and spilled pages towards the device on a thread (:mod:`kvlib.storage.pools.pending_fetch`); every
method that changes the tiers first waits for it.

Invariants (``tests/storage/store/test_store_state_machine.py``, ``TieredStoreMachine`` and
``SpillingStoreMachine``): a page in use is in exactly one tier; the pages on each tier never
exceed its budget; a record exists exactly for each page on disk; reads return what was
written, whatever tier holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.devices import reads_pages_in_place, to_arena_device
from kvlib.errors import PoolExhaustedError
from kvlib.kernels.arena_sources import arena_source_for
from kvlib.kernels.pages import PagedLayer
from kvlib.placement import Placement, lowest_score_first
from kvlib.storage.pools.disk_pages import DiskPages
from kvlib.storage.pools.formats.page_format import PageFormat, extend_rows
from kvlib.storage.pools.free_stack import FreeStack
from kvlib.storage.pools.host_arena import MIN_HOST_PAGES, HostArena
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.pools.pending_fetch import PendingFetch
from kvlib.storage.pools.placement_state import PlacementState
from kvlib.storage.pools.staging_arena import StagingArena
from kvlib.storage.tiers.spill_store import LayerSpill


@dataclass(frozen=True)
class TierBudgets:
    """How many pages each tier of a tiered format holds, and in what order pages leave one.

    Attributes:
        device_pages: at most this many pages on the device (an int >= 1).
        host_pages: at most this many on the host (None: unbounded; needed for a disk tier).
        disk_pages: with a disk tier, at most this many on disk (>= 1 then; ignored without one).
        placement: the rule ordering the pages that leave a tier (None: lowest score first).
    """

    device_pages: int
    host_pages: int | None = None
    disk_pages: int = 0
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device_pages, int) or self.device_pages < 1:
            raise ValueError(f"device_pages must be an int >= 1, got {self.device_pages!r}")

    def check_disk(self) -> None:
        """``ValueError`` unless a disk tier may go behind these budgets: a host budget and ``disk_pages >= 1``."""
        if self.host_pages is None or not isinstance(self.disk_pages, int) or self.disk_pages < 1:
            raise ValueError(
                f"a disk tier needs a host budget (host_pages, got {self.host_pages!r}) and disk_pages >= 1 (got {self.disk_pages!r})"
            )


class TieredPages(PageFormat):
    """A pool's pages in the compute dtype, at most ``budgets.device_pages`` of them on its
    device, the rest on the host and, with a ``spill``, on disk behind it (see the module
    docstring). Per-page state beyond arenas indexed by page id (tier rows) is not relocated:
    the pool does not shrink."""

    writes_cpu_slots = True
    """:meth:`write` looks each page's tier up in CPU bookkeeping (``device_row``, ``on_disk``);
    slots on CUDA failed there (found on an H200: quest and shadowkv over ``lru`` on CUDA)."""

    def __init__(self, budgets: TierBudgets, spill: LayerSpill | None = None) -> None:
        if spill is not None:
            budgets.check_disk()
        self.device_pages = budgets.device_pages
        self.host_pages = budgets.host_pages
        """At most this many pages on the host (None: unbounded)."""
        self.spill = spill
        self.disk_pages = budgets.disk_pages if spill is not None else 0
        """At most this many pages on disk (0: no disk tier)."""
        self._leaving_order = lowest_score_first if budgets.placement is None else budgets.placement.leaving_order

    def create(self, capacity: int) -> None:
        rows = min(self.device_pages, max(capacity, MIN_HOST_PAGES))  # grows up to the budget as needed
        self.keys = torch.zeros(rows, self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(rows, self.page_size, self.value_dim, dtype=self.dtype, device=self.device)
        self._device_free = FreeStack(rows)
        self.host = HostArena(self.page_size, self.head_dim, self.value_dim, self.dtype, self.device)
        self.disk = DiskPages(self.spill, self.disk_pages, capacity)
        self.device_row = torch.full((capacity,), -1, dtype=torch.int64)
        self.host_row = torch.full((capacity,), -1, dtype=torch.int64)
        self.placement_state = PlacementState(capacity, self._leaving_order)
        self.moves_to_host = self.moves_to_device = self.moves_to_disk = 0
        """Pages moved onto each tier since creation."""
        self.pages_read = self.host_pages_read = self.prefetched_pages_read = 0
        """Pages read (whole pages, any tier), of those, host pages copied to the device without
        moving, and host or disk pages taken from a prefetch, since creation."""
        self._pending = PendingFetch()
        self._staging = StagingArena()
        self.staged_bytes = 0
        """Keys and values bytes the last :meth:`paged_layer` staged (its transient workspace)."""

    def grow(self, capacity: int) -> None:
        self.device_row = extend_rows(self.device_row, capacity, -1)
        self.host_row = extend_rows(self.host_row, capacity, -1)
        self.disk.grow(capacity)
        self.placement_state.grow(capacity)

    @property
    def page_score(self) -> torch.Tensor:
        """Placement score of each page (float32, CPU): higher stays on the device; ``+inf`` until ranked."""
        return self.placement_state.score

    @property
    def on_disk(self) -> torch.Tensor:
        """Per page id (bool, CPU): whether the page lies on disk."""
        return self.disk.on_disk

    @property
    def pages_on_device(self) -> int:
        return self.keys.shape[0] - self._device_free.free

    @property
    def pages_on_host(self) -> int:
        return self.host.held

    @property
    def pages_on_disk(self) -> int:
        return self.disk.count

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of keys and values held on each tier (``device``, ``host``, ``disk``: the pages'
        bytes, not counting their records' headers)."""
        return {
            "device": self.pages_on_device * self.pool.kv_page_bytes,
            "host": self.pages_on_host * self.pool.kv_page_bytes,
            "disk": self.pages_on_disk * self.pool.kv_page_bytes,
        }

    def bytes_reserved(self) -> int:
        rows = self.keys.shape[0] + self.host.rows + self._staging.rows(self.keys, self.values)
        return rows * self.pool.kv_page_bytes + self.pool.capacity * self.pool.position_page_bytes

    def allocated(self, ids: torch.Tensor, heads: torch.Tensor | None) -> None:
        """New pages take device rows, as many as half its budget allows; the rest wait unplaced
        (no row, no record: they read as zeros) until written, as every new page is right after
        allocation (:meth:`write`, :meth:`copy_pages` stream them through the device). They count
        as just used and score ``+inf`` until ranked. If the tiers cannot take them,
        :class:`PoolExhaustedError` (the pool frees them again; pages already held only moved)."""
        self._pending.settle()
        self.placement_state.allocated(ids)
        self._to_device_rows(ids[-max(1, self.device_pages // 2) :])

    def _make_host_room(self, count: int, keep: torch.Tensor) -> None:
        """Make room on the host for ``count`` more pages, counting the host pages in ``keep`` (on
        their way to the device) as gone: spill the first other host pages in the placement's
        order to disk. :class:`PoolExhaustedError`, nothing moved, when the host is full and no
        disk tier (or not enough of one) takes the excess."""
        if self.host_pages is None:
            return
        leaving = int((self.host_row[keep] >= 0).sum())
        excess = self.pages_on_host - leaving + count - self.host_pages
        if excess <= 0:
            return
        self.disk.check_room(excess, count, self.host_pages)
        resident = (self.host_row >= 0).nonzero().squeeze(-1)
        resident = resident[~torch.isin(resident, keep)]
        if resident.numel() < excess:
            raise PoolExhaustedError(f"host tier full: {count} pages needed at once; its budget is {self.host_pages} pages")
        self._to_disk(self.placement_state.leaving(resident, "host")[:excess])

    def _to_disk(self, ids: torch.Tensor) -> None:
        """Move host pages ``ids`` to disk (one transaction; if it fails nothing moved)."""
        rows = self.host_row[ids]
        positions = self.pool.positions.index_select(0, to_arena_device(ids, self.device))
        self.disk.put(ids, *self.host.load(rows, "cpu"), positions)
        self.host.release(rows)
        self.host_row[ids] = -1
        self.moves_to_disk += ids.numel()

    def freed(self, ids: torch.Tensor) -> None:
        self._pending.settle()
        self.disk.drop(ids)
        on_device, on_host = self.device_row[ids], self.host_row[ids]
        self._device_free.push(on_device[on_device >= 0])
        self.host.release(on_host[on_host >= 0])
        self.device_row[ids] = -1
        self.host_row[ids] = -1

    def _to_device_rows(self, ids: torch.Tensor) -> None:
        """Give pages ``ids`` (new ones, or pages on the host or disk) device rows, moving the first
        other device pages in the placement's order to the host (and host pages to disk) to make
        room. Spilled pages' records are read and checked before anything moves."""
        wanted = ids
        if wanted.numel() > self.device_pages:
            raise ValueError(f"{wanted.numel()} pages needed on the device at once; its budget is {self.device_pages} pages")
        ids = ids[self.device_row[ids] < 0]
        if ids.numel() == 0:
            return
        spilled = ids[self.on_disk[ids]]
        fetched = self.disk.get(spilled, self.device) if spilled.numel() else None  # checked before anything moves
        short = ids.numel() - self._device_free.free
        if short > 0 and self.keys.shape[0] < self.device_pages:  # room left in the budget: grow first
            self._grow_device(min(self.device_pages, max(2 * self.keys.shape[0], self.keys.shape[0] + short)))
            short = ids.numel() - self._device_free.free
        if short > 0:
            self._make_host_room(short, keep=wanted)
            resident = (self.device_row >= 0).nonzero().squeeze(-1)
            resident = resident[~torch.isin(resident, wanted)]  # never the pages asked for
            self._to_host(self.placement_state.leaving(resident, "device")[:short])
        rows = self._device_free.pop(ids.numel())
        coming = self.host_row[ids] >= 0
        if bool(coming.any()):  # pages on the host come back with their data
            source = self.host_row[ids[coming]]
            target = to_arena_device(rows[coming], self.device)
            keys, values = self.host.load(source, self.device)
            self.keys.index_copy_(0, target, keys)
            self.values.index_copy_(0, target, values)
            self.host.release(source)
            self.host_row[ids[coming]] = -1
            self.moves_to_device += int(coming.sum())
        if fetched is not None:  # spilled pages come back from their records, which go
            target = to_arena_device(rows[self.on_disk[ids]], self.device)
            self.keys.index_copy_(0, target, fetched[0].to(self.device, non_blocking=True))
            self.values.index_copy_(0, target, fetched[1].to(self.device, non_blocking=True))
            self.disk.drop(spilled)
            self.moves_to_device += spilled.numel()
        self.device_row[ids] = rows

    def rank(self, ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Give pages ``ids`` (int64, in use) placement ``scores`` (float, CPU; a page named more than
        once takes its highest), then move onto the device the ``device_pages`` pages in use that
        come last in the placement's order, the others leaving it in that order, to the host
        and, when it is full, on to disk; in batches of at most the host budget (so the host can
        take each)."""
        self._pending.settle()
        self.placement_state.rank(ids, scores)
        in_use = (self.pool.refcount > 0).nonzero().squeeze(-1)
        staying = self.placement_state.leaving(in_use, "device").flip(0)[: self.device_pages]
        coming = staying[self.device_row[staying] < 0]
        step = min(self.device_pages, self.host_pages or self.device_pages)
        for first in range(0, coming.numel(), step):  # each batch displaces the device pages leaving first
            self._to_device_rows(coming[first : first + step])

    def _grow_device(self, rows: int) -> None:
        self.keys = extend_rows(self.keys, rows, 0)
        self.values = extend_rows(self.values, rows, 0)
        self._device_free.grow(rows)

    def _to_host(self, ids: torch.Tensor) -> None:
        """Move device pages ``ids`` to the host arena (one batched copy)."""
        if ids.numel() == 0:
            return
        source = to_arena_device(self.device_row[ids], self.device)
        rows = self.host.store(self.keys.index_select(0, source).to("cpu"), self.values.index_select(0, source).to("cpu"))
        self._device_free.push(self.device_row[ids])
        self.device_row[ids] = -1
        self.host_row[ids] = rows
        self.moves_to_host += ids.numel()

    def write(self, slots: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens through the device, at most half its budget of pages at a time (a long
        prefill streams through: its earlier pages move to the host as later ones arrive)."""
        self._pending.settle()
        page_of = slots // self.page_size
        pages = torch.unique(page_of)
        step = max(1, self.device_pages // 2)
        for first in range(0, pages.numel(), step):
            batch = pages[first : first + step]
            self._to_device_rows(batch)
            self.placement_state.used(batch)
            chosen = torch.isin(page_of, batch)
            where = chosen.nonzero().squeeze(-1)
            target = to_arena_device(self.device_row[page_of[where]] * self.page_size + slots[where] % self.page_size, self.device)
            rows = to_arena_device(where, keys.device)
            self.keys.view(-1, self.head_dim).index_copy_(0, target, keys.index_select(0, rows))
            self.values.view(-1, self.value_dim).index_copy_(0, target, values.index_select(0, rows))

    def paged_layer(self, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """A block table's tokens where the page kernel reads them (see
        :meth:`~kvlib.storage.pools.page_pool.PagePool.paged_layer`); no :meth:`page_source` (pages may be off the device):
        device pages at their device rows; the table's host and spilled pages, each once, copied
        into staging rows after the device rows (read as :meth:`read_pages` reads them: from a
        prefetch that holds them, else from the host or their records; no page moves tier). The
        positions arena is indexed by the same rows and holds exactly the rows the table names.
        Valid until the next change to the pool or its next ``paged_layer`` (which restages).
        Read by the paged kernel of the pool's device (:func:`~kvlib.devices.paged_kernel`: numba
        on the CPU, the torch path on CUDA); None on a device that reads layers densely."""
        if not reads_pages_in_place(self.device):
            return None
        keys, values, positions, table = self.staged_arenas(pages)
        return PagedLayer(arena_source_for(keys, values, positions), table, lengths)

    def staged_arenas(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages ``pages`` (page ids, any shape, ``-1`` for none) in one arena each of keys, values
        and positions: the device rows, then the off-device pages among ``pages`` staged after
        them, each once (see :meth:`paged_layer`, :mod:`~kvlib.storage.pools.staging_arena`); and
        ``pages`` as rows of those arenas (``-1`` kept). Sets :attr:`staged_bytes`. Valid until the
        next change to the pool or its next staging."""
        first = self.keys.shape[0]
        keys, values, positions, table, staged = self._staging.stage(
            self.keys, self.values, self.pool.positions, self.device_row, pages, self.read_pages
        )
        self.keys, self.values = keys[:first], values[:first]
        self.staged_bytes = staged * self.pool.kv_page_bytes
        return keys, values, positions, table

    def read_pages(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages: device ones gathered, host and spilled ones taken from the prefetch of
        them if one holds them unchanged, else host ones copied over and spilled ones read from
        their (checked) records; free ones zero (none moves, and reading is not a use: every
        decode step reads every page). A read ends the pending prefetch."""
        self._pending.settle()
        on_device, on_host = self.device_row[ids], self.host_row[ids]
        keys = torch.zeros(ids.numel(), self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        values = torch.zeros(ids.numel(), self.page_size, self.value_dim, dtype=self.dtype, device=self.device)
        here = (on_device >= 0).nonzero().squeeze(-1)
        if here.numel():
            source, target = to_arena_device(on_device[here], self.device), to_arena_device(here, self.device)
            keys.index_copy_(0, target, self.keys.index_select(0, source))
            values.index_copy_(0, target, self.values.index_select(0, source))
        elsewhere = on_device < 0
        self.pages_read += ids.numel()
        self.host_pages_read += int((on_host >= 0).sum())
        filled = self._pending.fill(
            ids, keys, values, stamps=self.placement_state.last_use[ids], in_use=self.pool.refcount[ids] > 0, wanted=elsewhere
        )
        self.prefetched_pages_read += int(filled.sum())
        elsewhere &= ~filled
        there = ((on_host >= 0) & elsewhere).nonzero().squeeze(-1)
        if there.numel():
            target = to_arena_device(there, self.device)
            host_keys, host_values = self.host.load(on_host[there], self.device)
            keys.index_copy_(0, target, host_keys)
            values.index_copy_(0, target, host_values)
        spilled = (self.on_disk[ids] & elsewhere).nonzero().squeeze(-1)
        if spilled.numel():
            disk_keys, disk_values = self.disk.get(ids[spilled], self.device)
            target = to_arena_device(spilled, self.device)
            keys.index_copy_(0, target, disk_keys.to(self.device, non_blocking=True))
            values.index_copy_(0, target, disk_values.to(self.device, non_blocking=True))
        return keys, values

    def prefetch(self, ids: torch.Tensor, prefetcher: PagePrefetcher) -> None:
        """Start fetching the host and spilled pages among ``ids`` (page ids, any order, repeats
        and free pages ignored) on ``prefetcher``'s worker, for the next :meth:`read_pages`
        (replacing a prefetch not read yet); host pages only if the prefetcher fetches them. See
        :mod:`kvlib.storage.pools.page_prefetch`."""
        self._pending.settle()
        ids = torch.unique(ids)
        ids = ids[(self.pool.refcount[ids] > 0) & (self.device_row[ids] < 0)]
        host_ids = ids[self.host_row[ids] >= 0] if prefetcher.fetch_host else ids[:0]
        disk_ids = ids[self.on_disk[ids]]
        self._pending.start(
            prefetcher,
            host=self.host,
            host_ids=host_ids,
            host_rows=self.host_row[host_ids],
            spill=self.spill,
            disk_ids=disk_ids,
            stamps=self.placement_state.last_use[torch.cat([host_ids, disk_ids])],
        )

    def copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages onto new ``target`` pages: a write, so targets land on the device,
        streamed in half-budget batches (each batch's sources read before its targets move in)."""
        self._pending.settle()
        step = max(1, self.device_pages // 2)
        for first in range(0, target.numel(), step):
            keys, values = self.read_pages(source[first : first + step])
            batch = target[first : first + step]
            self._to_device_rows(batch)
            self.placement_state.used(batch)
            rows = to_arena_device(self.device_row[batch], self.device)
            self.keys.index_copy_(0, rows, keys)
            self.values.index_copy_(0, rows, values)
