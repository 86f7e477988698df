"""Sequence ids of the paged store: which are live, which rows of the block tables they name,
and the validation of a batch of them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

SequenceIds = Sequence[int] | torch.Tensor


class SequenceRows:
    """Live sequence ids; a sequence's id is its row in every layer's block table.

    Invariants: live ids are distinct and below :attr:`row_count`; released ids are reused
    (last released first) before new rows are opened.
    """

    def __init__(self) -> None:
        self._live: set[int] = set()
        self._free_rows: list[int] = []
        self.row_count = 0
        """Rows ever opened since the last :meth:`reset` (every live id is below it)."""
        self._last_rows: tuple[tuple[int, ...], torch.Tensor] | None = None
        """The last batch of ids validated and its row tensor (read-only; reset when ids are released)."""

    @property
    def live(self) -> list[int]:
        """Live sequence ids, ascending."""
        return sorted(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def take(self) -> int:
        """A new live id: a released one if any, else a new row."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self.row_count
            self.row_count += 1
        self._live.add(row)
        return row

    def release(self, rows: torch.Tensor) -> None:
        """``rows`` (validated, live) are no longer live; their ids may be reused."""
        for row in rows.tolist():
            self._live.discard(row)
            self._free_rows.append(row)
        self._last_rows = None

    def reset(self) -> None:
        """With no sequence live, start row ids at 0 again."""
        self._free_rows = []
        self.row_count = 0

    def rows(self, seqs: SequenceIds) -> torch.Tensor:
        """``seqs`` as an int64 row tensor (CPU; read-only: the same tensor comes back for the same
        batch until ids are released); ``ValueError`` for an empty batch, unknown or released ids,
        or repeats."""
        ids = tuple(seqs.tolist() if isinstance(seqs, torch.Tensor) else seqs)
        if self._last_rows is not None and ids == self._last_rows[0] and all(type(s) is int for s in ids):
            return self._last_rows[1]
        if not ids:
            raise ValueError("at least one sequence id is needed")
        unknown = [s for s in ids if type(s) is not int or s not in self._live]
        if unknown:
            raise ValueError(f"unknown or released sequence ids {list(unknown)}; live ids: {self.live}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"sequence ids repeat in one batch: {list(ids)}")
        rows = torch.tensor(ids, dtype=torch.int64)
        self._last_rows = (ids, rows)
        return rows
