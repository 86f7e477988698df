"""Where a coded pool's read of whole pages takes each page from, worked out once and reused
while the same pages are read and none changed state (a decode step reads the pages the step
before it read until one fills): see :meth:`~kvlib.storage.pools.formats.coded_format.CodedPages.read_pages`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlib.devices import to_arena_device

if TYPE_CHECKING:
    from kvlib.storage.pools.formats.coded_format import CodedPages


@dataclass
class ReadPlan:
    """Where :meth:`CodedPages.read_pages` reads each of ``ids`` from, valid for one pool
    ``version``: ``sealed_rows`` (CPU) of the output are decoded from arena ``pages`` (CPU) with
    ``heads`` (device); ``free`` output rows (device) are zeroed; ``open_target`` rows are copied
    from raw rows ``open_source`` (device)."""

    ids: torch.Tensor
    version: int
    sealed_rows: torch.Tensor
    pages: torch.Tensor
    heads: torch.Tensor
    free: torch.Tensor | None
    open_target: torch.Tensor | None
    open_source: torch.Tensor | None

    @classmethod
    def of(cls, pool: CodedPages, ids: torch.Tensor) -> ReadPlan:
        sealed = pool.sealed[ids]
        rows = pool.raw_row[ids]
        sealed_rows = sealed.nonzero().squeeze(-1)
        pages = ids[sealed_rows]
        free = (~sealed & (rows < 0)).nonzero().squeeze(-1)
        opened = (rows >= 0).nonzero().squeeze(-1)
        device = pool.device
        return cls(
            ids.clone(),
            pool.version,
            sealed_rows,
            pages,
            to_arena_device(pool.page_heads[pages], device),
            to_arena_device(free, device) if free.numel() else None,
            to_arena_device(opened, device) if opened.numel() else None,
            to_arena_device(rows[opened], device) if opened.numel() else None,
        )
