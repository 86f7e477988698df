"""The host tier of a tiered pool: whole pages in host memory, in rows of two arenas.

Rows hold keys ``[page_size, head_dim]`` and values ``[page_size, value_dim]`` in the compute
dtype, pinned when the device is CUDA (copies both ways are issued non-blocking). A free stack
hands rows out; the arenas grow (at least doubling) when a store needs more rows than are free,
and never shrink. Which page a row holds is the pool's to know (its ``host_row``).
"""

from __future__ import annotations

import torch

from kvlib.devices import host_buffer
from kvlib.storage.pools.free_stack import FreeStack

MIN_HOST_PAGES = 16
"""Rows a host arena starts with."""


class HostArena:
    """Host rows for pages of ``page_size`` tokens with ``head_dim`` key and ``value_dim`` value
    channels of ``dtype``, moved to and from ``device``."""

    def __init__(self, page_size: int, head_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.keys = host_buffer((MIN_HOST_PAGES, page_size, head_dim), dtype, device)
        self.values = host_buffer((MIN_HOST_PAGES, page_size, value_dim), dtype, device)
        self._free = FreeStack(MIN_HOST_PAGES)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """``(page_size, head_dim, value_dim)`` of the pages held."""
        return (self.keys.shape[1], self.keys.shape[2], self.values.shape[2])

    @property
    def rows(self) -> int:
        """Rows reserved, free or holding a page."""
        return self.keys.shape[0]

    @property
    def held(self) -> int:
        """Rows holding a page."""
        return self.rows - self._free.free

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Put pages (``keys`` ``[n, page_size, head_dim]``, ``values`` alike, on the CPU) into
        free rows, growing the arenas to ``max(held + n, 2 * rows)`` rows if too few are free;
        returns the rows (int64, CPU)."""
        if self._free.free < keys.shape[0]:
            self._grow(self.held + keys.shape[0])
        rows = self._free.pop(keys.shape[0])
        self.keys[rows] = keys
        self.values[rows] = values
        return rows

    def load(self, rows: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages of ``rows`` (int64, CPU), copied to ``device`` (non-blocking from pinned
        memory); the rows keep them."""
        return (
            self.keys.index_select(0, rows).to(device, non_blocking=True),
            self.values.index_select(0, rows).to(device, non_blocking=True),
        )

    def release(self, rows: torch.Tensor) -> None:
        """Return ``rows`` (each holding a page, none repeated) to the free stack."""
        self._free.push(rows)

    def _grow(self, needed: int) -> None:
        rows = max(needed, 2 * self.rows)
        keys = host_buffer((rows, *self.keys.shape[1:]), self.dtype, self.device)
        values = host_buffer((rows, *self.values.shape[1:]), self.dtype, self.device)
        keys[: self.rows] = self.keys
        values[: self.values.shape[0]] = self.values
        self.keys, self.values = keys, values
        self._free.grow(rows)
