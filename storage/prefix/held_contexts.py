"""Computed contexts kept for reuse: one cache per context, handed out as forks.

A prefix index (:mod:`kvlib.storage.prefix.prefix_index`) reuses pages that hold runs of consecutive prompt
tokens. A context compressed by eviction (KVzip's query-agnostic cache) holds no such runs: each
head kept its own tokens. What can be reused is the whole compressed cache, for any question
that follows the same context: :class:`HeldContexts` keeps such caches by key and hands out
forks (pages shared, copy-on-write), so a held cache stays as it was whatever its forks are used
for, and N questions cost one compression plus their own tokens.

Memory: a held cache's pages stay allocated while it is held (forks share them). Caches are
dropped least recently used first while their bytes exceed ``capacity_bytes`` (each counted by
its ``memory_report()`` pages when it was held); a dropped cache is reset, and its pages are
freed once no fork uses them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class ForkableCache(Protocol):
    """What a held cache offers (:class:`~kvlib.adapters.KVCache` does)."""

    def fork(self) -> ForkableCache: ...

    def reset(self) -> None: ...

    def memory_report(self) -> dict: ...


class HeldContexts:
    """Caches by key (LRU by bytes). Invariant: ``nbytes`` is the sum of the held caches' bytes
    and, after each :meth:`hold`, at most ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[bytes, tuple[ForkableCache, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def hold(self, key: bytes, cache: ForkableCache) -> bool:
        """Keep a fork of ``cache`` under ``key`` (replacing what the key held); least recently
        used caches are dropped while the bytes held exceed the capacity. False (nothing kept)
        when ``cache`` alone is larger than the capacity."""
        size = int(cache.memory_report()["by_component"]["pages"])
        if size > self.capacity_bytes:
            return False
        self.drop(key)
        self._held[key] = (cache.fork(), size)
        self.nbytes += size
        while self.nbytes > self.capacity_bytes:
            oldest = next(iter(self._held))
            self.drop(oldest)
            self.evictions += 1
        return True

    def fork(self, key: bytes) -> ForkableCache | None:
        """A fork of the cache held under ``key`` (now the most recently used), or None."""
        held = self._held.get(key)
        if held is None:
            self.misses += 1
            return None
        self.hits += 1
        self._held.move_to_end(key)
        return held[0].fork()

    def drop(self, key: bytes) -> None:
        """Stop holding ``key``'s cache (nothing if none); its pages go once no fork uses them."""
        held = self._held.pop(key, None)
        if held is not None:
            held[0].reset()
            self.nbytes -= held[1]
