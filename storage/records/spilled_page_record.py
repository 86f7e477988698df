"""The on-disk record of one spilled page: a fixed header, token ids, raw page bytes, a checksum.

A live sequence's page that leaves the host for the disk tier (:mod:`~kvlib.storage.tiers.spill_store`)
is written as one such record; prefix blocks, shared between requests, have their own record
(:mod:`~kvlib.storage.records.prefix_block_record`, magic ``b"KVLP"``).

Layout (little endian)::

    header  HEADER (below): magic b"KVLS", format version, namespace digest, the block's key and
            its parent's key (hash chain), layers, KV heads, page size, head dim, value dim,
            dtype code, body length in bytes
    body    token ids (int64 x page_size), then keys (layers x heads x page_size x head_dim,
            zero-padded to a multiple of 8 bytes) and values (layers x heads x page_size x
            value_dim) in the dtype, C order
    digest  64-bit :mod:`~kvlib.storage.records.record_digest` digest (XXH3-64) of the header and the
            body; the header is padded to 8 bytes so every section starts 8-byte aligned

Format 4 (this one) differs from format 3 in its digest only; its magic was ``b"KVLP"`` (the
prefix block record's) until the two records got a magic each. A record of another magic or
version fails its header check, so records written by an earlier kvlib are misses.

Nothing is pickled and nothing read is executed: :func:`decode` checks the magic, version,
namespace, the shape and dtype the reader expects and the body length before touching the body,
then copies the body out while digesting it, and raises :class:`RecordError` on any mismatch
(the caller treats it as a miss). Encoding and decoding each pass over the page bytes once.
A spill store reads many small records of one layout back in one batch: copied into the rows of
:func:`empty_rows`, checked by :func:`check_rows` (the same checks, vectorised) and read through
:func:`row_sections`.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np
import torch

from kvlib.storage.records.record_digest import digest, rows_digests

MAGIC = b"KVLS"
VERSION = 4
HEADER = struct.Struct("<4sH16s16s16sHHHHHBQ7x")
"""80 bytes: the body starts 8-byte aligned."""
_KEY_AT = struct.calcsize("<4sH16s")
"""Byte offset of the chain key in the header (after magic, version and namespace)."""
DIGEST = struct.Struct("<Q")
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.uint8: 4}
"""Dtype of a record's keys and values; uint8: a coded page's encoded fields as bytes (spilled pages)."""
_ITEM = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPE_CODES}


class RecordError(ValueError):
    """A stored record that fails its checks (never returned as data)."""


@dataclass(frozen=True)
class Layout:
    """What a reader expects of a record: its namespace digest, shape and dtype."""

    namespace: bytes
    layers: int
    heads: int
    page_size: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype


@dataclass
class Block:
    """A decoded record: the chain key and parent key, the token ids, and keys / values
    ``[layers, heads, page_size, dim]``."""

    key: bytes
    parent: bytes
    tokens: list[int]
    keys: torch.Tensor
    values: torch.Tensor


def encode(layout: Layout, block: Block) -> memoryview:
    """The record bytes of ``block`` (keys and values in ``layout.dtype`` on any device), in a
    fresh buffer written once (no zero fill: every byte is packed, copied or padded)."""
    sections = _sections(layout, block)
    cuts = _cuts(layout)
    out = np.empty(cuts[-1] + DIGEST.size, dtype=np.uint8)
    out[: HEADER.size] = np.frombuffer(_header(layout, stored_chain_key(block.key), stored_chain_key(block.parent)), dtype=np.uint8)
    for section, start, end in zip(sections, cuts[1:], cuts[2:]):
        out[start : start + section.nbytes] = section
        out[start + section.nbytes : end] = 0  # the keys' padding to 8 bytes
    DIGEST.pack_into(out, cuts[-1], digest(out[: cuts[-1]]))
    return memoryview(out)


def _sections(layout: Layout, block: Block) -> list[np.ndarray]:
    """The token ids, keys and values of ``block`` as uint8 arrays in ``layout.dtype`` (CPU,
    contiguous; the tensors' own memory when they already are), once its shapes match ``layout``."""
    if len(block.tokens) != layout.page_size:
        raise ValueError(f"a block holds {layout.page_size} tokens, got {len(block.tokens)}")
    for name, tensor, dim in (("keys", block.keys, layout.head_dim), ("values", block.values, layout.value_dim)):
        if tuple(tensor.shape) != (layout.layers, layout.heads, layout.page_size, dim):
            raise ValueError(
                f"block {name} have shape {tuple(tensor.shape)}; the layout expects {(layout.layers, layout.heads, layout.page_size, dim)}"
            )
    return [np.asarray(block.tokens, dtype=np.int64).view(np.uint8)] + [_bytes_of(t, layout.dtype) for t in (block.keys, block.values)]


def _bytes_of(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """``tensor`` in ``dtype`` as a flat uint8 array on the CPU: its own memory when it already is
    a contiguous CPU tensor of ``dtype`` (no conversion calls: they cost microseconds each)."""
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.to("cpu", dtype).contiguous()
    return tensor.detach().view(torch.uint8).numpy().reshape(-1)


def decode(layout: Layout, record: bytes | bytearray | memoryview) -> Block:
    """The block in ``record`` (bytes, or a buffer valid during the call: the tensors returned own
    their memory); :class:`RecordError` unless every check passes. The header is checked before
    the body is touched; the record is then copied out and the copy digested (in cache)."""
    cuts, (key, parent) = _checked_header(layout, record)
    copied = torch.empty(cuts[-1], dtype=torch.uint8)  # header and body: the digest checks the copy returned
    np.copyto(copied.numpy(), np.frombuffer(record, dtype=np.uint8, count=cuts[-1]))
    if digest(copied.numpy()) != DIGEST.unpack_from(record, cuts[-1])[0]:
        raise RecordError("checksum mismatch")
    tokens_at, keys_at, values_at, end = cuts[1:]
    tokens = copied.numpy()[tokens_at:keys_at].view(np.int64).tolist()
    shape = (layout.layers, layout.heads, layout.page_size)
    keys = copied[keys_at : keys_at + _key_bytes(layout)].view(layout.dtype).view(*shape, layout.head_dim)
    values = copied[values_at:end].view(layout.dtype).view(*shape, layout.value_dim)
    return Block(key, parent, tokens, keys, values)


def empty_rows(layout: Layout, count: int) -> np.ndarray:
    """An uninitialised uint8 ``[count, record_size(layout)]`` array whose rows each start 8-byte
    aligned: where records read out of a store are copied for :func:`check_rows`."""
    size = record_size(layout)
    stride = -(-size // 8) * 8
    return np.empty((count, stride), dtype=np.uint8)[:, :size]


def check_rows(layout: Layout, rows: np.ndarray, chain_keys: np.ndarray) -> np.ndarray:
    """Which records in ``rows`` (one per row, laid out by :func:`empty_rows`) pass every check
    :func:`decode` makes, for records written without a parent: bool ``[rows]``. Row ``i`` must
    carry chain key ``chain_keys[i]`` (uint8 ``[rows, 16]``). One vectorised header comparison
    and one digest call per row (about 0.3 us of call overhead each): for many small records,
    such as spilled pages, read in one batch."""
    if rows.ndim != 2 or rows.shape[1] != record_size(layout) or chain_keys.shape != (rows.shape[0], 16):
        raise ValueError(
            f"check_rows takes [n, {record_size(layout)}] records and [n, 16] chain keys; got "
            f"{tuple(rows.shape)} and {tuple(chain_keys.shape)}"
        )
    cuts = _cuts(layout)
    template = np.frombuffer(_header(layout, NO_PARENT, NO_PARENT), dtype=np.uint8)
    ok = (rows[:, :_KEY_AT] == template[:_KEY_AT]).all(1)
    ok &= (rows[:, _KEY_AT : _KEY_AT + 16] == chain_keys).all(1)
    ok &= (rows[:, _KEY_AT + 16 : HEADER.size] == template[_KEY_AT + 16 :]).all(1)
    stored = np.ascontiguousarray(rows[:, cuts[-1] :]).view("<u8")[:, 0]
    return ok & (rows_digests(rows[:, : cuts[-1]]) == stored)


def row_sections(layout: Layout, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Views of the keys' and values' bytes of each record in ``rows``: uint8 ``[rows, key bytes]``
    and ``[rows, value bytes]`` (the records' C-order ``[1, 1, page_size, dim]`` tensors for a
    one-layer, one-head layout)."""
    _, _, keys_at, values_at, end = _cuts(layout)
    return rows[:, keys_at : keys_at + _key_bytes(layout)], rows[:, values_at:end]


def _checked_header(layout: Layout, record: bytes | bytearray | memoryview) -> tuple[tuple[int, int, int, int, int], tuple[bytes, bytes]]:
    """The section offsets of a record of ``layout`` and its chain key and parent, once its
    header and length match; :class:`RecordError` otherwise."""
    if len(record) < HEADER.size + DIGEST.size:
        raise RecordError("record shorter than its header")
    magic, version, namespace, key, parent, layers, heads, size, head_dim, value_dim, dtype, length = HEADER.unpack_from(record)
    if magic != MAGIC or version != VERSION:
        raise RecordError(f"not a kvlib spilled page record of version {VERSION}")
    if namespace != layout.namespace:
        raise RecordError("record of another model, dtype, codec or salt")
    expected = (layout.layers, layout.heads, layout.page_size, layout.head_dim, layout.value_dim, DTYPE_CODES[layout.dtype])
    if (layers, heads, size, head_dim, value_dim, dtype) != expected:
        raise RecordError("record shape or dtype differs from this store's")
    cuts = _cuts(layout)
    if length != cuts[-1] - HEADER.size or len(record) != cuts[-1] + DIGEST.size:
        raise RecordError("record length differs from its header's")
    return cuts, (key, b"" if parent == NO_PARENT else parent)


def _header(layout: Layout, key: bytes, parent: bytes) -> bytes:
    """The header of a record of ``layout`` with 16-byte chain ``key`` and ``parent``."""
    return HEADER.pack(
        MAGIC,
        VERSION,
        layout.namespace,
        key,
        parent,
        layout.layers,
        layout.heads,
        layout.page_size,
        layout.head_dim,
        layout.value_dim,
        DTYPE_CODES[layout.dtype],
        _cuts(layout)[-1] - HEADER.size,
    )


def record_size(layout: Layout) -> int:
    """Bytes of one record of ``layout``."""
    return _cuts(layout)[-1] + DIGEST.size


def _key_bytes(layout: Layout) -> int:
    return layout.layers * layout.heads * layout.page_size * layout.head_dim * _ITEM[layout.dtype]


@functools.lru_cache(maxsize=64)
def _cuts(layout: Layout) -> tuple[int, int, int, int, int]:
    """Byte offsets of the header, token ids, keys (padded to 8 bytes) and values, and the end
    of the values (where the digest starts)."""
    values = layout.layers * layout.heads * layout.page_size * layout.value_dim * _ITEM[layout.dtype]
    tokens_at = HEADER.size
    keys_at = tokens_at + 8 * layout.page_size
    values_at = keys_at + (_key_bytes(layout) + 7) // 8 * 8
    return 0, tokens_at, keys_at, values_at, values_at + values


NO_PARENT = bytes(16)
"""The parent field of a chain's first block."""


def stored_chain_key(key: bytes) -> bytes:
    """A 16-byte chain key as stored in a record's header (both record kinds) (``b""``, no parent, as 16 zero bytes)."""
    if key == b"":
        return NO_PARENT
    if len(key) != 16:
        raise ValueError(f"chain keys are 16 bytes, got {len(key)}")
    return key
