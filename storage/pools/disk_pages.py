"""The disk tier of a tiered pool: which pages lie on disk, as records of its layer's spill.

A page is on disk exactly when ``on_disk[page]``, and then exactly one record of the
:class:`~kvlib.storage.tiers.spill_store.LayerSpill` holds it (keys, values, positions). Spilling
writes a batch of pages in one transaction (if it fails nothing moved); bringing a page back or
freeing it deletes its record. Reading a spilled page leaves it where it is (checked records
copied out). At most ``budget`` pages lie on disk.
"""

from __future__ import annotations

import torch

from kvlib.errors import PoolExhaustedError
from kvlib.storage.pools.formats.page_format import extend_rows
from kvlib.storage.tiers.spill_store import LayerSpill


class DiskPages:
    """Spilled pages of one pool of ``capacity`` pages: records in ``spill`` (None: no disk
    tier), at most ``budget`` of them (0 without a spill)."""

    def __init__(self, spill: LayerSpill | None, budget: int, capacity: int) -> None:
        self.spill = spill
        self.budget = budget
        self.on_disk = torch.zeros(capacity, dtype=torch.bool)
        """Per page id (bool, CPU): whether the page lies on disk."""

    @property
    def count(self) -> int:
        """Pages on disk."""
        return int(self.on_disk.sum())

    def grow(self, capacity: int) -> None:
        self.on_disk = extend_rows(self.on_disk, capacity, False)

    def check_room(self, excess: int, count: int, host_budget: int) -> None:
        """:class:`PoolExhaustedError` unless ``excess`` more pages fit on disk, ``count`` being
        the pages that made the host (of ``host_budget`` pages) overflow."""
        if self.spill is None:
            raise PoolExhaustedError(f"host tier full: {count} more pages would exceed its budget of {host_budget} pages per layer")
        if self.count + excess > self.budget:
            raise PoolExhaustedError(
                f"disk tier full: spilling {excess} more pages would exceed its budget of {self.budget} pages per layer"
            )

    def put(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write pages ``ids`` (not on disk) with their ``keys``, ``values`` and ``positions`` as
        records, in one transaction (if it fails nothing changed)."""
        self.spill.put(ids, keys, values, positions)
        self.on_disk[ids] = True

    def get(self, ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pages ``ids`` (on disk), read from their checked records; the
        records stay (:class:`~kvlib.storage.tiers.spill_store.SpilledPageLost` for a bad one)."""
        return self.spill.get(ids, device)

    def drop(self, ids: torch.Tensor) -> None:
        """Delete the records of those of pages ``ids`` that are on disk: they are no longer."""
        spilled = ids[self.on_disk[ids]]
        if spilled.numel():
            self.spill.delete(spilled)
            self.on_disk[spilled] = False
