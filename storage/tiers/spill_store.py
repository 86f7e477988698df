"""Live sequences' pages spilled to the disk tier: sequence-scoped page records, cleaned up.

A :class:`SpillStore` is one *run*: a random 16-byte run id registered in the tier's ``runs``
database, alive while it holds the lock of its lock file (:class:`~kvlib.storage.tiers.spill_runs.RunLock`). Its records live in the ``spill`` database under
``run id + layer (u32) + page id (u64)`` (big endian, so one run's keys are contiguous), one
:mod:`~kvlib.storage.records.spilled_page_record` record per page: namespace = run id, one layer and one head,
the chain key field holding ``layer, page`` (checked on read), the token field the page's
positions. They are outside the tier's LRU: a live page is never evicted; its pool's disk
budget bounds them instead.

Lifetime: a freed page's record is deleted with it; :meth:`SpillStore.close` (also run when the
store is garbage collected or the process exits) deletes the run's records and its
registration; a process killed before that leaves them, and the next :class:`DiskTier` opened
on the directory deletes them (:func:`~kvlib.storage.tiers.spill_runs.sweep_dead_runs`: its lock is
free), leaving prefix records and live runs alone, in this PID namespace or another. Every write is
one lmdb transaction, so a killed writer leaves whole records only.

A full disk: a run that cannot be registered, and pages that cannot be written, raise
:class:`~kvlib.errors.PoolExhaustedError` (the documented error of a tier out of room) with
nothing written; a delete the disk cannot take leaves the records where they are, counted in
:attr:`SpillStore.nbytes` still, until the run closes. The store stays consistent: every page
it holds has its whole record, and ``nbytes`` is never less than what its records take.

Keys: with a keyed tier (:class:`~kvlib.storage.tiers.disk_tier.DiskTier` ``key=``) each record is
followed by a 32-byte keyed BLAKE2b tag over its key and bytes, checked before the record is
used: a page changed by anyone without the key is a lost page, never wrong output.
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass

import lmdb
import numpy as np
import torch

from kvlib.devices import byte_rows, host_staging
from kvlib.errors import PoolExhaustedError
from kvlib.storage.records.spilled_page_record import Block, Layout, check_rows, empty_rows, encode, record_size, row_sections
from kvlib.storage.tiers.disk_tier import TAG_BYTES, DiskTier
from kvlib.storage.tiers.spill_runs import RUN_ENTRY, RUNS_DB, SPILL_DB, RunLock, delete_run_records

_PAGE_KEY = struct.Struct(">IQ")
_RECORD_KEY = struct.Struct(">QQ")


class SpilledPageLost(RuntimeError):
    """A spilled page's record is missing or fails its checks: that sequence's KV is gone.
    ``pages``: the lost page ids where the record says which (empty where the whole file is lost)."""

    def __init__(self, message: str, pages: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.pages = pages


class SpillStore:
    """The spilled pages of one run in ``disk``, at most ``capacity_bytes`` of records (the map
    may grow by that much beyond the tier's own budget)."""

    def __init__(self, disk: DiskTier, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.disk = disk
        self.capacity_bytes = capacity_bytes
        self.run = os.urandom(16)
        self.spill = disk.env.open_db(SPILL_DB)
        self.runs = disk.env.open_db(RUNS_DB)
        self.nbytes = 0
        """Record bytes this run holds."""
        disk.extend_limit(capacity_bytes)
        try:
            lock = RunLock(disk.path, self.run)
        except OSError as error:
            raise PoolExhaustedError(f"disk tier at {disk.path} cannot hold a spill run's lock file ({error.strerror or error})") from None
        try:
            disk.transact(len(RUN_ENTRY), lambda txn: txn.put(self.run, RUN_ENTRY, db=self.runs))
        except lmdb.Error as error:
            lock.release()
            raise PoolExhaustedError(f"disk tier at {disk.path} cannot register a spill run ({type(error).__name__}: {error})") from None
        self._close = weakref.finalize(self, _delete_run, disk, self.spill, self.runs, self.run, lock)

    def layer(self, layer: int, page_size: int, head_dim: int, value_dim: int, dtype: torch.dtype) -> LayerSpill:
        """The spill of one layer's pool (pages of that shape)."""
        return LayerSpill(self, layer, Layout(self.run, 1, 1, page_size, head_dim, value_dim, dtype))

    def keys(self) -> list[bytes]:
        """This run's record keys (for checks)."""
        with self.disk.env.begin(db=self.spill) as txn:
            cursor = txn.cursor()
            found = []
            if cursor.set_range(self.run):
                for key in cursor.iternext(values=False):
                    if not key.startswith(self.run):
                        break
                    found.append(bytes(key))
            return found

    def close(self) -> None:
        """Delete this run's records and registration (also at garbage collection or exit)."""
        self._close()
        self.nbytes = 0


@dataclass
class LayerSpill:
    """One layer's spilled pages: batched writes, checked reads, deletes."""

    store: SpillStore
    layer: int
    layout: Layout

    def _key(self, page: int) -> bytes:
        return self.store.run + _PAGE_KEY.pack(self.layer, page)

    def put(self, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write pages ``pages`` (keys ``[n, page_size, head_dim]``, values, positions ``[n,
        page_size]``, any device) in one transaction. :class:`PoolExhaustedError`, nothing
        written, when they would take the run past its byte budget or the disk is full."""
        keys, values, positions = keys.to("cpu"), values.to("cpu"), positions.to("cpu")
        items = [
            (
                self._key(page),
                encode(
                    self.layout,
                    Block(_RECORD_KEY.pack(self.layer, page), b"", positions[i].tolist(), keys[i][None, None], values[i][None, None]),
                ),
            )
            for i, page in enumerate(pages.tolist())
        ]
        if self.store.disk.tag_key is not None:  # the record, then its keyed tag
            items = [(key, bytes(record) + self.store.disk.tag(key, [record])) for key, record in items]
        incoming = sum(len(record) for _, record in items)
        if self.store.nbytes + incoming > self.store.capacity_bytes:
            raise PoolExhaustedError(
                f"disk tier full: {len(items)} more spilled pages ({incoming} bytes) would exceed its budget of "
                f"{self.store.capacity_bytes} bytes ({self.store.nbytes} held)"
            )

        def write(txn: lmdb.Transaction) -> None:
            for key, record in items:
                txn.put(key, record, db=self.store.spill)

        try:
            self.store.disk.transact(incoming, write)
        except lmdb.Error as error:
            raise PoolExhaustedError(
                f"disk tier at {self.store.disk.path} cannot take spilled pages ({type(error).__name__}: {error})"
            ) from None
        self.store.nbytes += incoming

    def get(
        self, pages: torch.Tensor, device: torch.device, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of spilled pages ``pages`` (checked; they stay on disk), in host
        memory pinned when ``device`` is CUDA, or in ``out`` (contiguous CPU keys and values of
        that shape). :class:`SpilledPageLost` if any record is missing or fails its checks
        (``out`` then partly written). Safe from a thread other than the writer's (a prefetch):
        it copies with numpy only."""
        layout, count = self.layout, pages.numel()
        keys, values = (
            out
            if out is not None
            else (
                host_staging((count, layout.page_size, layout.head_dim), layout.dtype, device),
                host_staging((count, layout.page_size, layout.value_dim), layout.dtype, device),
            )
        )
        if count == 0:
            return keys, values
        rows, size = empty_rows(layout, count), record_size(layout)
        disk, tagged = self.store.disk, self.store.disk.tag_key is not None
        page_list = pages.tolist()
        with self.store.disk.resize_lock, self.store.disk.env.begin(db=self.store.spill, buffers=True) as txn:
            if not self.store.disk.intact():
                raise SpilledPageLost(
                    f"spilled pages of layer {self.layer} are lost: {self.store.disk.path / 'data.mdb'} was cut short while open"
                )
            for i, page in enumerate(page_list):
                key = self._key(page)
                record = txn.get(key)
                if record is None or len(record) != size + tagged * TAG_BYTES:
                    raise SpilledPageLost(
                        f"spilled page {page} of layer {self.layer} is lost: "
                        + ("no record" if record is None else f"{len(record)} bytes, not {size + tagged * TAG_BYTES}"),
                        (page,),
                    )
                if tagged and not disk.tag_matches(key, [record[:size]], record[size:]):
                    raise SpilledPageLost(f"spilled page {page} of layer {self.layer} is lost: its tag is not this tier's key's", (page,))
                rows[i] = record[:size]
        chain_keys = np.frombuffer(b"".join(_RECORD_KEY.pack(self.layer, page) for page in page_list), dtype=np.uint8)
        failed = np.flatnonzero(~check_rows(layout, rows, chain_keys.reshape(count, 16)))
        if failed.size:
            raise SpilledPageLost(
                f"spilled page {page_list[failed[0]]} of layer {self.layer} is lost: its record fails its checks",
                tuple(page_list[i] for i in failed),
            )
        key_bytes, value_bytes = row_sections(layout, rows)
        byte_rows(keys)[:] = key_bytes
        byte_rows(values)[:] = value_bytes
        return keys, values

    def delete(self, pages: torch.Tensor) -> None:
        """Delete the records of pages ``pages`` (freed, or back in memory), in one transaction
        (nothing to do once the tier is lost: they went with its file)."""
        if not self.store.disk.intact():
            return
        freed = 0

        def remove(txn: lmdb.Transaction) -> None:
            nonlocal freed
            freed = 0
            for page in pages.tolist():
                record = txn.pop(self._key(page), db=self.store.spill)
                freed += 0 if record is None else len(record)

        try:
            self.store.disk.transact(0, remove)
        except lmdb.Error:  # a full disk refuses even a delete: the records stay (and stay counted) until the run closes
            return
        self.store.nbytes -= freed


def _delete_run(disk: DiskTier, spill: lmdb._Database, runs: lmdb._Database, run: bytes, lock: RunLock) -> None:
    """Delete run ``run``'s records and registration in one transaction (a closed environment:
    nothing to do, the next opening sweeps; a lost tier: they went with its file), then drop its
    lock (a run whose deletion failed is swept by the next opening)."""
    try:
        if disk.closed or not disk.intact():
            return
        with disk.env.begin(write=True) as txn:
            delete_run_records(txn, spill, run)
            txn.delete(run, db=runs)
    except lmdb.Error:
        pass
    finally:
        lock.release()
