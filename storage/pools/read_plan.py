"""Where a coded pool's read of whole pages takes each page from, worked out once and reused
while the same pages are read and none changed state (a decode step reads the pages the step
before it read until one fills): see :meth:`~kvlib.storage.pools.formats.coded_format.CodedPages.read_pages`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.devices import to_arena_device


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
    def of(
        cls, ids: torch.Tensor, sealed: torch.Tensor, raw_row: torch.Tensor, page_heads: torch.Tensor, version: int, device: torch.device
    ) -> ReadPlan:
        """The plan of reading pages ``ids`` (int64, CPU) of a coded pool at ``version``, from its
        per-page ``sealed`` flags, ``raw_row`` (the raw arena row of an open page, ``-1`` none) and
        ``page_heads`` (CPU tensors indexed by page); ``device``: the arenas'."""
        rows = raw_row[ids]
        sealed = sealed[ids]
        sealed_rows = sealed.nonzero().squeeze(-1)
        pages = ids[sealed_rows]
        free = (~sealed & (rows < 0)).nonzero().squeeze(-1)
        opened = (rows >= 0).nonzero().squeeze(-1)
        return cls(
            ids.clone(),
            version,
            sealed_rows,
            pages,
            to_arena_device(page_heads[pages], device),
            to_arena_device(free, device) if free.numel() else None,
            to_arena_device(opened, device) if opened.numel() else None,
            to_arena_device(rows[opened], device) if opened.numel() else None,
        )
