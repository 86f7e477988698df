"""Where attention reads a tiered layer: the device rows followed by staging rows, one arena.

The page kernel reads one arena per layer. A tiered pool's device pages already lie in its device
rows; the pages a block table names on the host or on disk are copied into staging rows that
follow them, so the kernel reads both from one tensor. The device rows are the leading rows of
that arena (the pool's ``keys`` and ``values`` become views of them), so staging copies no
device page. The staging rows are kept for the next call; the pages staged by a call are its
transient workspace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlib.devices import to_arena_device
from kvlib.storage.pools.host_arena import MIN_HOST_PAGES


class StagingArena:
    """One pool's keys and values arenas: its device rows, then staging rows (none before the
    first :meth:`around`)."""

    def __init__(self) -> None:
        self._arena: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Staging rows past the device rows ``keys`` / ``values`` (0 before the first use, or
        once the device rows no longer lie at the arena's start: they grew)."""
        return 0 if self._arena is None or not self._holds(keys, values) else self._arena[0].shape[0] - keys.shape[0]

    def around(self, keys: torch.Tensor, values: torch.Tensor, staged: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values arenas whose leading rows hold the device rows ``keys`` / ``values``
        (``[rows, page_size, dim]``) and with room for ``staged`` more pages after them. The
        caller replaces its device rows with views of the leading rows. Rebuilt (the device rows
        copied once) only when the device rows have grown or the staging rows are too few; the
        staging rows then double (at least :data:`MIN_HOST_PAGES`)."""
        device_rows = keys.shape[0]
        if self._arena is None or not self._holds(keys, values) or self._arena[0].shape[0] < device_rows + staged:
            rows = device_rows + max(staged, 2 * self.rows(keys, values), MIN_HOST_PAGES)
            arena_keys = torch.empty(rows, *keys.shape[1:], dtype=keys.dtype, device=keys.device)
            arena_values = torch.empty(rows, *values.shape[1:], dtype=values.dtype, device=values.device)
            arena_keys[:device_rows] = keys
            arena_values[:device_rows] = values
            self._arena = (arena_keys, arena_values)
        return self._arena

    def stage(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        device_row: torch.Tensor,
        pages: torch.Tensor,
        read_pages: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The block table ``pages`` (page ids, ``-1`` past a head's last) where the kernel reads
        it: the keys and values arenas (:meth:`around` the device rows ``keys`` / ``values``) with
        the table's off-device pages (``device_row[page] < 0``), each once, copied by ``read_pages``
        into the staging rows; a positions arena of the same rows (the pool's ``positions`` of
        exactly the pages the table names); the table in arena rows; and how many pages were staged."""
        held = pages >= 0
        ids = pages[held]
        rows = device_row[ids]
        elsewhere = rows < 0
        staged, slot = torch.unique(ids[elsewhere], return_inverse=True)
        first = keys.shape[0]
        arena_keys, arena_values = self.around(keys, values, staged.numel())
        if staged.numel():
            staged_keys, staged_values = read_pages(staged)
            arena_keys[first : first + staged.numel()] = staged_keys
            arena_values[first : first + staged.numel()] = staged_values
        rows[elsewhere] = first + slot
        device = keys.device
        arena_positions = torch.empty(arena_keys.shape[0], *positions.shape[1:], dtype=positions.dtype, device=device)
        arena_positions[to_arena_device(rows, device)] = positions.index_select(0, to_arena_device(ids, device))
        table = torch.full_like(pages, -1)
        table[held] = rows
        return arena_keys, arena_values, arena_positions, table, staged.numel()

    def _holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys`` and ``values`` still lie at the start of the arena."""
        return self._arena[0].data_ptr() == keys.data_ptr() and self._arena[1].data_ptr() == values.data_ptr()
