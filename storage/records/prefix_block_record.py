"""The record of one prefix block (on disk, on the remote tier, in a hand-over): a header, token ids,
each layer's stored page fields, a checksum.

A block is ``page_size`` prompt tokens of every layer and KV head. Each layer's pool says what
one of its pages is stored as (:meth:`~kvlib.storage.pools.page_pool.PagePool.record_fields`): keys
and values in the compute dtype for an exact pool, the codec's encoded fields (codes, scales,
zero points) for a coded one. The record holds exactly those bytes: a coded page is written and
read back as its fields, never decoded on the way (so a restored page equals the page that was
written, bit for bit, and the bytes on disk are the encoded bytes). A live sequence's spilled
page has its own record (:mod:`~kvlib.storage.records.spilled_page_record`, magic ``b"KVLS"``).

Layout (little endian)::

    header  HEADER (below): magic b"KVLP", format version, namespace digest (model, dtype,
            codec spec, device, page size, salt), the block's key and its parent's key (hash
            chain), layers, KV heads, page size, the field table's digest (every layer's field
            names, per-page shapes and dtypes), body coding (0 plain, 1 entropy-coded), body length
    body    token ids (int64 x page_size), then
            plain:   for each layer, each field in order: ``[heads, *shape]`` in its dtype, C order,
                     zero-padded to a multiple of 8 bytes
            entropy: one :mod:`~kvlib.storage.records.entropy_code` stream of those bytes, regrouped: one
                     array per field name and byte plane (byte ``b`` of every element), all layers
                     together, so each array holds bytes of one distribution (an fp16 scale's
                     exponent bytes apart from its mantissa's low byte)
    digest  64-bit :mod:`~kvlib.storage.records.record_digest` digest (XXH3-64) of the header and the body

Format 5 (this one) replaced format 4's fixed keys-and-values body with the field table; a
record of another version fails its header check, so records of an earlier kvlib are misses.

Nothing is pickled and nothing read is executed: :func:`decode_parts` checks the magic, version,
namespace, shape, field digest and body length against the layout before touching the body, then
the digest, then (entropy-coded) that the stream decodes to exactly the expected bytes; any
mismatch is a :class:`RecordError` (a ``ValueError``: the disk tier counts it corrupt, a miss).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvlib.codec import Field
from kvlib.storage.records import entropy_code
from kvlib.storage.records.record_digest import digest
from kvlib.storage.records.spilled_page_record import NO_PARENT, RecordError, stored_chain_key

MAGIC = b"KVLP"
VERSION = 5
HEADER = struct.Struct("<4sH16s16s16sHHH16sBQ3x")
"""88 bytes: the body starts 8-byte aligned."""
DIGEST = struct.Struct("<Q")
PLAIN, ENTROPY = 0, 1


@dataclass(frozen=True)
class BlockLayout:
    """What a reader expects of a record: its namespace digest, KV heads, page size and each
    layer's ``(name, Field)`` pairs in record order; ``entropy``: whether records are written
    entropy-coded (either kind is read)."""

    namespace: bytes
    heads: int
    page_size: int
    layers: tuple[tuple[tuple[str, Field], ...], ...]
    entropy: bool = False

    @functools.cached_property
    def fields_digest(self) -> bytes:
        """16 bytes naming every layer's fields, shapes and dtypes (in the header)."""
        text = repr([[(name, field.shape, str(field.dtype)) for name, field in layer] for layer in self.layers])
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    @functools.cached_property
    def sections(self) -> tuple[tuple[int, str, int], ...]:
        """``(layer, field name, bytes)`` of each body section in order (bytes of all heads, unpadded)."""
        return tuple((layer, name, self.heads * field.nbytes) for layer, fields in enumerate(self.layers) for name, field in fields)

    @functools.cached_property
    def groups(self) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
        """``(field name, element bytes, indices of its sections)`` per field name and element
        size, first-seen order: what an entropy-coded record codes together."""
        groups: dict[tuple[str, int], list[int]] = {}
        for i, (layer, name, _) in enumerate(self.sections):
            width = torch.empty((), dtype=dict(self.layers[layer])[name].dtype).element_size()
            groups.setdefault((name, width), []).append(i)
        return tuple((name, width, tuple(members)) for (name, width), members in groups.items())

    @functools.cached_property
    def field_bytes(self) -> int:
        """Bytes of every field of a block (all layers and heads)."""
        return sum(size for _, _, size in self.sections)

    @functools.cached_property
    def layer_sections(self) -> tuple[tuple[tuple[int, str, Field, int], ...], ...]:
        """Per layer, ``(section index, name, field, bytes)`` of its sections."""
        out, i = [], 0
        for fields in self.layers:
            out.append(tuple((i + k, name, field, self.heads * field.nbytes) for k, (name, field) in enumerate(fields)))
            i += len(fields)
        return tuple(out)

    @functools.cached_property
    def plain_places(self) -> tuple[tuple[int, int], ...]:
        """``(0, byte offset)`` of each section in a plain record."""
        at, places = HEADER.size + 8 * self.page_size, []
        for _, _, size in self.sections:
            places.append((0, at))
            at += _padded(size)
        return tuple(places)

    @functools.cached_property
    def group_places(self) -> tuple[tuple[int, int], ...]:
        """``(field group, byte offset)`` of each section among the groups an entropy-coded record decodes to."""
        places: list[tuple[int, int]] = [(0, 0)] * len(self.sections)
        for group, (_, _, members) in enumerate(self.groups):
            at = 0
            for i in members:
                places[i] = (group, at)
                at += self.sections[i][2]
        return tuple(places)

    @functools.cached_property
    def plain_size(self) -> int:
        """Bytes of a plain record."""
        return HEADER.size + 8 * self.page_size + sum(_padded(size) for _, _, size in self.sections) + DIGEST.size


@dataclass
class FieldBlock:
    """A block as stored: its chain key and parent key, its token ids, and per layer each field
    of its pages, ``{name: [heads, *field.shape]}`` in the field's dtype."""

    key: bytes
    parent: bytes
    tokens: list[int]
    layers: Sequence[dict[str, torch.Tensor]]


def encode(layout: BlockLayout, block: FieldBlock) -> bytes | memoryview:
    """The record of ``block`` (tensors on any device), plain or entropy-coded as ``layout`` says."""
    if len(block.tokens) != layout.page_size:
        raise ValueError(f"a block holds {layout.page_size} tokens, got {len(block.tokens)}")
    if len(block.layers) != len(layout.layers):
        raise ValueError(f"a block of {len(block.layers)} layers; the layout has {len(layout.layers)}")
    sections = [_bytes_of(block.layers[layer][name], size) for layer, name, size in layout.sections]
    tokens = np.asarray(block.tokens, dtype=np.int64).view(np.uint8)
    if layout.entropy:
        body = entropy_code.encode(_planes(layout, sections))
        head = _header(layout, block, ENTROPY, tokens.nbytes + len(body))
        return b"".join([head, tokens.tobytes(), body, DIGEST.pack(digest(head, tokens, body))])
    out = np.zeros(layout.plain_size, dtype=np.uint8)
    out[: HEADER.size] = np.frombuffer(_header(layout, block, PLAIN, layout.plain_size - HEADER.size - DIGEST.size), dtype=np.uint8)
    at = HEADER.size
    out[at : at + tokens.nbytes] = tokens
    at += tokens.nbytes
    for section in sections:
        out[at : at + section.nbytes] = section
        at += _padded(section.nbytes)
    DIGEST.pack_into(out, at, digest(out[:at]))
    return memoryview(out)


def decode_parts(layout: BlockLayout, parts: list) -> FieldBlock:
    """The block in a record given as ``parts`` (buffers valid during the call, such as a
    :class:`~kvlib.storage.tiers.disk_tier.DiskTier` record's parts in the map) whose concatenation is
    the record; :class:`RecordError` unless every check passes. The tensors returned own their
    memory (the parts are joined into a fresh buffer first)."""
    record = np.frombuffer(bytearray().join(parts), dtype=np.uint8)
    if record.size < HEADER.size + DIGEST.size:
        raise RecordError("record shorter than its header")
    magic, version, namespace, key, parent, layers, heads, size, fields, coding, length = HEADER.unpack_from(record)
    if magic != MAGIC or version != VERSION:
        raise RecordError(f"not a kvlib block record of version {VERSION}")
    if namespace != layout.namespace:
        raise RecordError("record of another model, dtype, codec or salt")
    if (layers, heads, size, fields) != (len(layout.layers), layout.heads, layout.page_size, layout.fields_digest):
        raise RecordError("record shape or fields differ from this store's")
    end = HEADER.size + length
    if coding not in (PLAIN, ENTROPY) or record.size != end + DIGEST.size or (coding == PLAIN and record.size != layout.plain_size):
        raise RecordError("record length or coding differs from its header's")
    if length < 8 * size or digest(record[:end]) != DIGEST.unpack_from(record, end)[0]:
        raise RecordError("checksum mismatch")
    tokens_end = HEADER.size + 8 * size
    tokens = record[HEADER.size : tokens_end].view(np.int64).tolist()
    if coding == ENTROPY:
        fields = LayerFields(layout, _unplanes(layout, record[tokens_end:end]), layout.group_places)
    else:
        fields = LayerFields(layout, [record], layout.plain_places)
    return FieldBlock(key, b"" if parent == NO_PARENT else parent, tokens, fields)


class LayerFields(Sequence):
    """A decoded record's fields, per layer (``fields[layer][name]``: ``[heads, *shape]`` in the
    field's dtype), viewed out of the decoded bytes when a layer is read (a record of 30 layers
    holds some 180 fields: building every view up front would cost more than decoding them)."""

    def __init__(self, layout: BlockLayout, buffers: list[np.ndarray], places: tuple[tuple[int, int], ...]) -> None:
        self.layout = layout
        self.buffers = buffers
        """Decoded bytes: the record (plain) or one array per field group (entropy-coded)."""
        self.places = places
        """``(buffer, byte offset)`` of each of the layout's sections."""

    def __len__(self) -> int:
        return len(self.layout.layers)

    def __getitem__(self, layer: int) -> dict[str, torch.Tensor]:
        heads, out = self.layout.heads, {}
        for i, name, field, nbytes in self.layout.layer_sections[layer]:
            buffer, at = self.places[i]
            out[name] = torch.from_numpy(self.buffers[buffer][at : at + nbytes]).view(field.dtype).view(heads, *field.shape)
        return out


def _planes(layout: BlockLayout, sections: list[np.ndarray]) -> list[np.ndarray]:
    """Arrays to entropy-code: for each field name (first-seen order) and byte plane of its
    elements, that plane of every layer's section of the name, concatenated."""
    arrays = []
    for _, width, members in layout.groups:
        joined = np.concatenate([sections[i] for i in members]).reshape(-1, width)
        arrays += [joined[:, plane] for plane in range(width)]
    return arrays


def _unplanes(layout: BlockLayout, body: np.ndarray) -> list[np.ndarray]:
    """Each field group's bytes (its sections back to back) from an entropy-coded body (inverse of
    :func:`_planes`); :class:`RecordError` unless the stream holds exactly the arrays the layout
    expects."""
    try:
        arrays = entropy_code.decode(body, max_bytes=layout.field_bytes)
    except entropy_code.EntropyCodeError as error:
        raise RecordError(f"entropy-coded body: {error}") from None
    groups, at = [], 0
    for name, width, members in layout.groups:
        total = sum(layout.sections[i][2] for i in members)
        planes = arrays[at : at + width]
        at += width
        if len(planes) != width or any(plane.size != total // width for plane in planes):
            raise RecordError(f"entropy-coded body: field {name!r} does not decode to {total} bytes")
        if width == 1:
            groups.append(planes[0])
            continue
        joined = np.empty((total // width, width), dtype=np.uint8)
        for plane, array in enumerate(planes):
            joined[:, plane] = array
        groups.append(joined.reshape(-1))
    if at != len(arrays):
        raise RecordError("entropy-coded body: more arrays than the layout's fields")
    return groups


def _bytes_of(tensor: torch.Tensor, size: int) -> np.ndarray:
    """``tensor``'s bytes on the CPU, flat (its own memory when contiguous there); ``ValueError``
    unless they are ``size`` bytes."""
    tensor = tensor.detach().to("cpu").contiguous()
    flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8).reshape(-1)
    if flat.numel() != size:
        raise ValueError(f"a block field of {flat.numel()} bytes; the layout expects {size}")
    return flat.numpy()


def _header(layout: BlockLayout, block: FieldBlock, coding: int, length: int) -> bytes:
    return HEADER.pack(
        MAGIC,
        VERSION,
        layout.namespace,
        stored_chain_key(block.key),
        stored_chain_key(block.parent),
        len(layout.layers),
        layout.heads,
        layout.page_size,
        layout.fields_digest,
        coding,
        length,
    )


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8
