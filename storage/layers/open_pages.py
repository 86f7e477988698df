"""Where a batch's next tokens go in one layer while every head's last page has room."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.devices import to_arena_device
from kvlib.storage.layers.block_table import BlockTable


@dataclass
class OpenPages:
    """Where the next tokens of one batch go in one layer while no head needs a new page.

    Valid only while every head of ``rows`` has free slots left in its last page and that page
    is referenced by this batch alone; the store drops it on any change that could break this
    (fork, release, compaction, truncation, a slow-path append).
    """

    rows: tuple[int, ...]
    row_tensor: torch.Tensor
    """The row tensor ``rows`` was validated as (``PagedStore._rows`` returns it again for them)."""
    slots: torch.Tensor
    """int64 ``[batch, heads, room]`` on the arena device: arena slots of each head's next tokens."""
    cpu_slots: torch.Tensor
    """The same slots on the CPU (coded pools look each page's state up in CPU bookkeeping)."""
    positions: torch.Tensor
    """int64 ``[batch, heads, room]`` on the arena device: positions those tokens get by default."""
    row_range: tuple[int, int] | None
    """``(first, end)`` when ``rows`` are consecutive ids (length updates then use a slice)."""
    used: int = 0
    """Slots of ``slots`` already written."""

    @classmethod
    def after_append(cls, table: BlockTable, rows: torch.Tensor, device: torch.device) -> OpenPages | None:
        """Where the next tokens of ``rows`` go in ``table``'s layer (whose arenas lie on
        ``device``) after an append, or None when some head's last page is full."""
        lengths = table.lengths[rows]
        room = int(((-lengths) % table.page_size).min())
        if room == 0:
            return None
        ahead = torch.arange(room)
        slots = table.flat_slots(rows, lengths.unsqueeze(-1) + ahead)
        positions = (table.logical[rows].view(-1, 1, 1) + ahead).expand(slots.shape)
        ids = tuple(rows.tolist())
        consecutive = ids == tuple(range(ids[0], ids[0] + len(ids)))
        return cls(
            ids,
            rows,
            to_arena_device(slots, device),
            slots,
            to_arena_device(positions, device),
            (ids[0], ids[0] + len(ids)) if consecutive else None,
        )

    def fits(self, rows: torch.Tensor, steps: int) -> bool:
        if self.used + steps > self.slots.shape[-1]:
            return False
        # ``_rows`` hands back the same tensor for the batch it validated last: no list rebuild then.
        return rows is self.row_tensor or tuple(rows.tolist()) == self.rows

    def take(self, steps: int, cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots (on the CPU if ``cpu``, else the arena device) and positions ``[batch, heads, steps]``
        of the next ``steps`` tokens (views)."""
        start, self.used = self.used, self.used + steps
        slots = self.cpu_slots if cpu else self.slots
        return slots[:, :, start : self.used], self.positions[:, :, start : self.used]
