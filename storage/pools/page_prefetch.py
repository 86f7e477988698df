"""Fetching a tiered pool's off-device pages on a background thread, ahead of their read.

A decode step reads every layer's pages in order. While layer ``l`` computes, the pages of layer
``l + 1`` that sit on the host or on disk can already be copied towards the device: a
:class:`PagePrefetcher` (one worker thread per store and, on CUDA, one copy stream) runs each
:class:`PrefetchJob`, and the pool's next read takes the pages it brought instead of fetching them
again.

Correctness does not depend on timing:

- a job reads only what its pool handed it when it was started (host arena rows, the spill's
  records); the pool waits for the job (:meth:`PrefetchJob.result`) before any change to its
  tiers, so nothing a job reads changes under it;
- each fetched page carries its write stamp (the pool's clock of its last allocation or write)
  from when the job started; a read uses a fetched page only if the page is still in use with the
  same stamp, so a page written or freed since is read where it now lies. Prefetched or not, a
  read returns the same bytes (``tests/storage/pools/test_page_prefetch.py``);
- on CUDA the copies run on the prefetcher's stream; the reader's stream waits for the job's
  event before using them (:func:`~kvlib.devices.wait_done`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvlib.devices import apart_from_host, copy_stream, host_staging, mark_done, on_stream, wait_done


@dataclass
class FetchedPages:
    """Pages fetched by a job: ``ids`` (int64, CPU, distinct), their write ``stamps`` when the job
    started, and their ``keys`` ``[n, page_size, head_dim]`` and ``values`` on the device."""

    ids: torch.Tensor
    stamps: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def match(self, ids: torch.Tensor, stamps: torch.Tensor, in_use: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For pages ``ids`` with current write ``stamps`` and ``in_use`` flags: which of them this
        fetch holds unchanged (bool ``[len(ids)]``) and their rows in :attr:`keys` (meaningful
        where matched)."""
        if self.ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        ordered, order = self.ids.sort()
        at = torch.searchsorted(ordered, ids).clamp(max=ordered.numel() - 1)
        rows = order[at]
        return (ordered[at] == ids) & (self.stamps[rows] == stamps) & in_use, rows


class PrefetchJob:
    """One pool's pending fetch (see the module docstring)."""

    def __init__(self, future: Future, device: torch.device) -> None:
        self._future = future
        self._device = device

    def result(self) -> FetchedPages:
        """Wait for the job; its pages, ready to use on the device's current stream. Errors the
        job met (a lost spilled page) are raised here."""
        fetched, event = self._future.result()
        wait_done(event, self._device, (fetched.keys, fetched.values))
        return fetched


class PagePrefetcher:
    """A worker thread (and, on CUDA, a copy stream) fetching pages for the pools of one store.
    ``fetch_host``: whether host pages are fetched too (default: when the device is apart from the
    host; a CPU device reads them in place, and fetching them would only add a copy)."""

    def __init__(self, device: torch.device, fetch_host: bool | None = None) -> None:
        self.device = device
        self.fetch_host = apart_from_host(device) if fetch_host is None else fetch_host
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlib-prefetch")
        self._stream = copy_stream(device)
        self.jobs = 0
        """Jobs started since creation."""

    def start(
        self,
        ids: torch.Tensor,
        stamps: torch.Tensor,
        page_shape: tuple[int, int, int],
        dtype: torch.dtype,
        read_host: Callable[[torch.Tensor, torch.Tensor], None],
        read_disk: Callable[[torch.Tensor, torch.Tensor], None],
        host_count: int,
    ) -> PrefetchJob:
        """Fetch pages ``ids`` (distinct; the first ``host_count`` on the host, the rest on disk)
        on the worker: ``read_host(keys, values)`` and ``read_disk(keys, values)`` fill the host
        and disk pages' rows of two host buffers (with numpy or lmdb only: torch's intra-op
        threads stay the compute's), which then go to the device in one copy each. ``page_shape``
        is ``(page_size, head_dim, value_dim)``."""
        page_size, head_dim, value_dim = page_shape

        def fetch() -> tuple[FetchedPages, torch.cuda.Event | None]:
            keys = host_staging((ids.numel(), page_size, head_dim), dtype, self.device)
            values = host_staging((ids.numel(), page_size, value_dim), dtype, self.device)
            if host_count:
                read_host(keys[:host_count], values[:host_count])
            if host_count < ids.numel():
                read_disk(keys[host_count:], values[host_count:])
            with on_stream(self._stream):
                fetched = FetchedPages(ids, stamps, keys.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True))
                return fetched, mark_done(self._stream)

        self.jobs += 1
        return PrefetchJob(self._executor.submit(fetch), self.device)

    def close(self) -> None:
        """Stop the worker once its jobs are done."""
        self._executor.shutdown(wait=True)
