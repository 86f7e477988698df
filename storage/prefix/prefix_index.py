"""The prefix index: token blocks keyed by a hash chain, with users, an LRU and a byte capacity.

A prompt is cut into blocks of ``page_size`` tokens. Block ``i``'s key is
``hash(key of block i - 1, its token ids, namespace)``, so one key names a whole prefix; the
namespace carries everything the pages' contents depend on besides the tokens (model
fingerprint, dtype, the policies that produced the pages, a salt). A hit is verified against
the stored token ids and parent key, so a hash collision can never return another prefix's
pages: it is a miss.

Invariants (``tests/storage/prefix/test_prefix_index.py`` checks them after every step of a hypothesis
state machine):

- an entry's ``users`` counts the holders that acquired it and have not released it; an entry
  is in the LRU exactly when ``users == 0``;
- ``nbytes`` is the sum of the entries' bytes; after :meth:`PrefixIndex.release` and
  :meth:`PrefixIndex.insert` it is at most ``capacity_bytes`` unless entries in use alone
  exceed it (in-use entries are never evicted);
- every eviction calls ``on_evict(entry)`` once, so the owner drops what the entry held.

Touch, acquire, release and evict are O(1) per entry (an ordered dict as the LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

HashFunction = Callable[[bytes, Sequence[int], bytes], bytes]


def chain_hash(parent: bytes, tokens: Sequence[int], namespace: bytes) -> bytes:
    """blake2b (16 bytes) of the parent key, the block's token ids and the namespace."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent)
    digest.update(b"|".join(str(t).encode() for t in tokens))
    digest.update(b"#")
    digest.update(namespace)
    return digest.digest()


@dataclass(eq=False)
class Entry:
    """One cached block: its key, its parent's key (``b""`` for the first block), its token ids,
    what it holds (``pages``, opaque to the index) and its size in bytes."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    pages: object
    nbytes: int
    users: int = 0


@dataclass
class PrefixIndex:
    """Hash-chained blocks with use counts, an LRU of unused entries and a byte capacity.

    ``on_evict(entry)`` is called for each evicted entry (the owner releases its pages);
    ``hash_function`` may be replaced (tests force collisions with it).
    """

    capacity_bytes: int
    on_evict: Callable[[Entry], None]
    hash_function: HashFunction = chain_hash
    entries: dict[bytes, Entry] = field(default_factory=dict)
    lru: OrderedDict[bytes, Entry] = field(default_factory=OrderedDict)
    """Entries with no user, least recently used first."""
    nbytes: int = 0
    hits: int = 0
    """Blocks found (and verified) by lookups."""
    misses: int = 0
    """Lookups that stopped before the prompt's last full block (one per lookup at most)."""
    evictions: int = 0
    collisions: int = 0
    """Lookups or inserts whose key matched an entry holding other tokens or another parent."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {self.capacity_bytes!r}")

    def keys(self, blocks: Sequence[Sequence[int]], namespace: bytes, known: Sequence[bytes] = ()) -> list[bytes]:
        """The chain keys of consecutive token ``blocks``, extending ``known``, the keys of the
        leading blocks computed before (only the blocks after them are hashed: a sequence's keys
        grow in time linear in its length)."""
        keys = list(known[: len(blocks)])
        parent = keys[-1] if keys else b""
        for tokens in blocks[len(keys) :]:
            parent = self.hash_function(parent, tokens, namespace)
            keys.append(parent)
        return keys

    def lookup(self, blocks: Sequence[Sequence[int]], namespace: bytes) -> list[Entry]:
        """The longest run of leading ``blocks`` cached, verified block by block against stored
        token ids and parents; found entries become most recently used. Does not acquire them."""
        found, parent = [], b""
        for tokens, key in zip(blocks, self.keys(blocks, namespace)):
            entry = self.entries.get(key)
            if entry is None:
                break
            if entry.tokens != tuple(tokens) or entry.parent != parent:
                self.collisions += 1
                break
            found.append(entry)
            parent = key
        for entry in found:
            self._touch(entry)
        self.hits += len(found)
        self.misses += len(found) < len(blocks)
        return found

    def insert(self, key: bytes, parent: bytes, tokens: Sequence[int], pages: object, nbytes: int) -> Entry | None:
        """Cache a block under ``key`` and acquire it for the caller (``users`` 1). An existing
        entry with the same tokens and parent is acquired instead (``pages`` are then not held);
        a colliding one (other tokens or parent) leaves the block uncached: returns None."""
        entry = self.entries.get(key)
        if entry is not None:
            if entry.tokens != tuple(tokens) or entry.parent != parent:
                self.collisions += 1
                return None
            self.acquire([entry])
            return entry
        entry = Entry(key, parent, tuple(tokens), pages, nbytes, users=1)
        self.entries[key] = entry
        self.nbytes += nbytes
        self._evict_to_capacity()
        return entry

    def acquire(self, entries: Sequence[Entry]) -> None:
        """A holder starts using ``entries``: they leave the LRU (never evicted while used)."""
        for entry in entries:
            if entry.users == 0:
                self.lru.pop(entry.key, None)
            entry.users += 1

    def release(self, entries: Sequence[Entry]) -> None:
        """A holder stops using ``entries``; unused ones join the LRU (most recent), and the
        least recently used unused entries are evicted while over capacity."""
        for entry in entries:
            if entry.users < 1:
                raise RuntimeError("prefix entry released more often than acquired")
            entry.users -= 1
            if entry.users == 0 and self.entries.get(entry.key) is entry:
                self.lru[entry.key] = entry
        self._evict_to_capacity()

    def evict_oldest(self) -> bool:
        """Evict the least recently used unused entry; False when every entry is in use."""
        if not self.lru:
            return False
        self._evict(next(iter(self.lru.values())))
        return True

    def evict(self, entries: Sequence[Entry]) -> None:
        """Evict those of ``entries`` that are still indexed and unused (a planned reclaim)."""
        for entry in entries:
            if self.lru.get(entry.key) is entry:
                self._evict(entry)

    def demote(self, keys: Sequence[bytes]) -> None:
        """Make the unused entries of ``keys`` the least recently used, the last of ``keys`` first:
        they are the first evicted (used entries and unknown keys are left as they are)."""
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key, last=False)

    def clear(self) -> None:
        """Evict every unused entry."""
        while self.lru:
            self._evict(next(iter(self.lru.values())))

    def _touch(self, entry: Entry) -> None:
        if entry.key in self.lru:
            self.lru.move_to_end(entry.key)

    def _evict_to_capacity(self) -> None:
        while self.nbytes > self.capacity_bytes and self.lru:
            self._evict(next(iter(self.lru.values())))

    def _evict(self, entry: Entry) -> None:
        del self.lru[entry.key]
        del self.entries[entry.key]
        self.nbytes -= entry.nbytes
        self.evictions += 1
        self.on_evict(entry)

    def stats(self) -> dict[str, int]:
        """Hits and misses (blocks), evictions, collisions, entries and bytes indexed, entries no one uses."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "collisions": self.collisions,
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "unused_entries": len(self.lru),
        }
