"""A tiered pool's prefetch: the job it started and the pages a finished job brought.

:meth:`PendingFetch.start` hands a :class:`~kvlib.storage.pools.page_prefetch.PagePrefetcher` the host
and spilled pages to fetch, with their write stamps; :meth:`PendingFetch.settle` waits for the
job and keeps its pages; :meth:`PendingFetch.fill` gives them to the next read, once. The pool
settles before every change to its tiers, so a running job never sees them change, and a read
(:meth:`PendingFetch.fill`) uses a fetched page only where its stamp is still current (see :mod:`kvlib.storage.pools.page_prefetch`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.devices import byte_rows, to_arena_device
from kvlib.storage.pools.host_arena import HostArena
from kvlib.storage.pools.page_prefetch import FetchedPages, PagePrefetcher, PrefetchJob
from kvlib.storage.tiers.spill_store import LayerSpill, SpilledPageLost


class PendingFetch:
    """The running prefetch job of one pool (if any) and the pages of the last one settled."""

    def __init__(self) -> None:
        self._job: PrefetchJob | None = None
        self._fetched: FetchedPages | None = None

    def start(
        self,
        prefetcher: PagePrefetcher,
        *,
        host: HostArena,
        host_ids: torch.Tensor,
        host_rows: torch.Tensor,
        spill: LayerSpill | None,
        disk_ids: torch.Tensor,
        stamps: torch.Tensor,
    ) -> None:
        """Start fetching pages ``host_ids`` (in ``host``'s ``host_rows``) and ``disk_ids`` (records
        of ``spill``) on ``prefetcher``'s worker, replacing pages fetched and not read yet.
        ``stamps``: the write stamps of ``host_ids`` then ``disk_ids``. Call :meth:`settle` first."""
        self._fetched = None
        if host_ids.numel() + disk_ids.numel() == 0:
            return
        rows = host_rows.numpy()
        host_keys, host_values = byte_rows(host.keys), byte_rows(host.values)

        def read_host(keys: torch.Tensor, values: torch.Tensor) -> None:
            np.take(host_keys, rows, axis=0, out=byte_rows(keys))
            np.take(host_values, rows, axis=0, out=byte_rows(values))

        def read_disk(keys: torch.Tensor, values: torch.Tensor) -> None:
            spill.get(disk_ids, host.device, out=(keys, values))

        ids = torch.cat([host_ids, disk_ids])
        self._job = prefetcher.start(ids, stamps, host.page_shape, host.dtype, read_host, read_disk, host_ids.numel())

    def settle(self) -> None:
        """Wait for the running job and keep its pages for the next :meth:`fill` (a job that
        found a spilled page lost keeps none: the read fetches that page again and reports it)."""
        job, self._job = self._job, None
        if job is not None:
            try:
                self._fetched = job.result()
            except SpilledPageLost:
                self._fetched = None

    def fill(
        self,
        ids: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        stamps: torch.Tensor,
        in_use: torch.Tensor,
        wanted: torch.Tensor,
    ) -> torch.Tensor:
        """Copy into rows ``i`` of ``keys`` and ``values`` (``[len(ids), page_size, dim]``, on the
        device) the pages ``ids[i]`` with ``wanted[i]`` that the last settled job fetched, where
        the page is still ``in_use[i]`` with write stamp ``stamps[i]`` (its current one); returns
        which rows it filled (bool ``[len(ids)]``). Its pages are used once: a second call fills
        nothing."""
        fetched, self._fetched = self._fetched, None
        if fetched is None:
            return torch.zeros_like(wanted)
        matched, rows = fetched.match(ids, stamps, in_use)
        filled = matched & wanted
        taken = filled.nonzero().squeeze(-1)
        if taken.numel():
            source, target = to_arena_device(rows[taken], keys.device), to_arena_device(taken, keys.device)
            keys.index_copy_(0, target, fetched.keys.index_select(0, source))
            values.index_copy_(0, target, fetched.values.index_select(0, source))
        return filled
