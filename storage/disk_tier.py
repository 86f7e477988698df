"""The disk tier: page records in an lmdb environment, bounded in bytes, safe across processes.

Keys are ``namespace digest + chain key`` (32 bytes), so a directory written by another model,
dtype, codec or salt never answers for this one. Values are :mod:`~kvlib.storage.page_record`
records (header, raw bytes, checksum; never pickled).

Guarantees, from lmdb and this module:

- a write is one lmdb transaction: a process killed (even by SIGKILL) mid-write leaves the last
  committed state, never a partial record;
- a record whose header or checksum fails is a miss: counted (``corrupt``), deleted, never
  returned;
- the records' bytes stay within ``capacity_bytes``: the least recently read or written records
  are evicted first; the map grows as needed up to that budget; when lmdb reports the disk or
  map full, writing stops with one warning and generation goes on;
- several processes may use one directory: lmdb serialises writers and lets readers run;
- within a process, threads other than the writer's may read (a page prefetch reads spilled
  pages): they hold :attr:`DiskTier.resize_lock` during a read transaction, and the map is
  only resized under it (lmdb resizes only with no transaction active in the process).

Bookkeeping lives in named databases beside the records: ``atime`` (key -> u64 access clock)
and ``meta`` (total record bytes, the clock). Live sequences' spilled pages use two more
(``spill``, ``runs``: see :mod:`~kvlib.storage.spill_store`); they are outside the LRU and the
byte total above, and opening a tier deletes those of runs whose process is gone.
"""

from __future__ import annotations

import struct
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import lmdb

from kvlib.storage.spill_store import sweep_dead_runs

_U64 = struct.Struct("<Q")
_OVERHEAD = 2.0
"""Map size over record bytes: lmdb's pages, free lists and the bookkeeping databases."""
_MIN_MAP = 1 << 24


_OPEN: weakref.WeakValueDictionary[Path, DiskTier] = weakref.WeakValueDictionary()
"""The tiers open in this process, by resolved directory (see :func:`open_disk_tier`)."""


def open_disk_tier(path: str | Path, capacity_bytes: int) -> DiskTier:
    """The :class:`DiskTier` at ``path`` already open in this process (its capacity raised to
    ``capacity_bytes`` if lower), or a new one holding up to ``capacity_bytes`` of prefix
    records: lmdb allows one environment per file per process, so a prefix store and spilling
    caches given the same directory share one."""
    key = Path(path).resolve()
    tier = _OPEN.get(key)
    if tier is None or tier.closed:
        tier = DiskTier(path, capacity_bytes)
        _OPEN[key] = tier
    elif capacity_bytes > tier.capacity_bytes:
        tier.extend_limit(capacity_bytes - tier.capacity_bytes)
        tier.capacity_bytes = capacity_bytes
    return tier


class DiskTier:
    """Page records in the lmdb environment at ``path`` (created if missing), at most
    ``capacity_bytes`` of record bytes."""

    def __init__(self, path: str | Path, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.limit = max(_MIN_MAP, int(capacity_bytes * _OVERHEAD))
        self.env = lmdb.open(str(self.path), map_size=min(self.limit, _MIN_MAP), max_dbs=5, subdir=True, writemap=True)
        self.records = self.env.open_db(b"records")
        self.atime = self.env.open_db(b"atime")
        self.meta = self.env.open_db(b"meta")
        self.env.reader_check()  # reader slots of dead processes
        self.swept_runs = sweep_dead_runs(self.env)
        """Spill runs of dead processes deleted when this tier was opened."""
        self.reads = self.writes = self.misses = self.corrupt = self.evictions = 0
        self._touched: dict[bytes, None] = {}
        """Keys read since the last write, oldest first: their access clocks advance at the next
        commit (reads commit nothing)."""
        self.stopped = False
        """True once a full disk stopped writing (warned once)."""
        self.closed = False
        self.resize_lock = threading.Lock()
        """Held while the map is resized and by reads from threads other than the writer's."""

    # -- reading -------------------------------------------------------------------------------

    def get(self, key: bytes, check) -> object | None:
        """``check(record)`` of the record under ``key``, or None if absent or if ``check`` raises
        ``ValueError`` (a corrupt or foreign record: counted and deleted). ``record`` is a buffer
        into the map, valid during the call only: ``check`` copies what it keeps."""
        value, found = None, False
        with self.env.begin(db=self.records, buffers=True) as txn:
            record = txn.get(key)
            if record is not None:
                found = True
                try:
                    value = check(record)
                except ValueError:
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

    def keys(self) -> list[bytes]:
        """Every stored key (for checks and clean-up)."""
        with self.env.begin(db=self.records) as txn:
            return [bytes(k) for k, _ in txn.cursor()]

    def raw(self, key: bytes) -> bytes | None:
        """The stored bytes under ``key`` unchecked (tests and tools only)."""
        with self.env.begin(db=self.records) as txn:
            value = txn.get(key)
            return bytes(value) if value is not None else None

    @property
    def nbytes(self) -> int:
        """Record bytes stored."""
        with self.env.begin(db=self.meta) as txn:
            return _get_u64(txn, b"bytes")

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: bytes, record: bytes) -> bool:
        """Store ``record`` under ``key`` (replacing it); see :meth:`put_many`."""
        return self.put_many([(key, record)])

    def put_many(self, items: list[tuple[bytes, bytes]]) -> bool:
        """Store every ``(key, record)`` in one transaction (one durable commit), evicting least
        recently used records to stay within capacity. False (and nothing changed) when it
        cannot: more bytes than the capacity, or the disk or map is full (then writing stops,
        with one warning)."""
        incoming = sum(len(record) for _, record in items)
        if self.stopped or not items or incoming > self.capacity_bytes:
            return False
        try:
            self.transact(incoming, lambda txn: self._put(txn, items))
        except lmdb.MapFullError:
            self._stop("the lmdb map is full at the byte budget")
            return False
        except lmdb.Error as error:  # disk full or unwritable: stop writing, go on without the tier
            self._stop(f"{type(error).__name__}: {error}")
            return False
        self.writes += len(items)
        return True

    def _put(self, txn: lmdb.Transaction, items: list[tuple[bytes, bytes]]) -> None:
        self._record_touches(txn)
        total = _get_u64(txn, b"bytes", self.meta)
        keys = {key for key, _ in items}
        for key in keys:
            old = txn.get(key, db=self.records)
            if old is not None:
                total -= len(old)
        need = total + sum(len(record) for _, record in items) - self.capacity_bytes
        if need > 0:
            total -= self._evict(txn, need, keep=keys)
        clock = _get_u64(txn, b"clock", self.meta)
        for key, record in items:
            clock += 1
            txn.put(key, record, db=self.records)
            txn.put(key, _U64.pack(clock), db=self.atime)
            total += len(record)
        txn.put(b"clock", _U64.pack(clock), db=self.meta)
        txn.put(b"bytes", _U64.pack(total), db=self.meta)

    def _evict(self, txn: lmdb.Transaction, need: int, keep: set[bytes]) -> int:
        """Delete least recently used records (not in ``keep``) until ``need`` bytes are free; returns the bytes freed."""
        order = sorted((_U64.unpack(v)[0], bytes(k)) for k, v in txn.cursor(db=self.atime))
        freed = 0
        for _, key in order:
            if freed >= need:
                break
            if key in keep:
                continue
            value = txn.get(key, db=self.records)
            if value is not None:
                freed += len(value)
                txn.delete(key, db=self.records)
            txn.delete(key, db=self.atime)
            self.evictions += 1
        return freed

    def _delete(self, key: bytes) -> None:
        try:
            with self.env.begin(write=True) as txn:
                value = txn.get(key, db=self.records)
                if value is not None:
                    txn.delete(key, db=self.records)
                    txn.put(b"bytes", _U64.pack(max(0, _get_u64(txn, b"bytes", self.meta) - len(value))), db=self.meta)
                txn.delete(key, db=self.atime)
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
        if self._touched:
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
        limit; then ``lmdb.MapFullError`` (or another ``lmdb.Error``) propagates, nothing written."""
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

    def _stop(self, why: str) -> None:
        if not self.stopped:
            warnings.warn(f"kvlib disk tier at {self.path}: stopped writing ({why}); generation goes on without it", stacklevel=3)
        self.stopped = True

    def stats(self) -> dict[str, int]:
        return {"reads": self.reads, "writes": self.writes, "misses": self.misses, "corrupt": self.corrupt,
                "evictions": self.evictions, "bytes": self.nbytes}

    def close(self) -> None:
        self.flush()
        self.env.close()
        self.closed = True


def _get_u64(txn: lmdb.Transaction, key: bytes, db=None) -> int:
    value = txn.get(key, db=db) if db is not None else txn.get(key)
    return _U64.unpack(value)[0] if value is not None else 0
