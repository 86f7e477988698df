"""A numpy-backed stack of free ids: O(1) per id to take or return, vectorized over many ids.

Ids in ``[0, capacity)``; ``contents()[:free]`` are free. Taking pops from the top, and the
top of a fresh stack is the lowest id, so ids are handed out lowest first. Growing adds the new
ids below the existing free ones: existing free ids go first, then the new ids, lowest first.
"""

from __future__ import annotations

import numpy as np
import torch


class FreeStack:
    """Free ids of an arena of ``capacity`` rows (all free at first)."""

    def __init__(self, capacity: int) -> None:
        self._stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._top = capacity
        self.capacity = capacity

    @classmethod
    def of(cls, capacity: int, free: torch.Tensor) -> FreeStack:
        """A stack over ``capacity`` ids whose free ones are ``free`` (distinct, below
        ``capacity``), handed out lowest first."""
        stack = cls(0)
        stack._stack = np.empty(capacity, dtype=np.int64)
        stack._stack[: free.numel()] = np.sort(free.numpy())[::-1]
        stack._top = free.numel()
        stack.capacity = capacity
        return stack

    @property
    def free(self) -> int:
        """Ids on the stack."""
        return self._top

    def pop(self, count: int) -> torch.Tensor:
        """Take ``count`` ids (``count <= free``), int64 on the CPU."""
        top = self._top
        ids = self._stack[top - count : top][::-1].copy()
        self._top = top - count
        return torch.from_numpy(ids)

    def push(self, ids: torch.Tensor) -> None:
        """Return ids (each taken, none repeated)."""
        top = self._top
        self._stack[top : top + ids.numel()] = ids.numpy()[::-1]
        self._top = top + ids.numel()

    def grow(self, capacity: int) -> None:
        """Add ids ``[old capacity, capacity)`` as free."""
        old = self.capacity
        stack = np.empty(capacity, dtype=np.int64)
        added = np.arange(capacity - 1, old - 1, -1, dtype=np.int64)
        stack[: added.size] = added
        stack[added.size : added.size + self._top] = self._stack[: self._top]
        self._stack = stack
        self._top += added.size
        self.capacity = capacity

    def contents(self) -> torch.Tensor:
        """The free ids (a copy), top of the stack last."""
        return torch.from_numpy(self._stack[: self._top].copy())
