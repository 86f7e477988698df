"""The on-disk record of one prefix block: a fixed header, token ids, raw page bytes, a checksum.

Layout (little endian)::

    header  HEADER (below): magic b"KVLP", format version, namespace digest, the block's key and
            its parent's key (hash chain), layers, KV heads, page size, head dim, value dim,
            dtype code, body length in bytes
    body    token ids (int64 x page_size), then keys (layers x heads x page_size x head_dim) and
            values (layers x heads x page_size x value_dim) in the dtype, C order
    digest  CRC-32 of header + body (detects every burst of up to 32 flipped bits, so any
            single corrupted byte; at 4+ GB/s it keeps reads near the disk's speed)

Nothing is pickled and nothing read is executed: :func:`decode` checks the magic, version,
namespace, the shape and dtype the reader expects, the body length and the digest, and raises
:class:`RecordError` on any mismatch (the caller treats it as a miss).
"""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"KVLP"
VERSION = 1
HEADER = struct.Struct("<4sH16s16s16sHHHHHBQ")
DIGEST_BYTES = 4
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


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


def encode(layout: Layout, block: Block) -> bytes:
    """The record bytes of ``block`` (keys and values in ``layout.dtype`` on any device)."""
    if len(block.tokens) != layout.page_size:
        raise ValueError(f"a block holds {layout.page_size} tokens, got {len(block.tokens)}")
    tokens = torch.tensor(block.tokens, dtype=torch.int64)
    body = b"".join(
        t.detach().to("cpu", layout.dtype).contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.int64
        else t.numpy().tobytes()
        for t in (tokens, block.keys, block.values)
    )
    header = HEADER.pack(
        MAGIC, VERSION, layout.namespace, _pad(block.key), _pad(block.parent), layout.layers, layout.heads,
        layout.page_size, layout.head_dim, layout.value_dim, DTYPE_CODES[layout.dtype], len(body),
    )
    return header + body + _digest(header + body)


def decode(layout: Layout, record: bytes | memoryview) -> Block:
    """The block in ``record`` (bytes, or a buffer valid during the call: the tensors returned own
    their memory); :class:`RecordError` unless every check passes."""
    record = memoryview(record)
    if len(record) < HEADER.size + DIGEST_BYTES:
        raise RecordError("record shorter than its header")
    if _digest(record[:-DIGEST_BYTES]) != bytes(record[-DIGEST_BYTES:]):
        raise RecordError("checksum mismatch")
    header, body = bytes(record[: HEADER.size]), record[HEADER.size : -DIGEST_BYTES]
    magic, version, namespace, key, parent, layers, heads, size, head_dim, value_dim, dtype, length = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise RecordError(f"not a kvlib page record of version {VERSION}")
    if namespace != layout.namespace:
        raise RecordError("record of another model, dtype, codec or salt")
    expected = (layout.layers, layout.heads, layout.page_size, layout.head_dim, layout.value_dim, DTYPE_CODES[layout.dtype])
    if (layers, heads, size, head_dim, value_dim, dtype) != expected or length != len(body):
        raise RecordError("record shape or dtype differs from this store's")
    item = torch.empty((), dtype=layout.dtype).element_size()
    token_bytes = 8 * size
    key_bytes = layers * heads * size * head_dim * item
    with warnings.catch_warnings():  # a read-only buffer: only read here, copied below
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(body, dtype=torch.uint8)
    tokens = raw[:token_bytes].view(torch.int64).tolist()
    keys = raw[token_bytes : token_bytes + key_bytes].view(layout.dtype).view(layers, heads, size, head_dim).clone()
    values = raw[token_bytes + key_bytes :].view(layout.dtype).view(layers, heads, size, value_dim).clone()
    return Block(key, b"" if parent == NO_PARENT else parent, tokens, keys, values)


def _digest(data: bytes | memoryview) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


NO_PARENT = bytes(16)
"""The parent field of a chain's first block."""


def _pad(key: bytes) -> bytes:
    """A 16-byte chain key as stored (``b""``, no parent, as 16 zero bytes)."""
    if key == b"":
        return NO_PARENT
    if len(key) != 16:
        raise ValueError(f"chain keys are 16 bytes, got {len(key)}")
    return key
