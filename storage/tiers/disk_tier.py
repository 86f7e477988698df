"""The disk tier: page records in an lmdb environment, bounded in bytes, safe across processes.

Keys are ``namespace digest + chain key`` (32 bytes), so a directory written by another model,
dtype, codec or salt never answers for this one. Values are :mod:`~kvlib.storage.records.prefix_block_record`
records (header, page fields, checksum; never pickled), each stored as an index entry and parts of
at most 8 lmdb pages (:mod:`~kvlib.storage.records.record_parts`); readers get the parts as they lie in
the map and copy them out once.

Guarantees, from lmdb and this module:

- a write is one lmdb transaction: a process killed (even by SIGKILL) mid-write leaves the last
  committed state, never a partial record or a mix of two records' parts;
- a record whose entry, parts, header or checksum fails is a miss: counted (``corrupt``),
  deleted with all its parts, never returned (an entry of an earlier layout, a whole record in
  one value, fails its entry check);
- the records' bytes stay within ``capacity_bytes``: the least recently read or written records
  are evicted first (every part of each); the map grows as needed up to that budget; when lmdb
  reports the disk or map full, writing stops with one warning and generation goes on;
- several processes may use one directory: lmdb serialises writers and lets readers run;
- a damaged directory never takes the process down: lmdb reads nothing of ``data.mdb`` before
  it passes py-lmdb's verifier; a damaged one is moved aside (one warning) and the tier starts
  empty, and a directory that cannot hold a tier raises
  :class:`~kvlib.errors.DiskTierUnavailable` (see :mod:`~kvlib.storage.tiers.lmdb_files`); a file cut
  short while open makes reads misses and stops the tier (one warning);
- a directory removed or replaced while open (``data.mdb`` no longer the file the tier opened:
  deleted, or another file in its place) is noticed before each write of prefix records (a
  ``stat`` beside the file's ``fstat``): a record written there would reach no other process and
  no later store, so writing stops with one warning and is not counted (what the tier held is
  still read); :func:`~kvlib.storage.tiers.open_tiers.open_disk_tier` opens a new environment on that path;
- within a process, threads other than the writer's may read (a page prefetch reads spilled
  pages): they hold :attr:`DiskTier.resize_lock` during a read transaction, and the map is
  only resized under it (lmdb resizes only with no transaction active in the process).

Keys: what an unkeyed tier trusts is the directory: anyone who can write it (this user, and a
group the directory is writable by; :mod:`~kvlib.storage.tiers.lmdb_files` refuses directories of other
users or writable by everyone) can change what a record says, and a record that passes its
checksum (XXH3, which anyone can recompute) is decoded. With ``key=`` (or ``$KVLIB_DISK_KEY``; a
secret as for the remote tier, :mod:`~kvlib.storage.tiers.tier_keys`) every record also gets a 32-byte
BLAKE2b tag keyed by it over its key and bytes (database ``tags``; spilled pages carry theirs
after the record), checked in constant time before the record is used: a record written or
changed without the key is a corrupt record (a counted miss, deleted). Records are not
encrypted on disk. Tagging costs a BLAKE2b pass, ~900 MB/s here (a 394 KB record: ~0.4 ms).

Bookkeeping lives in named databases beside the records (``records``: the entries, ``parts``):
``atime`` (key -> u64 access clock, one per record) and ``meta`` (total record bytes, the
clock). Live sequences' spilled pages use two more (``spill``, ``runs``: see
:mod:`~kvlib.storage.tiers.spill_store`); they are outside the LRU and the byte total above, and
opening a tier deletes those of runs no process holds the lock of (:mod:`~kvlib.storage.tiers.spill_runs`).

The environment is opened without ``writemap``: a put copies into pages lmdb allocates and a
commit writes them with ``writev`` (at most 64 parts, 2 MB, a call) and syncs. With a writable
map every page of a growing file was instead faulted in (read as zeros, then copied into) and
write-protected again by the sync: ``tier_bench`` measured record writes at 25% of raw file
writes that way, whole records in one value each.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import warnings
import weakref
from collections.abc import Callable, Collection
from pathlib import Path

import lmdb

from kvlib.storage.records import record_parts
from kvlib.storage.tiers.lmdb_files import committed_bytes, open_environment
from kvlib.storage.tiers.spill_runs import sweep_dead_runs
from kvlib.storage.tiers.tier_keys import subkey, tier_master_key

KEY_ENV = "KVLIB_DISK_KEY"
"""The environment variable holding a disk tier's key when ``key=None``."""
TAG_BYTES = 32

_U64 = struct.Struct("<Q")
_OVERHEAD = 2.0
"""Map size over record bytes: lmdb's pages, free lists and the bookkeeping databases."""
_MIN_MAP = 1 << 24
_PART_PAGES = 8
"""lmdb pages per record part (see :mod:`~kvlib.storage.records.record_parts`)."""
_PAGE_HEADER = 16
"""Bytes of lmdb's header on a run of overflow pages (64-bit builds): a part of ``_PART_PAGES *
page size - _PAGE_HEADER`` bytes fills its pages exactly."""


def tag_key(key: str | bytes | None) -> bytes | None:
    """The 32-byte key tagging a disk tier's records for secret ``key`` (None: ``$KVLIB_DISK_KEY``,
    and without it None: unkeyed); ``ValueError`` naming what is valid for a weak secret."""
    secret = key if key is not None else os.environ.get(KEY_ENV) or None
    if secret is None:
        return None
    return subkey(tier_master_key(secret, "disk_key" if key is not None else f"${KEY_ENV}"), "disk record tag")


class TierLostError(lmdb.Error):
    """A write to a tier whose ``data.mdb`` was cut short while open (see :meth:`DiskTier.intact`)."""


Record = bytes | bytearray | memoryview | list
"""A record to store: bytes-like, or a list of bytes-like chunks that joined are the record."""


class DiskTier:
    """Page records in the lmdb environment at ``path`` (created if missing; verified, and
    moved aside if damaged), at most ``capacity_bytes`` of record bytes.
    :class:`~kvlib.errors.DiskTierUnavailable` if the directory cannot hold one.

    ``entropy=True``: prefix block records are written entropy-coded
    (:mod:`~kvlib.storage.records.prefix_block_record`, :mod:`~kvlib.storage.records.entropy_code`): fewer bytes on
    disk, a decode pass on every read. Records of either kind are read whatever the option.

    ``key``: a secret (bytes of at least 16, or a passphrase of at least 20 characters; None reads
    ``$KVLIB_DISK_KEY``, and without it the tier is unkeyed) tagging every record: only records
    tagged with it are read (see the module docstring).

    Threads: one writer thread; other threads may read under :attr:`resize_lock` (see above)."""

    def __init__(self, path: str | Path, capacity_bytes: int, *, entropy: bool = False, key: str | bytes | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        if not isinstance(entropy, bool):
            raise ValueError(f"entropy must be True or False, got {entropy!r}")
        self.tag_key = tag_key(key)
        """32 bytes keying every record's tag, or None (an unkeyed tier: it trusts the directory)."""
        self.entropy = entropy
        """Whether prefix block records are written entropy-coded."""
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.limit = max(_MIN_MAP, int(capacity_bytes * _OVERHEAD))
        self.env = open_environment(self.path, map_size=min(self.limit, _MIN_MAP), max_dbs=8)
        self.records = self.env.open_db(b"records")
        """Record entries by key (:mod:`~kvlib.storage.records.record_parts`)."""
        self.parts = self.env.open_db(b"parts")
        self.tags = self.env.open_db(b"tags")
        """Record tags by key (a keyed tier's; an unkeyed tier's writes delete them)."""
        self.page_bytes = self.env.stat()["psize"]
        """lmdb's page size."""
        self.part_bytes = _PART_PAGES * self.page_bytes - _PAGE_HEADER
        self._data = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        """The data file lmdb maps (its inode, even once renamed): :meth:`intact` checks its size."""
        self._close_data = weakref.finalize(self, os.close, self._data)
        self.atime = self.env.open_db(b"atime")
        self.meta = self.env.open_db(b"meta")
        self.env.reader_check()  # reader slots of dead processes
        self.swept_runs = sweep_dead_runs(self.env, self.path)
        """Spill runs of dead processes deleted when this tier was opened."""
        self.reads = self.writes = self.misses = self.corrupt = self.evictions = 0
        self.dropped = 0
        """Records :meth:`put_many` was given and did not store (over the capacity, a full disk,
        a tier lost or detached): each lost write is counted, none is silent."""
        self._touched: dict[bytes, None] = {}
        """Keys read since the last write, oldest first: their access clocks advance at the next
        commit (reads commit nothing)."""
        self.stopped = False
        """True once a full disk stopped writing (warned once)."""
        self.lost = False
        """True once ``data.mdb`` was found cut short while open (warned once): every read is then
        a miss and nothing is written."""
        self.detached = False
        """True once ``data.mdb`` at :attr:`path` was found not to be the file this tier opened
        (warned once): prefix records are no longer written."""
        self.closed = False
        self.resize_lock = threading.Lock()
        """Held while the map is resized and by reads from threads other than the writer's."""

    # -- reading -------------------------------------------------------------------------------

    def get(self, key: bytes, check: Callable[[list[memoryview]], object]) -> object | None:
        """``check(parts)`` of the record under ``key``, or None if absent, if its parts are not
        all there, or if ``check`` raises ``ValueError`` (a corrupt or foreign record: counted and
        deleted). ``parts`` are buffers into the map whose concatenation is the record, valid
        during the call only: ``check`` copies what it keeps. A read lmdb reports failing (a
        damaged page) is a corrupt record too; with ``data.mdb`` cut short since it was opened,
        every read is a miss (see :meth:`intact`)."""
        if not self.intact():
            self.misses += 1
            return None
        value, found = None, True
        with self.env.begin(buffers=True) as txn:
            try:
                parts = record_parts.read(txn, self.records, self.parts, key)
                found = parts is not None
                value = check(parts) if found and self._tagged(txn, key, parts) else None
            except (ValueError, lmdb.Error):
                value = None
        if not found:
            self.misses += 1
            return None
        if value is None:
            self.corrupt += 1
            self._delete(key)
            return None
        self.reads += 1
        self._touched[key] = None  # recorded with the next write (no commit per read)
        return value

    def tag(self, key: bytes, chunks: Collection[bytes | memoryview]) -> bytes:
        """The keyed tag of the record ``chunks`` (joined) stored under ``key`` (a keyed tier only)."""
        hasher = hashlib.blake2b(key=self.tag_key, digest_size=TAG_BYTES, person=b"kvlib disk tag")
        hasher.update(_U64.pack(len(key)))
        hasher.update(key)
        for chunk in chunks:
            hasher.update(chunk)
        return hasher.digest()

    def tag_matches(self, key: bytes, chunks: Collection[bytes | memoryview], tag: bytes | memoryview | None) -> bool:
        """Whether ``tag`` is the record's keyed tag (compared in constant time); True for an unkeyed tier."""
        return self.tag_key is None or (tag is not None and hmac.compare_digest(bytes(tag), self.tag(key, chunks)))

    def _tagged(self, txn: lmdb.Transaction, key: bytes, parts: list[memoryview]) -> bool:
        return self.tag_key is None or self.tag_matches(key, parts, txn.get(key, db=self.tags))

    def keys(self) -> list[bytes]:
        """Every stored key (for checks and clean-up)."""
        with self.env.begin(db=self.records) as txn:
            return [bytes(k) for k, _ in txn.cursor()]

    def raw(self, key: bytes) -> bytes | None:
        """The record under ``key`` unchecked, its parts joined (tests and tools only); None if
        absent or its parts are not all there."""
        with self.env.begin(buffers=True) as txn:
            try:
                parts = record_parts.read(txn, self.records, self.parts, key)
            except ValueError:
                return None
            return None if parts is None else b"".join(parts)

    @property
    def nbytes(self) -> int:
        """Record bytes stored."""
        with self.env.begin(db=self.meta) as txn:
            return _get_u64(txn, b"bytes")

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: bytes, record: Record) -> bool:
        """Store ``record`` under ``key`` (replacing it); see :meth:`put_many`."""
        return self.put_many([(key, record)])

    def put_many(self, items: list[tuple[bytes, Record]]) -> bool:
        """Store every ``(key, record)`` in one transaction (one durable commit), evicting least
        recently used records to stay within capacity; a record is bytes-like, or a list of
        bytes-like chunks that joined are the record (stored without joining them), and the
        last one of a repeated key wins. False (and nothing changed) when it cannot: more bytes
        than the capacity, or the disk or map is full (then writing stops, with one warning)."""
        records = {
            key: [memoryview(chunk).cast("B") for chunk in (record if isinstance(record, list) else [record])] for key, record in items
        }
        incoming = sum(chunk.nbytes for chunks in records.values() for chunk in chunks)
        if self.stopped or incoming > self.capacity_bytes or not self.attached():
            self.dropped += len(records)
            return False
        if not items:
            return False
        try:
            self.transact(incoming, lambda txn: self._put(txn, records, incoming))
        except lmdb.MapFullError:
            self._stop("the lmdb map is full at the byte budget")
            self.dropped += len(records)
            return False
        except lmdb.Error as error:  # disk full or unwritable: stop writing, go on without the tier
            self._stop(f"{type(error).__name__}: {error}")
            self.dropped += len(records)
            return False
        self.writes += len(records)
        return True

    def _put(self, txn: lmdb.Transaction, records: dict[bytes, list[memoryview]], incoming: int) -> None:
        self._record_touches(txn)
        total = _get_u64(txn, b"bytes", self.meta)
        for key in records:
            total -= record_parts.delete(txn, self.records, self.parts, key)
        if total + incoming > self.capacity_bytes:
            total -= self._evict(txn, total + incoming - self.capacity_bytes, keep=records.keys())
        clock = _get_u64(txn, b"clock", self.meta)
        for key, chunks in records.items():
            clock += 1
            record_parts.put(txn, self.records, self.parts, key, chunks, self.part_bytes)
            txn.put(key, _U64.pack(clock), db=self.atime)
            if self.tag_key is not None:
                txn.put(key, self.tag(key, chunks), db=self.tags)
            else:
                txn.delete(key, db=self.tags)
        txn.put(b"clock", _U64.pack(clock), db=self.meta)
        txn.put(b"bytes", _U64.pack(total + incoming), db=self.meta)

    def _evict(self, txn: lmdb.Transaction, need: int, keep: Collection[bytes]) -> int:
        """Delete least recently used records (not in ``keep``), every part of each, until
        ``need`` bytes are free; returns the bytes freed."""
        order = sorted((_U64.unpack(v)[0], bytes(k)) for k, v in txn.cursor(db=self.atime))
        freed = 0
        for _, key in order:
            if freed >= need:
                break
            if key in keep:
                continue
            freed += record_parts.delete(txn, self.records, self.parts, key)
            txn.delete(key, db=self.atime)
            txn.delete(key, db=self.tags)
            self.evictions += 1
        return freed

    def _delete(self, key: bytes) -> None:
        try:
            with self.env.begin(write=True) as txn:
                freed = record_parts.delete(txn, self.records, self.parts, key)
                txn.put(b"bytes", _U64.pack(max(0, _get_u64(txn, b"bytes", self.meta) - freed)), db=self.meta)
                txn.delete(key, db=self.atime)
                txn.delete(key, db=self.tags)
        except lmdb.Error:
            pass

    def _record_touches(self, txn: lmdb.Transaction) -> None:
        """Advance the access clocks of the keys read since the last write (in ``txn``)."""
        if not self._touched:
            return
        clock = _get_u64(txn, b"clock", self.meta)
        for key in self._touched:
            if txn.get(key, db=self.records) is not None:
                clock += 1
                txn.put(key, _U64.pack(clock), db=self.atime)
        txn.put(b"clock", _U64.pack(clock), db=self.meta)
        self._touched.clear()

    def flush(self) -> None:
        """Commit the access clocks of reads since the last write."""
        if self._touched and self.intact():
            try:
                with self.env.begin(write=True) as txn:
                    self._record_touches(txn)
            except lmdb.Error:
                self._touched.clear()

    def extend_limit(self, nbytes: int) -> None:
        """Let the map grow by room for ``nbytes`` more bytes of records kept outside the LRU
        (spilled pages, bounded by their own budget)."""
        self.limit += int(nbytes * _OVERHEAD)

    def transact(self, incoming: int, body: Callable[[lmdb.Transaction], None]) -> None:
        """Run ``body`` in one write transaction (all or nothing), the map grown ahead of
        ``incoming`` bytes and again (the transaction redone) while lmdb reports it full, up to the
        limit; then ``lmdb.MapFullError`` (or another ``lmdb.Error``) propagates, nothing written;
        :class:`TierLostError` once the tier is lost (:meth:`intact`)."""
        if not self.intact():
            raise TierLostError(f"data.mdb at {self.path} was cut short while open")
        self._reserve(incoming)
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    body(txn)
                return
            except lmdb.MapFullError:
                if not self._grow():
                    raise

    def _reserve(self, incoming: int) -> None:
        """Grow the map ahead of a write of ``incoming`` bytes (a write that hits a full map is
        redone after growing, which costs the whole write again)."""
        info, stat = self.env.info(), self.env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
        needed = used + int(incoming * 1.5) + (1 << 20)
        if needed > info["map_size"] and info["map_size"] < self.limit:
            with self.resize_lock:
                self.env.set_mapsize(min(self.limit, max(2 * info["map_size"], needed)))

    def _grow(self) -> bool:
        size = self.env.info()["map_size"]
        if size >= self.limit:
            return False
        with self.resize_lock:
            self.env.set_mapsize(min(self.limit, 2 * size))
        return True

    def intact(self) -> bool:
        """False once ``data.mdb`` was found shorter than lmdb's last commit needs (truncated while
        open: a read there would be a SIGBUS): then, with one warning, the tier is :attr:`lost`. A
        ``fstat`` per call; a truncation between it and a read is not caught. Threads other than
        the writer's call it holding :attr:`resize_lock` (it reads lmdb's meta page in the map)."""
        if not self.lost and os.fstat(self._data).st_size < committed_bytes(self.env, self.page_bytes):
            self.lost = self.stopped = True
            self._warn("data.mdb was cut short while open; its reads are misses and nothing is written from now on")
        return not self.lost

    def attached(self) -> bool:
        """Whether ``data.mdb`` at :attr:`path` is still the file this tier opened (same device and
        inode, still linked): not once its directory was removed or replaced, or the file deleted
        or renamed over. Then, with one warning, writing stops (:attr:`detached`): records written
        to a file no other process can open would be lost. A ``stat`` and an ``fstat`` per call."""
        if not self.detached:
            opened = os.fstat(self._data)
            try:
                current = os.stat(self.path / "data.mdb")
                same = (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino) and opened.st_nlink > 0
            except OSError:
                same = False
            if not same:
                self.detached = self.stopped = True
                self._warn(
                    "the directory was removed or its data.mdb replaced while open; records written now would reach"
                    " no other process, so writing stops (a new store on this path opens a new tier)"
                )
        return not self.detached

    def _stop(self, why: str) -> None:
        if not self.stopped:
            self._warn(f"stopped writing ({why}); generation goes on without it")
        self.stopped = True

    def _warn(self, what: str) -> None:
        """One warning about this tier, naming its path, at the caller of the method that calls this."""
        warnings.warn(f"kvlib disk tier at {self.path}: {what}", stacklevel=4)

    def stats(self) -> dict[str, int]:
        return {
            "reads": self.reads,
            "writes": self.writes,
            "misses": self.misses,
            "corrupt": self.corrupt,
            "evictions": self.evictions,
            "dropped": self.dropped,
            "bytes": self.nbytes,
        }

    def close(self) -> None:
        self.flush()
        self.env.close()
        self._close_data()
        self.closed = True


def _get_u64(txn: lmdb.Transaction, key: bytes, db=None) -> int:
    value = txn.get(key, db=db) if db is not None else txn.get(key)
    return _U64.unpack(value)[0] if value is not None else 0
