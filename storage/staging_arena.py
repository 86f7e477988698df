"""Where attention reads a tiered layer: the device rows followed by staging rows, one arena.

The page kernel reads one arena per layer. A tiered pool's device pages already lie in its device
rows; the pages a block table names on the host or on disk are copied into staging rows that
follow them, so the kernel reads both from one tensor. The device rows are the leading rows of
that arena (the pool's ``keys`` and ``values`` become views of them), so staging copies no
device page. The staging rows are kept for the next call; the pages staged by a call are its
transient workspace.
"""

from __future__ import annotations

import torch

from kvlib.storage.host_arena import MIN_HOST_PAGES


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

    def _holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys`` and ``values`` still lie at the start of the arena."""
        return self._arena[0].data_ptr() == keys.data_ptr() and self._arena[1].data_ptr() == values.data_ptr()
