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
      rANS:   u32 payload bytes, u8 symbols present minus one, that many symbols (u8, ascending)
              and their frequencies (u16 each, summing to 2**12), the four final coder states
              (u32 each), then the payload

rANS (Duda, 2013; the byte-wise 32-bit variant of Giesen's ``ryg_rans``): four interleaved
states (element ``i`` uses state ``i % 4``), probabilities in 12 bits, renormalised a byte at a
time into one shared stream. The decoder is told nothing it does not check: the table must sum
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
_LOW = 1 << 23
"""The lower bound of a normalised state (states live in ``[_LOW, _LOW << 8)``)."""
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
    table = bytes([symbols.size - 1]) + symbols.astype(np.uint8).tobytes() + freq[symbols].astype("<u2").tobytes()
    coded = table + states.astype("<u4").tobytes() + payload.tobytes()
    if len(coded) + _U32.size >= n:
        return _ARRAY.pack(_RAW, n) + data.tobytes()
    return _ARRAY.pack(_RANS, n) + _U32.pack(payload.size) + coded


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
        x_max = ((_LOW >> PROB_BITS) << 8) * f
        while x >= x_max:
            pos -= 1
            out[pos] = x & 0xFF
            x >>= 8
        states[k] = ((x // f) << PROB_BITS) + (x % f) + cum[s]
    return pos


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _rans_decode(
    src: np.ndarray, start: int, end: int, slot: np.ndarray, freq: np.ndarray, bias: np.ndarray, states: np.ndarray, out: np.ndarray
) -> bool:
    """Decode ``out.size`` symbols from ``src[start:end]`` with final ``states``; True when the
    stream is consumed exactly and the states end at their start. Every read of ``src`` is
    checked against ``end`` (``end <= src.size``); tables are indexed by masked slots and by
    symbols (``< 256``) only."""
    mask = _TOTAL - 1
    x0, x1, x2, x3 = states[0], states[1], states[2], states[3]
    pos = start
    n = out.size
    i = 0
    while i + 4 <= n:
        s = slot[x0 & mask]
        out[i] = s
        x0 = freq[s] * (x0 >> PROB_BITS) + bias[x0 & mask]
        while x0 < _LOW:
            if pos >= end:
                return False
            x0 = (x0 << 8) | src[pos]
            pos += 1
        s = slot[x1 & mask]
        out[i + 1] = s
        x1 = freq[s] * (x1 >> PROB_BITS) + bias[x1 & mask]
        while x1 < _LOW:
            if pos >= end:
                return False
            x1 = (x1 << 8) | src[pos]
            pos += 1
        s = slot[x2 & mask]
        out[i + 2] = s
        x2 = freq[s] * (x2 >> PROB_BITS) + bias[x2 & mask]
        while x2 < _LOW:
            if pos >= end:
                return False
            x2 = (x2 << 8) | src[pos]
            pos += 1
        s = slot[x3 & mask]
        out[i + 3] = s
        x3 = freq[s] * (x3 >> PROB_BITS) + bias[x3 & mask]
        while x3 < _LOW:
            if pos >= end:
                return False
            x3 = (x3 << 8) | src[pos]
            pos += 1
        i += 4
    rest = np.empty(4, dtype=np.int64)
    rest[0], rest[1], rest[2], rest[3] = x0, x1, x2, x3
    while i < n:
        k = i & 3
        x = rest[k]
        s = slot[x & mask]
        out[i] = s
        x = freq[s] * (x >> PROB_BITS) + bias[x & mask]
        while x < _LOW:
            if pos >= end:
                return False
            x = (x << 8) | src[pos]
            pos += 1
        rest[k] = x
        i += 1
    return pos == end and rest[0] == _LOW and rest[1] == _LOW and rest[2] == _LOW and rest[3] == _LOW


def decode(stream: bytes | bytearray | memoryview | np.ndarray, max_bytes: int = 1 << 30) -> list[np.ndarray]:
    """The uint8 arrays (flat) that :func:`encode` wrote into ``stream``; :class:`EntropyCodeError`
    if ``stream`` is not exactly such a byte string, or if its arrays would hold more than
    ``max_bytes`` together (checked before each is allocated: a damaged length never allocates)."""
    src = np.frombuffer(stream, dtype=np.uint8) if not isinstance(stream, np.ndarray) else stream.reshape(-1).view(np.uint8)
    reader = _Reader(src, max_bytes)
    arrays = [_decode_one(reader) for _ in range(reader.u32())]
    if reader.at != src.size:
        raise EntropyCodeError(f"{src.size - reader.at} bytes after the last array")
    return arrays


def _decode_one(reader: _Reader) -> np.ndarray:
    mode, length = _ARRAY.unpack(reader.take(_ARRAY.size))
    reader.allow(length)
    if mode == _RAW:
        return reader.take_array(length).copy()
    if mode == _REPEAT:
        return np.full(length, reader.take(1)[0], dtype=np.uint8)
    if mode != _RANS:
        raise EntropyCodeError(f"unknown array mode {mode}")
    payload = reader.u32()
    present = reader.take(1)[0] + 1
    symbols = reader.take_array(present)
    freqs = reader.take_array(2 * present).view("<u2").astype(np.int64)
    if present < 2 or np.any(np.diff(symbols.astype(np.int64)) <= 0) or np.any(freqs == 0) or int(freqs.sum()) != _TOTAL:
        raise EntropyCodeError("frequency table is not a valid one")
    states = reader.take_array(4 * _STATES).view("<u4").astype(np.int64)
    if np.any(states < _LOW) or np.any(states >= _LOW << 8):
        raise EntropyCodeError("coder states out of range")
    start = reader.at
    reader.take(payload)
    freq = np.zeros(256, dtype=np.int64)
    freq[symbols] = freqs
    cum = np.zeros(257, dtype=np.int64)
    np.cumsum(freq, out=cum[1:])
    slot = np.repeat(np.arange(256, dtype=np.uint8), freq)
    bias = np.arange(_TOTAL, dtype=np.int64) - cum[slot]
    out = np.empty(length, dtype=np.uint8)
    if not _rans_decode(reader.src, start, start + payload, slot, freq, bias, states, out):
        raise EntropyCodeError("rANS payload does not decode to its length")
    return out


class _Reader:
    """Bounds-checked reads from a byte array."""

    def __init__(self, src: np.ndarray, max_bytes: int) -> None:
        self.src = src
        self.at = 0
        self.left = max_bytes
        """Decoded bytes still allowed."""

    def allow(self, length: int) -> None:
        if length > self.left:
            raise EntropyCodeError(f"an array of {length} bytes exceeds the {self.left} bytes left of the limit")
        self.left -= length

    def take(self, count: int) -> bytes:
        return self.take_array(count).tobytes()

    def take_array(self, count: int) -> np.ndarray:
        if count < 0 or self.at + count > self.src.size:
            raise EntropyCodeError(f"stream cut short: {count} bytes wanted at {self.at} of {self.src.size}")
        view = self.src[self.at : self.at + count]
        self.at += count
        return view

    def u32(self) -> int:
        return _U32.unpack(self.take(_U32.size))[0]
