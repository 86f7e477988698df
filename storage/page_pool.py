"""Page arena for one layer on one device: key, value and position pages with a free list.

A page holds ``page_size`` consecutive stored tokens of one KV head:

- ``keys[page]``: ``[page_size, head_dim]`` in the compute dtype,
- ``values[page]``: ``[page_size, value_dim]`` in the compute dtype,
- ``positions[page]``: ``[page_size]`` int64, the original absolute position of each token.

Invariants (checked by ``tests/kvlib/test_store_state_machine.py`` after every step):

- every page id in ``[0, capacity)`` is either *free* (reference count 0, on the free stack
  exactly once) or *in use* (reference count >= 1, not on the free stack);
- ``bytes_in_use() == pages_in_use * page_bytes``.

Allocation pops from and release pushes onto a tensor-backed stack, so both cost O(1) per page
and are vectorized over many pages. A growable pool doubles its capacity when it runs out
(amortized O(1) per page); a fixed pool raises :class:`~kvlib.errors.PoolExhaustedError`
before changing anything.
"""

from __future__ import annotations

import torch

from kvlib.devices import to_arena_device
from kvlib.errors import PoolExhaustedError

_POSITION_DTYPE = torch.int64


class PagePool:
    """Arena of KV pages for one layer on one device.

    Args:
        page_size: tokens per page.
        head_dim: key channels per token.
        value_dim: value channels per token (equal to ``head_dim`` for most models).
        dtype: compute dtype of keys and values.
        device: where the arena lives.
        capacity: pages allocated up front.
        fixed: if True the pool never grows (the scheduler's mode); otherwise it doubles.
    """

    def __init__(
        self,
        page_size: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = 64,
        fixed: bool = False,
    ) -> None:
        for name, value in (("page_size", page_size), ("head_dim", head_dim), ("value_dim", value_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(capacity, int) or capacity < (1 if fixed else 0):
            raise ValueError(f"capacity must be an int >= {1 if fixed else 0}, got {capacity!r}")
        self.page_size = page_size
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.dtype = dtype
        self.device = device
        self.fixed = fixed
        self.keys = torch.zeros(capacity, page_size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(capacity, page_size, value_dim, dtype=dtype, device=device)
        self.positions = torch.full((capacity, page_size), -1, dtype=_POSITION_DTYPE, device=device)
        self.refcount = torch.zeros(capacity, dtype=torch.int64)
        # Free stack: ids in [0, _free_top) are free; the top of the stack is the lowest id.
        self._free_stack = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)
        self._free_top = capacity

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Pages in the arena, free or in use."""
        return self.keys.shape[0]

    @property
    def free_pages(self) -> int:
        return self._free_top

    @property
    def pages_in_use(self) -> int:
        return self.capacity - self._free_top

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of keys and values in one page."""
        item = self.keys.element_size()
        return self.page_size * (self.head_dim + self.value_dim) * item

    @property
    def position_page_bytes(self) -> int:
        """Bytes of stored positions in one page."""
        return self.page_size * self.positions.element_size()

    @property
    def page_bytes(self) -> int:
        """All bytes one page holds: keys, values and positions."""
        return self.kv_page_bytes + self.position_page_bytes

    def bytes_in_use(self) -> int:
        """Bytes held by pages in use (keys, values, positions); free pages are not counted."""
        return self.pages_in_use * self.page_bytes

    def bytes_reserved(self) -> int:
        """Bytes of the whole arena, free pages included."""
        return self.capacity * self.page_bytes

    def free_page_ids(self) -> torch.Tensor:
        """The free stack's contents (a copy), for checks and debugging."""
        return self._free_stack[: self._free_top].clone()

    # -- allocation ----------------------------------------------------------------------------

    def can_allocate(self, count: int) -> bool:
        return not self.fixed or count <= self._free_top

    def allocate(self, count: int) -> torch.Tensor:
        """Take ``count`` free pages (reference count 1 each); returns their ids, int64 on CPU."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > self._free_top:
            if self.fixed:
                raise PoolExhaustedError(
                    f"page pool is full: {count} pages requested, {self._free_top} free of {self.capacity}"
                )
            self._grow(self.pages_in_use + count)
        top = self._free_top
        ids = self._free_stack[top - count : top].flip(0)
        self._free_top = top - count
        self.refcount[ids] = 1
        return ids

    def incref(self, ids: torch.Tensor) -> None:
        """Add one reference per occurrence of each id; every id must be in use."""
        if ids.numel() == 0:
            return
        if bool((self.refcount[ids] < 1).any()):
            raise RuntimeError("incref of a free page: the block tables and the pool disagree")
        self.refcount.index_add_(0, ids, torch.ones_like(ids))

    def decref(self, ids: torch.Tensor) -> None:
        """Drop one reference per occurrence of each id; pages reaching zero return to the free list."""
        if ids.numel() == 0:
            return
        unique, counts = torch.unique(ids, return_counts=True)
        remaining = self.refcount[unique] - counts
        if bool((remaining < 0).any()):
            raise RuntimeError("page released more often than referenced: double free")
        self.refcount[unique] = remaining
        freed = unique[remaining == 0]
        top = self._free_top
        self._free_stack[top : top + freed.numel()] = freed.flip(0)
        self._free_top = top + freed.numel()

    def _grow(self, min_capacity: int) -> None:
        """Double the arena (at least to ``min_capacity``); existing page ids stay valid."""
        old = self.capacity
        new = max(2 * old, min_capacity, 1)
        self.keys = _extend(self.keys, new, 0)
        self.values = _extend(self.values, new, 0)
        self.positions = _extend(self.positions, new, -1)
        self.refcount = _extend(self.refcount, new, 0)
        stack = torch.empty(new, dtype=torch.int64)
        # New ids go below the existing free ids: those are handed out first, then the new ids, lowest first.
        added = torch.arange(new - 1, old - 1, -1, dtype=torch.int64)
        stack[: added.numel()] = added
        stack[added.numel() : added.numel() + self._free_top] = self._free_stack[: self._free_top]
        self._free_stack = stack
        self._free_top += added.numel()

    # -- data ----------------------------------------------------------------------------------

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write tokens to flat slots (``page * page_size + offset``).

        ``slots``: int64 ``[n]`` on CPU; ``keys``: ``[n, head_dim]``; ``values``: ``[n, value_dim]``;
        ``positions``: int64 ``[n]``. Pages must be owned by the writer (copy-on-write is the
        store's job).
        """
        index = to_arena_device(slots, self.device)
        self.keys.view(-1, self.head_dim).index_copy_(0, index, keys)
        self.values.view(-1, self.value_dim).index_copy_(0, index, values)
        self.positions.view(-1).index_copy_(0, index, positions.to(self.device, _POSITION_DTYPE))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read tokens at flat slots: ``(keys [n, head_dim], values [n, value_dim], positions [n])``."""
        index = to_arena_device(slots, self.device)
        return (
            self.keys.view(-1, self.head_dim).index_select(0, index),
            self.values.view(-1, self.value_dim).index_select(0, index),
            self.positions.view(-1).index_select(0, index),
        )

    def copy_pages(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy whole pages ``source[i]`` onto ``target[i]`` (copy-on-write)."""
        src = to_arena_device(source, self.device)
        dst = to_arena_device(target, self.device)
        self.keys.index_copy_(0, dst, self.keys.index_select(0, src))
        self.values.index_copy_(0, dst, self.values.index_select(0, src))
        self.positions.index_copy_(0, dst, self.positions.index_select(0, src))


def _extend(tensor: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """A copy of ``tensor`` with ``rows`` rows along dim 0, new rows set to ``fill``."""
    out = torch.full((rows, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    return out

