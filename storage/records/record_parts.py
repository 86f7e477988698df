"""A record stored in lmdb as parts of a few pages each, under one index entry.

A record of ``length`` bytes under ``key`` is an *entry* in the entries database (``ENTRY``:
magic ``b"KVP1"``, part count, ``length``) and ``count`` values in the parts database under
``len(key) (u16) + key + part index (u32)``, big endian: one record's parts are adjacent and in
order, and no other key's parts sort between them (the length prefix keeps a key that extends
another out of its range). Joined, the parts are the record; :func:`put` makes every part but
the last ``part_bytes`` long, readers only join them. :func:`put`, :func:`delete` and
:func:`read` work inside the caller's transaction: a record's entry and all of its parts are
written, replaced or deleted together, so a reader sees a record's whole part set or none of it
(lmdb's isolation) and a writer killed mid-transaction leaves the last committed one.

Why parts rather than one value: lmdb keeps a value longer than half a page in a run of
contiguous overflow pages. A whole page record (hundreds of KB) needs a long free run, which a
file churned by eviction has to search its free list for or grow past; a part needs
``part_bytes / page`` pages. And a commit without ``writemap`` writes its dirty pages with
``writev`` calls of at most 64 values each: small parts keep a call at a few MB (calls of 4 MB
and more into the page cache were measured several times slower here), while each part costs
a reader a cursor step: parts are as large as that allows, and full.

Nothing read is trusted: an entry of another layout (such as a whole record stored as one value
by an earlier kvlib), or whose parts are not exactly its ``count`` keys adding up to its
``length``, is not a record (``ValueError``).
"""

from __future__ import annotations

import itertools
import struct

import lmdb

MAGIC = b"KVP1"
ENTRY = struct.Struct("<4sIQ")
"""An index entry: magic, part count, record length in bytes."""
_KEY_LENGTH = struct.Struct(">H")
_INDEX = struct.Struct(">I")
_FIRST = _INDEX.pack(0)


def put(
    txn: lmdb.Transaction, entries: lmdb._Database, parts: lmdb._Database, key: bytes, chunks: list[memoryview], part_bytes: int
) -> int:
    """Store the record that ``chunks`` (byte views) make up, in order, under ``key``, replacing
    any record there, as parts of ``part_bytes`` bytes (the last one shorter): views of a chunk
    where a part lies within one (lmdb copies them into its pages), joined copies where it spans
    two (a few per record: fewer parts are cheaper to read). Returns the bytes of the record
    replaced (0 if none)."""
    replaced = delete(txn, entries, parts, key)
    pieces = _pieces(chunks, part_bytes)
    txn.put(key, ENTRY.pack(MAGIC, len(pieces), sum(chunk.nbytes for chunk in chunks)), db=entries)
    prefix = _prefix(key)
    txn.cursor(db=parts).putmulti([(prefix + _INDEX.pack(i), piece) for i, piece in enumerate(pieces)])
    return replaced


def _pieces(chunks: list[memoryview], part_bytes: int) -> list:
    """The concatenation of ``chunks`` cut every ``part_bytes`` bytes: a view of a chunk where a
    piece lies within one, the piece's bytes joined (copied) where it spans chunks."""
    pieces, pending, filled = [], [], 0
    for chunk in chunks:
        at = 0
        while at < chunk.nbytes:
            take = min(part_bytes - filled, chunk.nbytes - at)
            pending.append(chunk[at : at + take])
            filled += take
            at += take
            if filled == part_bytes:
                pieces.append(pending[0] if len(pending) == 1 else b"".join(pending))
                pending, filled = [], 0
    if pending:
        pieces.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return pieces


def read(txn: lmdb.Transaction, entries: lmdb._Database, parts: lmdb._Database, key: bytes) -> list | None:
    """The parts of the record under ``key`` in order (buffers into the map when ``txn`` was
    begun with ``buffers=True``, valid while it lasts), or None if there is none; ``ValueError``
    if the entry is not one of this layout or its parts are not all there at their length."""
    entry = txn.get(key, db=entries)
    if entry is None:
        return None
    count, length = _parse(entry)
    prefix = _prefix(key)
    cursor = txn.cursor(db=parts)
    found = list(itertools.islice(cursor.iternext(keys=False), count)) if cursor.set_key(prefix + _FIRST) else []
    if len(found) != count or sum(map(len, found)) != length or (count and cursor.key() != prefix + _INDEX.pack(count - 1)):
        raise ValueError(f"record parts missing, misplaced or of another length ({len(found)} of {count} parts)")
    return found  # the cursor rests on the last part taken, this record's last: the ones before it are its parts


def delete(txn: lmdb.Transaction, entries: lmdb._Database, parts: lmdb._Database, key: bytes) -> int:
    """Delete the record under ``key``: its entry and every part stored under ``key`` (whatever
    the entry says); returns its bytes as counted when it was stored (:func:`record_bytes`; 0 if
    there was no entry)."""
    entry = txn.pop(key, db=entries)
    prefix = _prefix(key)
    cursor = txn.cursor(db=parts)
    if cursor.set_range(prefix):
        while cursor.key()[: len(prefix)] == prefix:
            if not cursor.delete():
                break
    return 0 if entry is None else record_bytes(entry)


def record_bytes(entry: bytes | memoryview) -> int:
    """The bytes of the record an entry stands for: its length field, or for a value that is
    not an entry of this layout (an earlier kvlib's whole record, or damage) the value's own
    length, which is what a byte total counted for it."""
    try:
        return _parse(entry)[1]
    except ValueError:
        return len(entry)


def _prefix(key: bytes) -> bytes:
    return _KEY_LENGTH.pack(len(key)) + key


def _parse(entry: bytes | memoryview) -> tuple[int, int]:
    """``(part count, record length)`` of an entry; ``ValueError`` if it is not one of this layout."""
    magic, count, length = ENTRY.unpack(entry) if len(entry) == ENTRY.size else (None, 0, 0)
    if magic != MAGIC:
        raise ValueError("not a record entry of this layout")
    return count, length
