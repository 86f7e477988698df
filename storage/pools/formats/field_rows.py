"""A coded page's encoded fields packed into two byte rows: how a coded page travels between tiers.

A tiered coded pool (:mod:`kvlib.storage.pools.formats.tiered_coded_format`) keeps its sealed pages in a tiered
pool of byte pages: one page per sealed page, whose key row holds the key codec's fields (names
``key.*``) and whose value row holds the rest, each field's bytes at a fixed offset. The rows
move between device, host and disk as they are (encoded: never decoded on the way), and the
fields are read back as views of the rows, no copy.

Layout: within a row, fields are laid out by decreasing item size, so every field starts at a
multiple of its own item size; a row is padded to a multiple of :data:`ROW_ALIGN` bytes, so
that each field of each row of an arena is aligned too and ``view(dtype)`` applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.codec import Field, arena_dtype

ROW_ALIGN = 8
"""Bytes a packed row's length is a multiple of (the largest item size of a field)."""

KEY_PREFIX = "key."
"""Fields whose names start with this go into the key row (the key codec's, see :class:`~kvlib.codec.PageCodec`)."""


@dataclass(frozen=True)
class FieldRows:
    """Where each of ``fields`` lies in a page's two byte rows: ``places[name] = (row, offset)``
    (``row`` 0 for the key row, 1 for the value row; ``offset`` in bytes), rows of
    ``key_bytes`` and ``value_bytes`` bytes (each a multiple of :data:`ROW_ALIGN`, at least one
    of it)."""

    fields: dict[str, Field]
    places: dict[str, tuple[int, int]]
    key_bytes: int
    value_bytes: int

    @classmethod
    def of(cls, fields: dict[str, Field]) -> FieldRows:
        """The layout of a codec's ``fields`` (see the module docstring)."""
        used = [0, 0]
        places: dict[str, tuple[int, int]] = {}
        for name, field in sorted(fields.items(), key=lambda item: -item[1].dtype.itemsize):
            row = 0 if name.startswith(KEY_PREFIX) else 1
            places[name] = (row, used[row])
            used[row] += field.nbytes
        key_bytes, value_bytes = (max(ROW_ALIGN, math.ceil(size / ROW_ALIGN) * ROW_ALIGN) for size in used)
        return cls(dict(fields), places, key_bytes, value_bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's two rows (its fields and their padding)."""
        return self.key_bytes + self.value_bytes

    def pack(self, encoded: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``n`` pages' ``encoded`` fields (each ``[n, *field.shape]``, any dtype that
        converts to the field's; on one device): uint8 ``[n, 1, key_bytes]`` and ``[n, 1,
        value_bytes]`` on that device, padding zero."""
        if set(encoded) != set(self.fields):
            raise ValueError(f"encoded fields {sorted(encoded)} differ from the codec's {sorted(self.fields)}")
        first = next(iter(encoded.values()))
        n = first.shape[0]
        rows = [torch.zeros(n, size, dtype=torch.uint8, device=first.device) for size in (self.key_bytes, self.value_bytes)]
        for name, tensor in encoded.items():
            field = self.fields[name]
            row, offset = self.places[name]
            data = tensor.to(field.dtype).contiguous().view(n, -1).view(torch.uint8)
            rows[row][:, offset : offset + field.nbytes] = data
        return rows[0].unsqueeze(1), rows[1].unsqueeze(1)

    def views(self, key_rows: torch.Tensor, value_rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The field arenas of pages held as rows ``key_rows`` (uint8 ``[m, 1, key_bytes]``, its
        rows of stride ``key_bytes``) and ``value_rows``: per field a view ``[m, *field.shape]``
        (no copy; one-byte floats as uint8, as a coded pool's field arenas hold them)."""
        rows = (key_rows.view(key_rows.shape[0], -1), value_rows.view(value_rows.shape[0], -1))
        out = {}
        for name, field in self.fields.items():
            row, offset = self.places[name]
            dtype = arena_dtype(field.dtype)
            out[name] = rows[row][:, offset : offset + field.nbytes].view(dtype).unflatten(1, field.shape)
        return out
