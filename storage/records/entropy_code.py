"""Lossless entropy coding of byte arrays: static-table rANS (numba), one table per array.

The coder behind entropy-coded page records (CacheGen's idea: Liu et al., 2024, "CacheGen: KV
Cache Compression and Streaming for Fast Large Language Model Serving", codes quantized KV with
an arithmetic coder and per-channel-group probability tables). :func:`encode` turns a list of
uint8 arrays into one byte string, :func:`decode` turns it back, exactly; each array gets its own
order-0 frequency table (the caller groups bytes of one distribution into one array: one codec
field across layers, say), and is stored raw when coding would not make it smaller.

Stream (little endian)::

    u32 array count, then per array:
      u8 mode (0 raw, 1 one repeated byte, 2 rANS), u32 length (bytes decoded), then
      raw:    the bytes
      repeat: the byte
      rANS:   u32 payload bytes, the symbols present (a 256-bit map, 32 bytes), their
              frequencies in ascending symbol order (12 bits each, two in three bytes, low bits
              first; summing to 2**12), the four final coder states (u32 each), then the payload

rANS (Duda, 2013; 32-bit states as in Giesen's ``ryg_rans``, renormalised a 16-bit word at a
time so that a step reads at most one word): four interleaved states (element ``i`` uses state
``i % 4``), probabilities in 12 bits, one shared stream. The decoder is told nothing it does not check: the table must sum
to ``2**12`` with every symbol present at least once, every payload byte read is bounds-checked,
the states must end where the encoder began them and the payload must be consumed exactly; any
failure raises :class:`EntropyCodeError` (a ``ValueError``) and writes nothing outside the
output array it allocated.
"""

from __future__ import annotations

import struct

import numba
import numpy as np

PROB_BITS = 12
"""Frequencies sum to ``2**PROB_BITS``."""
_TOTAL = 1 << PROB_BITS
_LOW = 1 << 16
"""The lower bound of a normalised state (states live in ``[_LOW, 2**32)``; renormalised 16 bits at a time)."""
_STATES = 4
_RAW, _REPEAT, _RANS = 0, 1, 2
_COUNT = struct.Struct("<I")
_ARRAY = struct.Struct("<BI")
_U32 = struct.Struct("<I")


class EntropyCodeError(ValueError):
    """A byte string that is not a valid :func:`encode` stream (damaged or foreign)."""


def encode(arrays: list[np.ndarray]) -> bytes:
    """One byte string holding ``arrays`` (uint8, any shape: their C-order bytes), each coded
    with its own frequency table, or stored raw where that is not larger."""
    out = [_COUNT.pack(len(arrays))]
    for array in arrays:
        data = np.ascontiguousarray(array).reshape(-1)
        if data.dtype != np.uint8:
            raise ValueError(f"entropy coding takes uint8 arrays, got {data.dtype}")
        out.append(_encode_one(data))
    return b"".join(out)


def _encode_one(data: np.ndarray) -> bytes:
    n = data.size
    if n == 0:
        return _ARRAY.pack(_RAW, 0)
    counts = np.bincount(data, minlength=256)
    symbols = np.flatnonzero(counts)
    if symbols.size == 1:
        return _ARRAY.pack(_REPEAT, n) + bytes([int(symbols[0])])
    freq = normalized_frequencies(counts)
    cum = np.zeros(257, dtype=np.int64)
    np.cumsum(freq, out=cum[1:])
    scratch = np.empty(2 * n + 16, dtype=np.uint8)
    states = np.empty(_STATES, dtype=np.int64)
    start = _rans_encode(data, freq, cum, scratch, states)
    payload = scratch[start:]
    table = np.packbits(counts > 0, bitorder="little").tobytes() + _pack12(freq[symbols])
    coded = table + states.astype("<u4").tobytes() + payload.tobytes()
    if len(coded) + _U32.size >= n:
        return _ARRAY.pack(_RAW, n) + data.tobytes()
    return _ARRAY.pack(_RANS, n) + _U32.pack(payload.size) + coded


def _pack12(values: np.ndarray) -> bytes:
    """``values`` (each below ``2**12``) as 12-bit fields, two in three bytes, low bits first
    (an odd count's last value in two bytes)."""
    padded = np.zeros(values.size + values.size % 2, dtype=np.int64)
    padded[: values.size] = values
    a, b = padded[0::2], padded[1::2]
    packed = np.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=1).astype(np.uint8).reshape(-1)
    return packed[: _table_bytes(values.size) - 32].tobytes()


def _table_bytes(present: int) -> int:
    """Bytes of a rANS array's table: the symbol map and ``present`` 12-bit frequencies."""
    return 32 + (3 * present + 1) // 2


def normalized_frequencies(counts: np.ndarray) -> np.ndarray:
    """int64 ``[256]`` frequencies summing to ``2**PROB_BITS`` from byte ``counts``: proportional,
    every symbol that occurs at least 1, the rounding error taken from (or given to) the most
    frequent symbols."""
    total = int(counts.sum())
    present = counts > 0
    freq = np.where(present, np.maximum(1, (counts * _TOTAL) // max(total, 1)), 0).astype(np.int64)
    excess = int(freq.sum()) - _TOTAL
    order = np.argsort(-freq, kind="stable")
    i = 0
    while excess > 0:  # take from the largest (never below 1)
        symbol = order[i % order.size]
        take = min(excess, max(int(freq[symbol]) - 1, 0))
        freq[symbol] -= take
        excess -= take
        i += 1
    freq[order[0]] -= excess  # excess <= 0: the shortfall goes to the most frequent symbol
    return freq


@numba.njit(cache=True, nogil=True)
def _rans_encode(data: np.ndarray, freq: np.ndarray, cum: np.ndarray, out: np.ndarray, states: np.ndarray) -> int:
    """Encode ``data`` backwards into the tail of ``out``; returns where the payload starts and
    leaves the final states in ``states``."""
    for k in range(4):
        states[k] = _LOW
    pos = out.size
    for i in range(data.size - 1, -1, -1):
        k = i & 3
        x = states[k]
        s = data[i]
        f = freq[s]
        if x >= ((_LOW >> PROB_BITS) << 16) * f:  # at most one 16-bit word per symbol
            pos -= 2
            out[pos] = x & 0xFF
            out[pos + 1] = (x >> 8) & 0xFF
            x >>= 16
        states[k] = ((x // f) << PROB_BITS) + (x % f) + cum[s]
    return pos


_OK, _CUT, _MODE, _LIMIT, _TRAILING, _TABLE, _STATE, _PAYLOAD = range(8)
_ERRORS = {
    _CUT: "stream cut short",
    _MODE: "unknown array mode",
    _LIMIT: "arrays exceed the byte limit",
    _TRAILING: "bytes after the last array",
    _TABLE: "frequency table is not a valid one",
    _STATE: "coder states out of range",
    _PAYLOAD: "rANS payload does not decode to its length",
}


def decode(stream: bytes | bytearray | memoryview | np.ndarray, max_bytes: int = 1 << 30) -> list[np.ndarray]:
    """The uint8 arrays (flat) that :func:`encode` wrote into ``stream``: views of one buffer;
    :class:`EntropyCodeError` if ``stream`` is not exactly such a byte string, or if its arrays
    would hold more than ``max_bytes`` together (checked before anything is allocated: a damaged
    length never allocates). Two numba passes: one checks the stream's structure and sums the
    lengths, one decodes (the tables checked as they are read)."""
    src = np.frombuffer(stream, dtype=np.uint8) if not isinstance(stream, np.ndarray) else stream.reshape(-1).view(np.uint8)
    code, count, total = _scan(src, max_bytes)
    if code != _OK:
        raise EntropyCodeError(_ERRORS[code])
    out = np.empty(total, dtype=np.uint8)
    lengths = np.empty(count, dtype=np.int64)
    code = _decode_stream(src, out, lengths)
    if code != _OK:
        raise EntropyCodeError(_ERRORS[code])
    ends = np.cumsum(lengths).tolist()
    return [out[end - length : end] for end, length in zip(ends, lengths.tolist())]


@numba.njit(cache=True, nogil=True, inline="always")
def _u32(src: np.ndarray, at: int) -> int:
    return np.int64(src[at]) | (np.int64(src[at + 1]) << 8) | (np.int64(src[at + 2]) << 16) | (np.int64(src[at + 3]) << 24)


@numba.njit(cache=True, nogil=True)
def _present(src: np.ndarray, at: int) -> int:
    """Symbols set in the 256-bit map at ``src[at : at + 32]``."""
    count = 0
    for i in range(32):
        byte = np.int64(src[at + i])
        while byte:
            count += byte & 1
            byte >>= 1
    return count


@numba.njit(cache=True, nogil=True)
def _scan(src: np.ndarray, max_bytes: int) -> tuple[int, int, int]:
    """``(status, arrays, total bytes)`` of a stream's structure: every header and payload within
    ``src``, nothing after the last array, the lengths within ``max_bytes``."""
    size = src.size
    if size < 4:
        return _CUT, 0, 0
    count = _u32(src, 0)
    at, total = 4, 0
    if count > size:  # every array takes at least 5 bytes
        return _CUT, 0, 0
    for _ in range(count):
        if at + 5 > size:
            return _CUT, 0, 0
        mode, length = src[at], _u32(src, at + 1)
        at += 5
        total += length
        if total > max_bytes:
            return _LIMIT, 0, 0
        if mode == _RAW:
            at += length
        elif mode == _REPEAT:
            at += 1
        elif mode == _RANS:
            if at + 36 > size:
                return _CUT, 0, 0
            payload, present = _u32(src, at), _present(src, at + 4)
            at += 4 + 32 + (3 * present + 1) // 2 + 4 * _STATES + payload
        else:
            return _MODE, 0, 0
        if at > size:
            return _CUT, 0, 0
    if at != size:
        return _TRAILING, 0, 0
    return _OK, count, total


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _decode_stream(src: np.ndarray, out: np.ndarray, lengths: np.ndarray) -> int:
    """Decode a stream :func:`_scan` passed into ``out`` (its arrays back to back), their lengths
    into ``lengths``; a status. Reads stay within the offsets the scan checked; rANS payload
    reads are checked against their payload's end; writes stay within each array's slice."""
    table = np.empty(_TOTAL, dtype=np.uint32)
    at, o = 4, 0
    for i in range(lengths.size):
        mode, length = src[at], _u32(src, at + 1)
        at += 5
        lengths[i] = length
        if mode == _RAW:
            out[o : o + length] = src[at : at + length]
            at += length
        elif mode == _REPEAT:
            out[o : o + length] = src[at]
            at += 1
        else:
            payload, present = _u32(src, at), _present(src, at + 4)
            symbols_at, freqs_at = at + 4, at + 36
            at += 36 + (3 * present + 1) // 2
            if present < 2:
                return _TABLE
            filled, k = 0, 0
            for symbol in range(256):
                if not (src[symbols_at + (symbol >> 3)] >> (symbol & 7)) & 1:
                    continue
                base = freqs_at + 3 * (k >> 1)
                if k & 1:
                    freq = (np.int64(src[base + 1]) >> 4) | (np.int64(src[base + 2]) << 4)
                else:
                    freq = np.int64(src[base]) | ((np.int64(src[base + 1]) & 0xF) << 8)
                k += 1
                if freq == 0 or filled + freq > _TOTAL:
                    return _TABLE
                entry = symbol | ((freq - 1) << 8)
                for slot in range(filled, filled + freq):
                    table[slot] = entry | ((slot - filled) << 20)
                filled += freq
            if filled != _TOTAL:
                return _TABLE
            x0, x1, x2, x3 = _u32(src, at), _u32(src, at + 4), _u32(src, at + 8), _u32(src, at + 12)
            at += 4 * _STATES
            if min(x0, x1, x2, x3) < _LOW:
                return _STATE
            if not _rans_decode(src, at, at + payload, table, x0, x1, x2, x3, out[o : o + length]):
                return _PAYLOAD
            at += payload
        o += length
    return _OK


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _step(x: int, table: np.ndarray, out: np.ndarray, i: int) -> int:
    """One decode step of state ``x``: writes ``out[i]``, returns the state before renormalising."""
    entry = np.int64(table[x & (_TOTAL - 1)])
    out[i] = entry & 0xFF
    return (((entry >> 8) & 0xFFF) + 1) * (x >> PROB_BITS) + (entry >> 20)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _refill(x: int, src: np.ndarray, pos: int) -> tuple[int, int]:
    """State ``x`` renormalised, reading the word at ``pos`` if it is below ``_LOW`` (the caller
    makes sure two bytes are there), and the position after. A branch: a branchless form
    (shift and mask by the comparison) measured 40% slower here."""
    if x < _LOW:
        return (x << 16) | np.int64(src[pos]) | (np.int64(src[pos + 1]) << 8), pos + 2
    return x, pos


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _rans_decode(src: np.ndarray, start: int, end: int, table: np.ndarray, x0: int, x1: int, x2: int, x3: int, out: np.ndarray) -> bool:
    """Decode ``out.size`` symbols from ``src[start:end]`` (``end <= src.size``) with final states
    ``x0..x3``; True when the payload is consumed exactly and the states end where the encoder
    began them. ``table[slot]``: symbol (bits 0-7), frequency - 1 (8-19), slot - cumulative
    frequency (20-31). A step reads at most one 16-bit word: four steps at most 8 bytes, so a
    group of four runs unchecked while 8 bytes are left and checks each read past that."""
    pos = start
    n = out.size
    i = 0
    while i + 4 <= n and pos + 8 <= end:
        x0, pos = _refill(_step(x0, table, out, i), src, pos)
        x1, pos = _refill(_step(x1, table, out, i + 1), src, pos)
        x2, pos = _refill(_step(x2, table, out, i + 2), src, pos)
        x3, pos = _refill(_step(x3, table, out, i + 3), src, pos)
        i += 4
    states = np.array([x0, x1, x2, x3], dtype=np.int64)
    while i < n:
        x = _step(states[i & 3], table, out, i)
        if x < _LOW:
            if pos + 2 > end:
                return False
            x = (x << 16) | np.int64(src[pos]) | (np.int64(src[pos + 1]) << 8)
            pos += 2
        states[i & 3] = x
        i += 1
    return pos == end and states.min() == _LOW and states.max() == _LOW
