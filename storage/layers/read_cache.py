"""Dense, incrementally maintained view of one layer for one batch of sequences.

Attention kernels want ``[batch, kv_heads, tokens, head_dim]``. Gathering that from pages on
every decode step would copy the whole cache per step (what ``torch.cat`` does in
``DynamicCache``). A :class:`DenseReadCache` is filled once from the pages and then kept in step
by the store's appends (write-through), so a decode step writes only the new tokens. A
compaction that reuses slots is followed by moving the same few tokens (:meth:`DenseReadCache.fill_holes`);
any other change to its sequences in that layer (an in-order compaction, release) drops it, and
the next read rebuilds it from the pages.

Invariant: for batch row ``b``, head ``h`` and ``i < lengths[b, h]``, slot ``i`` holds the
token in that head's slot ``i`` of the store; slots at or past ``lengths[b, h]`` hold zero keys and values,
position ``-1`` and ``valid == False`` (zeros, not garbage, so masked scores stay finite).
Its bytes are a workspace beside the pages and are reported as such by the store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvlib.devices import to_arena_device


class LayerRead(NamedTuple):
    """One layer of a batch of sequences in dense form (physical slots, padded at the end).

    keys: ``[batch, kv_heads, max_len, head_dim]``; values: ``[batch, kv_heads, max_len, value_dim]``;
    positions: int64 ``[batch, kv_heads, max_len]``, original absolute positions, ``-1`` where
    invalid; valid: bool ``[batch, kv_heads, max_len]``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


class DenseReadCache:
    """Dense read cache of one layer for the batch of sequence ids ``rows`` (in that order).

    Buffers have room for more rows and tokens than in use (both grow geometrically), so
    sequences leaving the batch (:meth:`drop_rows`: the last rows move into their places) or
    joining it (:meth:`add_rows`) cost a copy of those rows only.
    """

    growth = 1.25
    """Capacity grows by this factor (amortized O(1) copies per appended token or row)."""

    def __init__(self, rows: tuple[int, ...], read: LayerRead, lengths: torch.Tensor, align: int) -> None:
        self.rows = rows
        self.align = align
        self._set_lengths(lengths.clone())
        self._buffers = list(read)

    keys = property(lambda self: self._buffers[0][: len(self.rows)])
    values = property(lambda self: self._buffers[1][: len(self.rows)])
    positions = property(lambda self: self._buffers[2][: len(self.rows)])
    valid = property(lambda self: self._buffers[3][: len(self.rows)])

    @property
    def capacity(self) -> int:
        return self._buffers[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers)

    def drop_rows(self, gone: set[int]) -> None:
        """Forget the rows of sequences ``gone``; each freed row takes the last remaining one
        (so ``rows`` changes order, and one row is copied per sequence gone)."""
        rows, order = list(self.rows), list(range(len(self.rows)))
        index = 0
        while index < len(rows):
            if rows[index] in gone:
                rows[index], order[index] = rows[-1], order[-1]
                rows.pop()
                order.pop()
            else:
                index += 1
        moved = [(target, source) for target, source in enumerate(order) if target != source]
        if moved:
            target, source = (torch.tensor(side, dtype=torch.int64) for side in zip(*moved))
            device_target, device_source = (to_arena_device(side, self._buffers[0].device) for side in (target, source))
            for buffer in self._buffers:
                buffer[device_target] = buffer[device_source]
        self.rows = tuple(rows)
        self._set_lengths(self.lengths[torch.tensor(order, dtype=torch.int64)])

    def add_rows(self, rows: tuple[int, ...], read: LayerRead, lengths: torch.Tensor) -> None:
        """Append sequences ``rows`` (their dense ``read``, zero past ``lengths [n, H]``) after
        the cache's rows."""
        count, added = len(self.rows), len(rows)
        self._ensure_capacity(read.keys.shape[2])
        if count + added > self._buffers[0].shape[0]:
            grown = max(count + added, int(self._buffers[0].shape[0] * self.growth) + 1)
            self._buffers = [_pad_rows(buffer, grown) for buffer in self._buffers]
        width = read.keys.shape[2]
        for buffer, part, fill in zip(self._buffers, read, (0, 0, -1, False)):
            buffer[count : count + added, :, :width] = part
            buffer[count : count + added, :, width:] = fill
        self.rows = self.rows + tuple(rows)
        self._set_lengths(torch.cat([self.lengths, lengths]))

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        """Set per-head lengths; ``longest`` and ``uniform`` (every head equally long) follow."""
        self.lengths = lengths
        self.longest = int(lengths.max()) if lengths.numel() else 0
        self.uniform = bool((lengths == self.longest).all())

    def view(self) -> LayerRead:
        """The current contents, narrowed to the longest head (views, valid until the next write)."""
        length = self.longest
        return LayerRead(
            self.keys[:, :, :length],
            self.values[:, :, :length],
            self.positions[:, :, :length],
            self.valid[:, :, :length],
        )

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Mirror an append of ``keys [B, H, T, D]`` (positions ``[B, H, T]``) after each head's end."""
        steps = keys.shape[2]
        self._ensure_capacity(self.longest + steps)
        if self.uniform:
            first, end = self.longest, self.longest + steps
            self.keys[:, :, first:end] = keys
            self.values[:, :, first:end] = values
            self.positions[:, :, first:end] = positions
            self.valid[:, :, first:end] = True
            self.lengths += steps
            self.longest = end
            return
        start = self.lengths
        batch, heads = start.shape
        b = torch.arange(batch).view(batch, 1, 1).expand(batch, heads, steps)
        h = torch.arange(heads).view(1, heads, 1).expand(batch, heads, steps)
        t = start.unsqueeze(-1) + torch.arange(steps)
        index = tuple(to_arena_device(i, self.keys.device) for i in (b, h, t))
        self.keys[index] = keys
        self.values[index] = values
        self.positions[index] = positions
        self.valid[index] = True
        self._set_lengths(start + steps)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Mirror a truncation: each head keeps its first ``new_lengths [B, H]`` slots (no more than
        it had); the slots after them return to zeros, position -1 and invalid."""
        gone = to_arena_device(torch.arange(self.capacity) >= new_lengths.unsqueeze(-1), self.keys.device)
        self.keys.masked_fill_(gone.unsqueeze(-1), 0)
        self.values.masked_fill_(gone.unsqueeze(-1), 0)
        self.positions.masked_fill_(gone, -1)
        self.valid.masked_fill_(gone, False)
        self._set_lengths(new_lengths.clone())

    def fill_holes(self, row: torch.Tensor, head: torch.Tensor, hole: torch.Tensor, source: torch.Tensor, lengths: torch.Tensor) -> None:
        """Mirror a compaction that reused slots (:mod:`~kvlib.storage.layers.slot_reuse`): slot ``hole[i]`` of
        cache row ``row[i]``, head ``head[i]`` takes the token at slot ``source[i]`` (int64, CPU);
        then each head holds its first ``lengths [B, H]`` slots (no more than it had), and the
        slots it gave up return to zeros, position -1 and invalid. Writes only those slots."""
        device = self.keys.device
        if row.numel():
            target = tuple(to_arena_device(i, device) for i in (row, head, hole))
            origin = tuple(to_arena_device(i, device) for i in (row, head, source))
            for buffer in self._buffers:
                buffer[target] = buffer[origin]
        slot = torch.arange(self.longest)
        b, h, s = ((slot >= lengths.unsqueeze(-1)) & (slot < self.lengths.unsqueeze(-1))).nonzero(as_tuple=True)
        if b.numel():
            vacated = tuple(to_arena_device(i, device) for i in (b, h, s))
            for buffer, fill in zip(self._buffers, (0, 0, -1, False)):
                buffer[vacated] = fill
        self._set_lengths(lengths)

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        size = max(needed, int(self.capacity * self.growth))
        size = -(-size // self.align) * self.align
        self._buffers = [_pad_tokens(buffer, size, fill) for buffer, fill in zip(self._buffers, (0, 0, -1, False))]


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of ``tensor`` with dim 0 extended to ``rows`` (new rows uninitialised: written before use)."""
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    return out


def _pad_tokens(tensor: torch.Tensor, size: int, fill: int | bool) -> torch.Tensor:
    """A copy of ``tensor`` with dim 2 extended to ``size``, new slots set to ``fill``."""
    shape = list(tensor.shape)
    shape[2] = size
    out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    out[:, :, : tensor.shape[2]] = tensor
    return out
