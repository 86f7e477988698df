"""Dense, incrementally maintained view of one layer for one batch of sequences.

Attention kernels want ``[batch, kv_heads, tokens, head_dim]``. Gathering that from pages on
every decode step would copy the whole cache per step (what ``torch.cat`` does in
``DynamicCache``). A :class:`DenseReadCache` is filled once from the pages and then kept in step
by the store's appends (write-through), so a decode step writes only the new tokens. Any other
change to its sequences in that layer (compaction, release) drops it, and the next read rebuilds
it from the pages.

Invariant: for batch row ``b``, head ``h`` and ``i < lengths[b, h]``, slot ``i`` holds the
``i``-th stored token of that head; slots at or past ``lengths[b, h]`` hold zero keys and values,
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
    """Dense mirror of one layer for the batch of sequence ids ``rows`` (in that order)."""

    growth = 1.25
    """Capacity grows by this factor (amortized O(1) copies per appended token)."""

    def __init__(self, rows: tuple[int, ...], read: LayerRead, lengths: torch.Tensor, align: int) -> None:
        self.rows = rows
        self.align = align
        self._set_lengths(lengths.clone())
        self.keys = read.keys
        self.values = read.values
        self.positions = read.positions
        self.valid = read.valid

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions, self.valid))

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

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the mirror rows at indices ``keep`` (in that order): sequences left the batch."""
        index = to_arena_device(torch.tensor(keep, dtype=torch.int64), self.keys.device)
        self.rows = tuple(self.rows[i] for i in keep)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.positions, self.valid = self.positions.index_select(0, index), self.valid.index_select(0, index)
        self._set_lengths(self.lengths[torch.tensor(keep, dtype=torch.int64)])

    def add_rows(self, rows: tuple[int, ...], read: LayerRead, lengths: torch.Tensor) -> None:
        """Append sequences ``rows`` (their dense ``read``, zero past ``lengths [n, H]``) after the
        mirror's rows: sequences joined the batch."""
        self._ensure_capacity(read.keys.shape[2])
        size = self.capacity
        parts = [_pad_tokens(t, size, fill) for t, fill in zip(read, (0, 0, -1, False))]
        self.keys = torch.cat([self.keys, parts[0]])
        self.values = torch.cat([self.values, parts[1]])
        self.positions = torch.cat([self.positions, parts[2]])
        self.valid = torch.cat([self.valid, parts[3]])
        self.rows = self.rows + tuple(rows)
        self._set_lengths(torch.cat([self.lengths, lengths]))

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Mirror a truncation: each head keeps its first ``new_lengths [B, H]`` slots (no more than
        it had); the slots after them return to zeros, position -1 and invalid."""
        gone = to_arena_device(torch.arange(self.capacity) >= new_lengths.unsqueeze(-1), self.keys.device)
        self.keys.masked_fill_(gone.unsqueeze(-1), 0)
        self.values.masked_fill_(gone.unsqueeze(-1), 0)
        self.positions.masked_fill_(gone, -1)
        self.valid.masked_fill_(gone, False)
        self._set_lengths(new_lengths.clone())

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        size = max(needed, int(self.capacity * self.growth))
        size = -(-size // self.align) * self.align
        self.keys = _pad_tokens(self.keys, size, 0)
        self.values = _pad_tokens(self.values, size, 0)
        self.positions = _pad_tokens(self.positions, size, -1)
        self.valid = _pad_tokens(self.valid, size, False)


def _pad_tokens(tensor: torch.Tensor, size: int, fill: int | bool) -> torch.Tensor:
    """``tensor`` with dim 2 extended to ``size`` (a copy; the tensor itself when already that
    size), new slots set to ``fill``."""
    if tensor.shape[2] == size:
        return tensor
    shape = list(tensor.shape)
    shape[2] = size
    out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    out[:, :, : tensor.shape[2]] = tensor
    return out
