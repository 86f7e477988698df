"""``PrefixStore``: prompt prefixes computed once and reused across ``generate`` calls.

A ``PrefixStore`` outlives the caches that use it. It owns the paged stores their sequences
live in (one per *namespace*: compute dtype, device, page size and the spec that produced the
pages) and a :class:`~kvlib.storage.prefix.prefix_index.PrefixIndex` of full prompt pages. A cache made with
``kvlib.make_cache(model, reuse=store, prompt=ids)`` starts holding, by reference, the longest
cached prefix of ``ids`` (whole pages, and never the prompt's last token, whose logits the model
must compute); ``generate`` then runs the model on the rest only. After its prefill the cache
indexes the prompt's full pages it computed, so later prompts reuse them.

Keys: every page key includes the model's fingerprint (:mod:`kvlib.model_identity`: its class,
config and every byte of its weights), so a fine-tuned or edited model never meets the original's
pages, in memory or on disk; a cache for a model without that fingerprint is refused. Besides
the model, keys are token ids: no tokenizer is part of them (the KV of token ids depends on the
model alone).

What is reusable: pages of exact caches, and pages of caches with a codec (keyed by the codec's
spec: a lossless request never meets lossy pages, and two codecs never share). Caches that evict
index nothing: after eviction a page no longer holds a run of consecutive prompt tokens. A whole
compressed context can be held instead (:attr:`PrefixStore.contexts`, in memory, keyed by the
model, the cache's spec and budget and the context's ids) and forked for each question that
follows it: :func:`kvlib.adapters.compressed_context`.

Memory: every indexed page holds one reference from the index; pages a live cache uses hold its
references too. Entries no cache uses sit in an LRU and are evicted, least recently used first,
while the index holds more than ``capacity_bytes``; their pages are freed once no sequence holds
them.

Disk (``disk=DiskTier(path, capacity_bytes)`` or a path): every block indexed is also written
to an lmdb block record (write-through, :mod:`~kvlib.storage.records.prefix_block_record`), keyed by the
namespace's digest (model, codec spec, dtype, device, page size, salt) and the chain key; a
lookup that runs out of blocks in memory goes on on disk, loading verified records into fresh
pages. A new process with the same model thus reuses prefixes an earlier one computed. A coded
cache's pages go to disk as the codec's encoded fields (codes, scales, zero points), and come
back sealed, bit for bit what was written: never decoded on the way. Namespaces of codecs fitted
to data (low-rank bases) stay in memory only, and a block whose pages are not all sealed is not
written. ``DiskTier(..., entropy=True)`` writes records entropy-coded
(:mod:`~kvlib.storage.records.entropy_code`); either kind is read. A prompt whose blocks do not all fit in the
tier's capacity has its leading blocks written (as many as fit), and a block larger than the
whole capacity none; either way the store warns once. A directory that cannot hold a tier
(read-only, say) gives one warning and the store keeps prefixes in memory only; a damaged one is
moved aside by the tier, which starts empty (:mod:`~kvlib.storage.tiers.lmdb_files`): a disk tier never
takes the process down, and a record that fails any check is a counted miss.

Remote (``remote=RemoteTier(url, key=...)`` or a ``redis://host:port/db`` URL with ``remote_key=``
or ``$KVLIB_REMOTE_KEY``; without a key only with ``remote_trust="any-writer"``, for a private
server): every block indexed is also written to the Redis-protocol server
(:mod:`~kvlib.storage.tiers.remote_tier`) as the same checked record, tagged with the key, in one
pipelined batch per insert; a lookup goes on from memory to disk to the server, reading the
blocks still missing in one round trip and verifying each against its tag, chain key, parent and
token ids before it is loaded. Processes (or hosts) pointing at one server share prefixes. A
server that is down, slow, restarted or full, and a record that is corrupt, untagged or another
namespace's, are counted misses: the blocks are computed as without the tier. The tier's
``hits`` count the records loaded, not those that arrived.

Threads: a store may serve caches in several threads. Every method holds :attr:`PrefixStore.lock`
(a re-entrant lock), and a cache living in the store's paged store (shared by all its caches)
holds it for each model call and for each of its own calls that change the store
(:meth:`KVCache.enter_call <kvlib.adapters.KVCache.enter_call>`): the threads' generations
interleave call by call, never inside one. The disk and remote tiers are used under the same lock.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
import warnings
from collections.abc import Callable, Sequence
from functools import partial

import torch

from kvlib.devices import outside_inference_mode
from kvlib.model_identity import ModelIdentity
from kvlib.storage.prefix.held_contexts import HeldContexts
from kvlib.storage.prefix.prefix_index import Entry, PrefixIndex
from kvlib.storage.records.prefix_block_record import BlockLayout, FieldBlock, decode_parts, encode
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.open_tiers import disk_tier, remote_tier
from kvlib.storage.tiers.remote_tier import RemoteTier


def _locked(method: Callable) -> Callable:
    """``method`` of a :class:`PrefixStore` run holding its :attr:`~PrefixStore.lock`."""

    @functools.wraps(method)
    def run(store: PrefixStore, *args, **kwargs):
        with store.lock:
            return method(store, *args, **kwargs)

    return run


class PrefixStore:
    """Prompt prefixes of one model, reused across caches and ``generate`` calls.

    Args:
        model: the model whose caches use this store (its fingerprint keys every page; taking it
            hashes every weight once per model object, see :mod:`kvlib.model_identity`).
        capacity_bytes: bytes of indexed pages kept once no cache uses them (LRU beyond that).
        salt: mixed into every key (separate tenants that must never share pages).
        disk: a :class:`~kvlib.storage.tiers.disk_tier.DiskTier`, or a directory for one holding up to
            four times ``capacity_bytes`` of records (one that cannot hold a tier: a warning, and
            memory only); None keeps prefixes in memory only.
        disk_key: the secret tagging disk records (a directory's tier only; None reads
            ``$KVLIB_DISK_KEY``, and without it records are unkeyed: anyone who can write the
            directory can change outputs; see :mod:`~kvlib.storage.tiers.disk_tier`).
        remote: a :class:`~kvlib.storage.tiers.remote_tier.RemoteTier`, or the URL of a Redis-protocol
            server for one (``redis://host:port/db``); None: no remote tier.
        remote_key: the secret tagging remote records (a URL's tier only; None reads
            ``$KVLIB_REMOTE_KEY``; a URL with neither is refused unless ``remote_trust``).
        remote_trust: ``"key"`` (default: a URL's tier needs a key) or ``"any-writer"``: unkeyed
            records, which anyone who can write to the server can forge (a private server only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        capacity_bytes: int,
        *,
        salt: str = "",
        disk: DiskTier | str | None = None,
        disk_key: str | bytes | None = None,
        remote: RemoteTier | str | None = None,
        remote_key: str | bytes | None = None,
        remote_trust: str = "key",
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if not isinstance(salt, str):
            raise ValueError(f"salt must be a str, got {salt!r}")
        remote = remote_tier(remote, remote_key, remote_trust)  # a missing key fails before the weights are hashed
        self.identity = ModelIdentity(model)
        self.fingerprint = self.identity.fingerprint
        self.salt = salt
        self.index = PrefixIndex(capacity_bytes, self._evicted)
        self.contexts = HeldContexts(capacity_bytes)
        """Whole caches of computed contexts (compressed ones: :func:`~kvlib.adapters.compressed_context`),
        handed out as forks; keyed by :meth:`context_key`, within their own ``capacity_bytes``."""
        self.stores: dict[str, PagedStore] = {}
        """Paged stores by namespace (see :meth:`namespace`)."""
        self.disk = disk_tier(disk, capacity_bytes=max(capacity_bytes, 1) * 4, key=disk_key)
        self.remote = remote
        self._closing: list = []
        """Sessions of caches garbage-collected since the last use (closed by :meth:`collect`)."""
        self._warned_disk_full = False
        """Whether blocks left out of the disk tier for its capacity were warned about (once)."""
        self.lock = threading.RLock()
        """Held by every method, and by the caches in this store's paged store while they change it."""

    def defer_close(self, session: object) -> None:
        """Close ``session`` at the next use of this store (called from a cache's finalizer)."""
        self._closing.append(session)

    @outside_inference_mode
    @_locked
    def collect(self) -> None:
        """Release what garbage-collected caches held (their sequences and index entries)."""
        while self._closing:
            self._closing.pop().close()

    def namespace(self, spec: str, dtype: torch.dtype, device: torch.device, page_size: int) -> str:
        """The name of the pages a cache of ``spec`` (``""``: exact) produces in ``dtype`` on ``device``."""
        return f"{spec}|{dtype}|{device}|{page_size}|{self.salt}"

    @_locked
    def paged_store(self, namespace: str, build: Callable[[], PagedStore]) -> PagedStore:
        """The paged store of ``namespace``, built by ``build()`` the first time."""
        self.collect()
        if namespace not in self.stores:
            self.stores[namespace] = build()
        return self.stores[namespace]

    def key_space(self, namespace: str) -> bytes:
        """What every chain key of ``namespace`` hashes besides tokens: the model's fingerprint and the namespace."""
        return self.fingerprint + namespace.encode()

    def record_namespace(self, namespace: str) -> bytes:
        """The 16-byte digest naming ``namespace`` in records and tier keys."""
        return hashlib.blake2b(self.key_space(namespace), digest_size=16).digest()

    def context_key(self, namespace: str, context_ids: torch.Tensor) -> bytes:
        """The key of a whole context (int ``[batch, tokens]``) computed by caches of ``namespace``
        (its spec naming everything that shaped the cache, budget included) in :attr:`contexts`:
        the model's fingerprint, the namespace and every token id, hashed."""
        ids = context_ids.detach().to("cpu", torch.int64).contiguous()
        digest = hashlib.blake2b(self.key_space(namespace), digest_size=32)
        digest.update(repr(tuple(ids.shape)).encode())
        digest.update(ids.numpy().tobytes())
        return digest.digest()

    def block_keys(self, namespace: str, blocks: list[list[int]], known: Sequence[bytes] = ()) -> list[bytes]:
        """The chain keys of ``blocks`` (consecutive token blocks from a prompt's start) in
        ``namespace``, extending ``known``, those of the leading blocks computed before."""
        return self.index.keys(blocks, self.key_space(namespace), known)

    @_locked
    def cached_blocks(self, keys: list[bytes], blocks: list[list[int]]) -> int:
        """How many leading blocks (with chain ``keys``) are in memory now, verified against
        their token ids; no counter or LRU order changes (a peek for scheduling)."""
        count = 0
        for key, tokens in zip(keys, blocks):
            entry = self.index.entries.get(key)
            if entry is None or entry.tokens != tuple(tokens):
                break
            count += 1
        return count

    @_locked
    def lookup(self, namespace: str, blocks: list[list[int]], *, load: bool = True) -> list[Entry]:
        """Cached entries of the leading ``blocks`` of a prompt (verified), most recently used now;
        with ``load``, blocks found on disk, then on the remote tier, past those in memory are
        loaded into fresh pages and indexed. The entries are acquired for the caller (so that
        loading more cannot evict them): attach them, and :meth:`release` those not attached."""
        self.collect()
        found = self.index.lookup(blocks, self.key_space(namespace))
        self.index.acquire(found)
        layout = self._record_layout(namespace) if load else None
        if layout is not None and len(found) < len(blocks):
            found += self._load(namespace, layout, blocks, len(found))
        return found

    @_locked
    def fetch(self, namespace: str, blocks: list[list[int]]) -> int:
        """Bring the leading ``blocks`` found on disk or the remote tier into memory (indexed,
        unused: in the LRU), so that a scheduler sees them with :meth:`cached_blocks` before it
        plans; returns how many leading blocks memory holds now."""
        entries = self.lookup(namespace, blocks)
        self.release(entries)
        return len(entries)

    @property
    def tiered(self) -> bool:
        """Whether lookups go on past memory (a disk or remote tier)."""
        return self.disk is not None or self.remote is not None

    @outside_inference_mode
    def _load(self, namespace: str, layout: BlockLayout, blocks: list[list[int]], first: int) -> list[Entry]:
        """Entries for ``blocks[first:]`` read from disk, then from the remote tier, while their
        records check out."""
        keys = self.index.keys(blocks, self.key_space(namespace))
        loaded: list[Entry] = []
        index = first
        if self.disk is not None:
            run: list[FieldBlock | None] = []
            while index + len(run) < len(blocks):
                block = self.disk.get(layout.namespace + keys[index + len(run)], partial(decode_parts, layout))
                if block is None:
                    break
                run.append(block)
            index = self._restore_run(namespace, layout, keys, blocks, index, run, loaded)
        if self.remote is not None and index < len(blocks):
            remote = self.remote.get_many([layout.namespace + key for key in keys[index:]], lambda record: decode_parts(layout, [record]))
            restored = self._restore_run(namespace, layout, keys, blocks, index, remote, loaded) - index
            self.remote.count_use(sum(block is not None for block in remote), restored)
        return loaded

    def _restore_run(
        self,
        namespace: str,
        layout: BlockLayout,
        keys: list[bytes],
        blocks: list[list[int]],
        index: int,
        run: list[FieldBlock | None],
        loaded: list[Entry],
    ) -> int:
        """Restore ``run`` (records read for blocks ``index, index + 1, ...``) into ``loaded`` until
        one is missing or does not check out; returns the index of the first block not restored.
        The pages of the leading records that arrived are reserved in one growth of each layer's
        arena (block by block, the arenas grew and were copied every few blocks)."""
        arrived = next((i for i, block in enumerate(run) if block is None), len(run))
        for pool in self.stores[namespace].pools:
            pool.reserve(arrived * layout.heads)
        for block in run:
            entry = self._restore(namespace, layout, keys, blocks, index, block)
            if entry is None:
                break
            loaded.append(entry)
            index += 1
        return index

    def _restore(
        self, namespace: str, layout: BlockLayout, keys: list[bytes], blocks: list[list[int]], index: int, block: FieldBlock | None
    ) -> Entry | None:
        """The entry (acquired for the caller) of block ``index`` restored from ``block`` into fresh
        pages, or None when ``block`` is missing, is not that block (chain key, parent, token ids)
        or the index keeps another copy."""
        parent = keys[index - 1] if index else b""
        if block is None or block.key != keys[index] or block.parent != parent or block.tokens != list(blocks[index]):
            return None
        store = self.stores[namespace]
        positions = torch.arange(index * store.page_size, (index + 1) * store.page_size).repeat(layout.heads, 1)
        pages = []
        for layer, pool in enumerate(store.pools):
            ids = pool.allocate(layout.heads, torch.arange(layout.heads))
            pool.restore_pages(ids, block.layers[layer], positions)
            pages.append(ids)
        pages = torch.stack(pages)
        nbytes = sum(pool.page_footprint() for pool in store.pools) * layout.heads
        entry = self.index.insert(keys[index], parent, blocks[index], (namespace, pages), nbytes)
        if entry is None or entry.pages[1] is not pages:  # a collision, or another holder: keep memory's
            for layer, pool in enumerate(store.pools):
                pool.decref(pages[layer])
            if entry is not None:
                self.index.release([entry])
            return None
        return entry

    def _record_layout(self, namespace: str) -> BlockLayout | None:
        """The record layout of ``namespace``, or None when its pages go to no tier (no disk or
        remote tier, or a pool whose pages a record cannot hold: a codec fitted to data)."""
        store = self.stores.get(namespace)
        if (self.disk is None and self.remote is None) or store is None:
            return None
        fields = [pool.record_fields() for pool in store.pools]
        if any(layer is None for layer in fields):
            return None
        digest = self.record_namespace(namespace)
        layers = tuple(tuple(layer.items()) for layer in fields)
        entropy = self.disk is not None and self.disk.entropy
        return BlockLayout(digest, store.tables[0].num_heads, store.page_size, layers, entropy=entropy)

    @outside_inference_mode
    @_locked
    def attach(self, namespace: str, seq: int, entries: list[Entry]) -> None:
        """Give empty sequence ``seq`` the pages of ``entries`` (by reference; acquired by
        :meth:`lookup`, released when the sequence's holder is done)."""
        store = self.stores[namespace]
        if entries:
            pages = torch.stack([entry.pages[1] for entry in entries], dim=-1)  # [layers, heads, blocks]
            for layer in range(store.num_layers):
                store.attach_prefix(layer, seq, pages[layer])

    @outside_inference_mode
    @_locked
    def insert(self, namespace: str, seq: int, blocks: list[list[int]], first: int, known: Sequence[bytes] = ()) -> list[Entry]:
        """Index blocks ``first..`` of ``seq`` (its full pages holding ``blocks``' tokens); the
        index takes a reference on their pages. Returns the entries, acquired for the caller.
        ``known``: chain keys of the leading blocks the caller computed before (not hashed again).

        Invariant: the caller holds only entries whose pages ``seq`` holds. A block the index
        already has on other pages (a copy computed by another sequence, or by this request
        before it was swapped out) is left to the index and not returned: holding it would pin
        a second copy of the block that ``seq`` never reads, so a request could hold more pages
        than its own tokens fill (and, alone under a page budget that fits it, never finish)."""
        store = self.stores[namespace]
        keys = self.index.keys(blocks, self.key_space(namespace), known)
        held, new = [], []
        for block in range(first, len(blocks)):
            pages = torch.stack([store.tables[layer].pages[seq, :, block] for layer in range(store.num_layers)])
            nbytes = sum(store.pools[layer].page_footprint() for layer in range(store.num_layers)) * pages.shape[1]
            parent = keys[block - 1] if block else b""
            entry = self.index.insert(keys[block], parent, blocks[block], (namespace, pages), nbytes)
            if entry is None:  # a colliding key: this block and the ones after it stay uncached
                break
            if entry.pages[1] is pages:  # a new entry: the index holds the pages from now on
                for layer in range(store.num_layers):
                    store.pools[layer].incref(pages[layer])
                new.append(entry)
            elif not torch.equal(entry.pages[1], pages):  # another copy: its holders', or reclaimable
                self.index.release([entry])
                continue
            held.append(entry)
        self._persist(namespace, new)
        return held

    @outside_inference_mode
    def _persist(self, namespace: str, entries: list[Entry]) -> None:
        """Write the blocks of ``entries`` to the disk tier in one commit and to the remote tier in
        one pipelined batch: each block's pages as their pools hold them
        (:meth:`~kvlib.storage.pools.page_pool.PagePool.record_pages`), the leading blocks whose pages a
        record can hold (on disk: and whose records fit in the tier). Remote records are written
        plain (no entropy decode on the read path that a remote hit is meant to make fast)."""
        layout = self._record_layout(namespace)
        if layout is None or not entries:
            return
        store, blocks = self.stores[namespace], []
        for entry in entries:
            pages = entry.pages[1]
            layers = [pool.record_pages(pages[layer]) for layer, pool in enumerate(store.pools)]
            if any(fields is None for fields in layers):
                break
            block = FieldBlock(entry.key, entry.parent, list(entry.tokens), [{name: t.cpu() for name, t in f.items()} for f in layers])
            blocks.append(block)
        keys = [layout.namespace + block.key for block in blocks]
        if self.disk is not None:
            items = self._fitting([(key, encode(layout, block)) for key, block in zip(keys, blocks)])
            if items:
                self.disk.put_many(items)
        if self.remote is not None and blocks:
            plain = dataclasses.replace(layout, entropy=False) if layout.entropy else layout
            self.remote.put_many([(key, encode(plain, block)) for key, block in zip(keys, blocks)])

    def _fitting(self, items: list[tuple[bytes, bytes | memoryview]]) -> list[tuple[bytes, bytes | memoryview]]:
        """The leading ``items`` (key, record) that fit in the disk tier's capacity together (one
        commit holds them all); warns once when some are left out."""
        capacity, total, count = self.disk.capacity_bytes, 0, 0
        for _, record in items:
            if total + len(record) > capacity:
                break
            total += len(record)
            count += 1
        if count < len(items) and not self._warned_disk_full:
            self._warned_disk_full = True
            needed = sum(len(record) for _, record in items)
            warnings.warn(
                f"kvlib PrefixStore: {len(items)} prompt blocks need {needed} bytes on disk, more than the disk tier's"
                f" capacity of {capacity} bytes: only the first {count} are written (raise the disk tier's capacity_bytes"
                " to keep whole prompts)",
                RuntimeWarning,
                stacklevel=2,
            )
        return items[:count]

    @_locked
    def release(self, entries: list[Entry]) -> None:
        """A cache stops using ``entries`` (they may now be evicted)."""
        self.index.release(entries)

    def _evicted(self, entry: Entry) -> None:
        namespace, pages = entry.pages
        store = self.stores[namespace]
        for layer in range(store.num_layers):
            store.pools[layer].decref(pages[layer])

    @_locked
    def stats(self) -> dict[str, int]:
        """Hits and misses (blocks), evictions, collisions, entries and bytes indexed (after
        releasing what garbage-collected caches held)."""
        self.collect()
        return self.index.stats()
