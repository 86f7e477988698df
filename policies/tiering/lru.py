"""LRU placement: the pages used longest ago leave the device for host memory, then for disk."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlib.devices import host_memory_bytes, largest_memory_bytes
from kvlib.placement import PageStats, least_recently_written
from kvlib.policy import Tiering
from kvlib.registry import register


@register("lru")
@dataclass
class LRUPlacement(Tiering):
    """Keep at most ``device_mb`` MiB of KV pages (over all layers) on the compute device; when a
    page needs room there, the pages written longest ago move to host memory (the newest tokens,
    which decoding writes, stay), pinned under CUDA; with ``disk``, when the host is full its
    pages written longest ago go on to page records in an lmdb directory. Reads copy host and
    disk pages into the read buffer without moving them back; writes bring a page back.
    Lossless: outputs equal the untiered cache's.

    Args:
        device_mb: device budget for keys and values of pages, MiB, split evenly over layers
            (at least one page per layer). With a codec it counts sealed pages at their encoded
            bytes; they move between tiers encoded, and open pages stay on the device.
        host_mb: host budget, MiB over all layers (0: unbounded). Past it, pages spill to
            ``disk``; without one, a move past it raises :class:`~kvlib.errors.PoolExhaustedError`
            (the call fails; the cache must then be reset).
        disk: directory of the lmdb disk tier for spilled pages ("": none). Needs ``host_mb``.
            It may also hold a prefix store's records (they survive); a cache's spilled records
            are deleted as its pages are freed, when it is garbage collected or the process
            exits, and, after a crash, by the next process that opens the directory.
        disk_mb: disk budget, MiB of spilled page records (pages plus their headers) over all
            layers; past it a move raises :class:`~kvlib.errors.PoolExhaustedError`.
        prefetch: while a layer computes, fetch the next layer's host and disk pages on a
            background thread (a copy stream on CUDA), so its read finds them ready. Outputs are
            the same either way.
    """

    device_mb: float = 1024.0
    host_mb: float = 0.0
    disk: str = ""
    disk_mb: float = 4096.0
    prefetch: bool = True

    def __post_init__(self) -> None:
        """Each budget is checked against what this machine can hold: ``device_mb`` against the
        memory of its largest compute device, ``host_mb`` against the host's memory, ``disk_mb``
        against the size of the file system holding ``disk``."""
        super().__post_init__()
        if not self.device_mb > 0:
            raise ValueError(f"device_mb must be > 0, got {self.device_mb}")
        if self.host_mb < 0:
            raise ValueError(f"host_mb must be >= 0 (0: unbounded), got {self.host_mb}")
        if self.disk and not self.host_mb > 0:
            raise ValueError(f"a disk tier (disk={self.disk!r}) takes pages past the host budget: set host_mb > 0")
        if not self.disk_mb > 0:
            raise ValueError(f"disk_mb must be > 0, got {self.disk_mb}")
        _check_fits("device_mb", self.device_mb, largest_memory_bytes(), "the memory of this machine's largest device")
        _check_fits("host_mb", self.host_mb, host_memory_bytes(), "this host's memory")
        if self.disk:
            _check_fits("disk_mb", self.disk_mb, file_system_bytes(self.disk), f"the file system holding {self.disk!r}")

    def prefetches(self) -> bool:
        return self.prefetch

    def disk_directory(self) -> str:
        return self.disk

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        """Pages written longest ago leave first (:func:`~kvlib.placement.least_recently_written`)."""
        return least_recently_written(pages)

    def device_pages(self, num_layers: int, page_bytes: int) -> int:
        """Pages each layer may keep on the device."""
        return max(1, int(self.device_mb * 2**20 / (num_layers * page_bytes)))

    def host_pages(self, num_layers: int, page_bytes: int) -> int | None:
        """Pages each layer may keep on the host (None: unbounded)."""
        return None if not self.host_mb else max(1, int(self.host_mb * 2**20 / (num_layers * page_bytes)))

    def disk_pages(self, num_layers: int, record_bytes: int) -> int:
        return 0 if not self.disk else max(1, int(self.disk_mb * 2**20 / (num_layers * record_bytes)))


def _check_fits(name: str, megabytes: float, most_bytes: int, what: str) -> None:
    """``ValueError`` when a budget of ``megabytes`` MiB is more than ``what`` holds (``most_bytes``)."""
    if megabytes * 2**20 > most_bytes:
        raise ValueError(f"{name}={megabytes:g} MiB is more than {what} holds ({most_bytes / 2**20:.0f} MiB): lower it")


def file_system_bytes(directory: str) -> int:
    """Bytes of the file system that holds ``directory`` (or would: its nearest existing ancestor)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).total
