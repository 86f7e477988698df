"""A what-if copy of the KV manager's pages, for the scheduler to plan on without changing them.

A :class:`PageForecast` starts from the free pages of each layer and the prefix index as they
are, and counts what the plan's decisions would do: a reclaim evicts unused cached blocks, least
recently used first (each frees one page per KV head in every layer: an unused entry's pages
are held by the index alone); a preemption frees the pages only the victim's sequence holds and
releases its index entries (those it alone used join the LRU, newest last, and the index evicts
the oldest unused ones while it holds more than its capacity); an admission takes its cached
prefix (those entries are no longer reclaimable) and starts computing its next blocks. The
store, the index, the requests and the queues are never changed: applying the plan does that
(:meth:`~kvlib.adapters.engine.scheduler.Scheduler.apply`), and ends where the forecast did. This is the
concrete :class:`~kvlib.adapters.engine.scheduler.Forecast` the KV manager hands the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from kvlib.adapters.engine.engine_request import Request
from kvlib.storage.prefix.prefix_index import Entry
from kvlib.storage.prefix.prefix_store import PrefixStore


class KVPages(Protocol):
    """What a forecast reads of the KV manager (:class:`~kvlib.adapters.engine.kv_manager.KVManager`);
    pages per layer, tokens per sequence."""

    page_size: int
    prefix: PrefixStore | None
    every_layer_slides: bool
    """Whether every layer slides over a window (then no layer holds all of a sequence's tokens)."""

    @property
    def fixed(self) -> bool:
        """Whether the pools have a fixed capacity (otherwise they grow and are never short)."""

    def free_pages_by_layer(self) -> list[int]: ...

    def pages_for(self, held: int, tokens: int | np.ndarray) -> int | np.ndarray: ...

    def stored_tokens(self, request: Request) -> int: ...

    def swap_in_pages(self, request: Request) -> int: ...

    def released_pages(self, request: Request) -> list[int]: ...

    def uses_prefix(self, request: Request) -> bool: ...

    def lookup_blocks(self, request: Request) -> list[list[int]]: ...

    def block_keys(self, request: Request) -> list[bytes]: ...

    def tail_tokens(self, request: Request, cached: int) -> int: ...


class PageForecast:
    """The pages of ``kv`` after the decisions counted so far, ``running`` being the requests
    running when the plan starts (oldest first). ``reclaimed`` lists the prefix index entries
    the forecast evicted, in order: the plan's reclaim."""

    def __init__(self, kv: KVPages, running: Sequence[Request]) -> None:
        self._kv = kv
        self._free = kv.free_pages_by_layer()
        self._running = list(running)
        self._admitted: dict[Request, int] = {}
        """Requests the plan admits, with the tokens their cached prefix holds."""
        self.reclaimed: list[Entry] = []
        self._evicted: set[bytes] = set()
        self._acquired: set[bytes] = set()
        """Keys of the entries planned admissions hold (no longer reclaimable)."""
        self._users: dict[bytes, int] = {}
        """Users of the entries planned preemptions released (the rest as the index counts them)."""
        self._released: list[Entry] = []
        """Entries planned preemptions left unused, in the order they join the LRU."""
        index = kv.prefix.index if kv.prefix is not None else None
        self._lru: Iterator[Entry] = iter(index.lru.values()) if index is not None else iter(())
        self._next_released = 0
        self._overflow = index.nbytes - index.capacity_bytes if index is not None else 0
        """Bytes the index holds over its capacity (evicted as soon as entries fall unused)."""
        self._in_flight: set[bytes] | None = None

    # -- counts ----------------------------------------------------------------------------------

    def free_pages(self) -> int:
        """Pages free in the layer with the fewest free pages."""
        return min(self._free)

    def computed(self, request: Request) -> int:
        """Tokens ``request``'s sequence holds (after a planned admission: its cached prefix)."""
        return self._admitted.get(request, request.computed)

    def pages_for(self, request: Request, tokens: int | np.ndarray) -> int | np.ndarray:
        """Pages (per layer, at most) that running ``tokens`` more tokens of ``request`` allocates,
        after the tokens its sequence holds (fewer than it has computed under eviction, or where
        every layer slides over a window); elementwise for an integer array of ``tokens``."""
        held = self.computed(request)
        if (request.evictor is not None or self._kv.every_layer_slides) and request.seq is not None:
            held = self._kv.stored_tokens(request)
        return self._kv.pages_for(held, tokens)

    def cached_tokens(self, request: Request) -> int:
        """Leading tokens of a waiting request that the prefix cache holds once the planned
        reclaims are done (whole pages, never its last token)."""
        kv = self._kv
        if not kv.uses_prefix(request):
            return 0
        blocks = kv.lookup_blocks(request)
        keys = kv.block_keys(request)[: len(blocks)]
        cached = kv.prefix.cached_blocks(keys, blocks)
        evicted = next((i for i, key in enumerate(keys[:cached]) if key in self._evicted), cached)
        return evicted * kv.page_size + kv.tail_tokens(request, evicted * kv.page_size)

    def admission_pages(self, request: Request, tokens: int | np.ndarray) -> int | np.ndarray:
        """Pages a waiting request's first chunk of ``tokens`` computed tokens allocates after its
        cached prefix (elementwise for an integer array)."""
        return self._kv.pages_for(self.cached_tokens(request), tokens)

    def swap_in_pages(self, request: Request) -> int:
        """Pages a swapped request needs to come back."""
        return self._kv.swap_in_pages(request)

    def in_flight(self, request: Request) -> bool:
        """Whether ``request``'s next uncached block is one a running (or admitted) request is
        about to compute."""
        kv = self._kv
        if not kv.uses_prefix(request):
            return False
        if self._in_flight is None:
            self._in_flight = set()
            for other in self._running + list(self._admitted):
                computed = self.computed(other)
                if other.evictor is None and len(other.tokens) - computed > 1:
                    self._in_flight.update(kv.block_keys(other)[computed // kv.page_size :])
        keys = kv.block_keys(request)
        first = self.cached_tokens(request) // kv.page_size
        return first < len(keys) and keys[first] in self._in_flight

    def held_pages(self, request: Request) -> int:
        """Pages (per layer, at most) a running request holds beyond the cached prefix it attached
        (0 for one this plan admits)."""
        if request in self._admitted:
            return 0
        return self._kv.pages_for(request.attached_tokens, request.computed - request.attached_tokens)

    # -- decisions -------------------------------------------------------------------------------

    def reclaim(self, pages: int) -> None:
        """Evict unused cached blocks, least recently used first, until ``pages`` more pages are
        free in every layer or none is left."""
        if self._kv.prefix is None:
            return
        target = self.free_pages() + pages
        while self.free_pages() < target and self._evict_oldest():
            pass

    def preempt(self, request: Request) -> None:
        """Count the pages ``request``'s sequence alone holds as free, and its index entries as
        released."""
        if self._kv.fixed:
            self._free = [free + pages for free, pages in zip(self._free, self._kv.released_pages(request))]
        if not request.entries or self._kv.prefix is None:
            return
        for entry in request.entries:
            users = self._users.get(entry.key, entry.users) - 1
            self._users[entry.key] = users
            if users == 0:
                self._released.append(entry)
        while self._overflow > 0 and self._evict_oldest():
            pass

    def admit(self, request: Request) -> None:
        """Count ``request`` as running, holding its cached prefix."""
        kv = self._kv
        if not kv.uses_prefix(request):
            self._admitted[request] = request.computed
            return
        cached = self.cached_tokens(request)
        blocks = cached // kv.page_size
        self._admitted[request] = cached
        keys = kv.block_keys(request)
        self._acquired.update(keys[:blocks])
        if self._in_flight is not None:  # requests admitted later in this plan wait for its blocks
            self._in_flight.update(keys[blocks:])

    def _evict_oldest(self) -> bool:
        """Count the least recently used unused entry as evicted; False when none is left."""
        entry = self._oldest_unused()
        if entry is None:
            return False
        self.reclaimed.append(entry)
        self._evicted.add(entry.key)
        self._overflow -= entry.nbytes
        if self._kv.fixed:
            heads = entry.pages[1].shape[-1]  # [layers, kv heads]: one page per head in every layer
            self._free = [free + heads for free in self._free]
        return True

    def _oldest_unused(self) -> Entry | None:
        """The least recently used entry no planned admission holds: the index's LRU first, then
        the entries planned preemptions released, in order."""
        for entry in self._lru:
            if entry.key not in self._acquired:
                return entry
        while self._next_released < len(self._released):
            entry = self._released[self._next_released]
            self._next_released += 1
            if entry.key not in self._acquired:
                return entry
        return None
