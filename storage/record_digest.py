"""A 64-bit record digest at close to memory speed (numba).

Page records are checked on every read and built on every write; zlib's CRC-32 (2-4 GB/s here)
cost as much as the copy itself. This digest mixes each 8-byte word into one of four independent
lanes (the xxHash64 round: ``lane = rotl(lane + word * P2, 31) * P1``), about 10 GB/s on data in
cache. Records are digested right after they are copied (into the record when writing, out of
the map when reading), while the bytes are still in cache: a fused copy-and-digest loop measured
slower than ``memcpy`` followed by this pass.

What it guarantees: every step that mixes a word in is a bijection of that word (odd
multipliers, rotations, additions and xors), and so is every later step of the lane, the lane
merge and the final avalanche; so any change confined to one aligned 8-byte word of a section
(any number of flipped bits in it, hence any single corrupted byte) changes the digest, always.
Wider corruption is caught with probability about ``1 - 2**-64``. It is a checksum against
faults, not a cryptographic hash.

A record's digest (:func:`record_digest`) combines the digests of its sections (header, token
ids, keys, values), each computed on its own; the combination is a bijection of each section's
digest given the others, so the guarantee holds for the whole record.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@numba.njit(inline="always")
def _rotl(x: np.uint64, bits: int) -> np.uint64:
    return (x << np.uint64(bits)) | (x >> np.uint64(64 - bits))


@numba.njit(inline="always")
def _round(lane: np.uint64, word: np.uint64) -> np.uint64:
    return _rotl(lane + word * _P2, 31) * _P1


@numba.njit(inline="always")
def _avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _digest(words: np.ndarray, tail: np.ndarray) -> np.uint64:
    """Digest of ``words`` (uint64) then ``tail`` (the < 8 trailing bytes)."""
    n = words.shape[0]
    v1 = _P1 + _P2
    v2 = _P2
    v3 = np.uint64(0)
    v4 = np.uint64(0) - _P1
    stripes = n // 4
    for s in range(stripes):
        i = 4 * s
        v1 = _round(v1, words[i])
        v2 = _round(v2, words[i + 1])
        v3 = _round(v3, words[i + 2])
        v4 = _round(v4, words[i + 3])
    h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
    h += np.uint64(n * 8 + tail.shape[0])
    for i in range(4 * stripes, n):
        h ^= _round(np.uint64(0), words[i])
        h = _rotl(h, 27) * _P1 + _P4
    for i in range(tail.shape[0]):
        h ^= np.uint64(tail[i]) * _P5
        h = _rotl(h, 11) * _P1
    return _avalanche(h)


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _sections_digest(words: np.ndarray, tail: np.ndarray, cuts: np.ndarray) -> np.uint64:
    """Combined digest of sections ``words[cuts[i]:cuts[i + 1]]`` (the last one followed by ``tail``)."""
    h = _P5
    for i in range(cuts.shape[0] - 1):
        section_tail = tail if i == cuts.shape[0] - 2 else tail[:0]
        h = _avalanche(h ^ _digest(words[cuts[i] : cuts[i + 1]], section_tail)) + _P4
    return h


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _rows_digests(words: np.ndarray, tails: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """:func:`_sections_digest` of each row ``i`` of ``words`` (uint64 ``[n, w]``) followed by ``tails[i]``."""
    out = np.empty(words.shape[0], dtype=np.uint64)
    for i in range(words.shape[0]):
        out[i] = _sections_digest(words[i], tails[i], cuts)
    return out


@functools.lru_cache(maxsize=64)
def _word_cuts(cuts: tuple[int, ...]) -> np.ndarray:
    """``cuts`` in 8-byte words from the start (the end rounded down), checked."""
    if len(cuts) < 2 or any((c - cuts[0]) % 8 for c in cuts[:-1]) or list(cuts) != sorted(cuts):
        raise ValueError(f"cuts must ascend, every one but the end a multiple of 8 bytes from the start; got {cuts}")
    words = np.array([(c - cuts[0]) // 8 for c in cuts], dtype=np.int64)
    words.flags.writeable = False
    return words


def record_digest(source: np.ndarray, cuts: tuple[int, ...]) -> int:
    """The digest of ``source`` (1-d uint8, any alignment) cut into sections at byte offsets
    ``cuts`` (``cuts[0]`` the start, ``cuts[-1]`` the end; every cut but the end a multiple of 8
    from the start), each digested on its own and combined in order."""
    if source.dtype != np.uint8 or source.ndim != 1:
        raise ValueError(f"record_digest reads a 1-d uint8 array, got {source.dtype} with {source.ndim} dims")
    word_cuts = _word_cuts(cuts)
    if cuts[-1] > source.shape[0]:
        raise ValueError(f"cuts end at byte {cuts[-1]}, past the source's {source.shape[0]} bytes")
    whole = cuts[0] + int(word_cuts[-1]) * 8
    return int(_sections_digest(source[cuts[0] : whole].view(np.uint64), source[whole : cuts[-1]], word_cuts))


def rows_digests(rows: np.ndarray, cuts: tuple[int, ...]) -> np.ndarray:
    """:func:`record_digest` of every row of ``rows`` (2-d uint8, each row 8-byte aligned: one
    record per row, as :func:`kvlib.storage.page_record.empty_rows` lays them out), in one call
    that releases the GIL: uint64 ``[rows]``."""
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.strides[1] != 1 or rows.strides[0] % 8 or rows.ctypes.data % 8:
        raise ValueError(f"rows_digests reads 2-d uint8 rows, each contiguous and 8-byte aligned; got {rows.dtype} "
                         f"with {rows.ndim} dims and strides {rows.strides}")
    word_cuts = _word_cuts(cuts)
    if cuts[-1] > rows.shape[1]:
        raise ValueError(f"cuts end at byte {cuts[-1]}, past the rows' {rows.shape[1]} bytes")
    whole = cuts[0] + int(word_cuts[-1]) * 8
    words = rows[:, cuts[0] : whole].view(np.uint64)
    return _rows_digests(words, np.ascontiguousarray(rows[:, whole : cuts[-1]]), word_cuts)
