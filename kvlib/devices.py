"""Device and dtype handling for kvlib, kept in one place so it can be checked.

Bookkeeping (block tables, lengths, reference counts, free lists) lives on the CPU as int64
tensors; page arenas live on the pool's device. Index tensors cross from the CPU to the arena's
device only through :func:`to_arena_device`, and data is validated against the store's device
and dtype only through :func:`check_tensor`. Copies that overlap compute (page prefetch) go on a
side stream from :func:`copy_stream` and are joined to the compute stream only through
:func:`mark_done` and :func:`wait_done`. What a device has free is asked only through
:func:`available_bytes` (and checked against a planned allocation by :func:`check_fits`).
Which kernel attends over pages in place on a device (or none: a dense read first) is chosen only
by :func:`paged_kernel`. A clock that times device work reads it after :func:`synchronize`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

import numpy as np
import torch

P = ParamSpec("P")
R = TypeVar("R")

CPU = torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Return a concrete ``torch.device`` (``"cuda"`` becomes ``cuda:<current>``)."""
    if device is None:
        return CPU
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available_bytes(device: torch.device) -> int | None:
    """Bytes new allocations on ``device`` may still take, or None where kvlib cannot tell.

    CUDA: the driver's free memory plus what torch's caching allocator holds unused. CPU: the
    kernel's estimate of memory available without swapping (``MemAvailable``; physical memory
    where ``/proc/meminfo`` is missing), within the cgroup (v2) limit when one is set. Other
    devices: None (nothing is checked)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return _host_available_bytes()
    return None


def _host_available_bytes() -> int:
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    meminfo = _read("/proc/meminfo")
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit, used = _read("/sys/fs/cgroup/memory.max").strip(), _read("/sys/fs/cgroup/memory.current").strip()
    if limit.isdigit() and used.isdigit():
        available = min(available, max(0, int(limit) - int(used)))
    return available


def host_memory_bytes() -> int:
    """Bytes of memory this host has: physical memory, within the cgroup (v2) limit when one is set."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _read("/sys/fs/cgroup/memory.max").strip()
    return min(physical, int(limit)) if limit.isdigit() else physical


def largest_memory_bytes() -> int:
    """Bytes of memory of the largest compute device here: the host's, or a CUDA device's."""
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else ()
    return max([host_memory_bytes()] + [torch.cuda.get_device_properties(index).total_memory for index in devices])


def _read(path: str) -> str:
    """The text of ``path``, or "" where it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def check_fits(what: str, nbytes: int, device: torch.device) -> None:
    """``ValueError`` when ``nbytes`` (what ``what`` would allocate on ``device`` up front) is
    more than the device has available (:func:`available_bytes`); nothing is allocated here."""
    available = available_bytes(device)
    if available is not None and nbytes > available:
        raise ValueError(
            f"{what} would allocate {_size(nbytes)} on {device} up front, more than the {_size(available)} available there: lower it"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.3g} GiB)"


def to_arena_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a CPU index tensor to an arena's device.

    The copy is issued ``non_blocking``: it is ordered on the current stream before any kernel
    that uses the result, so it needs no synchronisation. Index tensors are small and built
    fresh per call, so they are not pinned (pinning costs more than it saves at this size).
    """
    if index.device == device:
        return index
    return index.to(device, non_blocking=True)


def host_readable(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host (``bool``, ``.item()``, ``.tolist()``) costs
    no device-to-host synchronisation: it lives in host memory. A decode step reads no other
    tensor on the host (CUDA graphs can hold it; ``tests/adapters/cache/test_sync_free.py``)."""
    return tensor.device.type == "cpu"


def check_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``tensor`` has the store's dtype and device."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}, but the store holds {dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but the store lives on {device}")


def outside_inference_mode(method: Callable[P, R]) -> Callable[P, R]:
    """Run ``method`` with inference mode off (a no-op when it is off already).

    The store's bookkeeping and arenas outlive a forward pass: tensors made inside
    ``torch.inference_mode()`` could never be updated in place outside it (a cache reset, or a
    prefix store used by the next call). Store methods therefore make and update their tensors
    as normal tensors whatever mode the model runs in; inputs made in inference mode are only read.
    """

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False):
            return method(*args, **kwargs)

    return wrapper


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed CPU tensor for pages moved off ``device``: pinned when ``device`` is CUDA, so
    copies both ways can be issued non-blocking."""
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


def host_staging(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised CPU tensor for data on its way to ``device`` (every element is written
    before it is read): pinned when ``device`` is CUDA, so the copy can be issued non-blocking."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def apart_from_host(device: torch.device) -> bool:
    """Whether ``device`` has memory of its own (host pages reach it only by a transfer worth
    overlapping with compute); a CPU device reads host memory where it lies."""
    return device.type != "cpu"


class PagedKernel(enum.Enum):
    """What attends over a layer's pages where they lie (no dense copy of the cache)."""

    NUMBA = "numba"
    """:mod:`kvlib.kernels.paged_attention`'s numba kernel: CPU pages only (read as numpy), float arenas
    and coded pools (codecs decoded page by page inside the kernel)."""
    TRITON = "triton"
    """:mod:`kvlib.kernels.paged_attention_triton`'s kernels (CUDA, where triton is installed, as it is
    beside torch's CUDA builds): split-K over the block tables, float arenas and coded pools
    (kivi, kv_bits, int8, fp8 and rotated pages decoded in registers)."""
    TORCH = "torch"
    """:mod:`kvlib.kernels.paged_attention_torch`: torch ops over blocks of pages, any device; float
    arenas only (coded pools give no page source there and are read densely). CUDA without
    triton."""


PAGED_KERNELS: dict[str, tuple[PagedKernel, ...]] = {"cpu": (PagedKernel.NUMBA,), "cuda": (PagedKernel.TRITON, PagedKernel.TORCH)}
"""The paged kernels of each device type, in order of preference (:func:`paged_kernel` takes the
first one installed). A device type not listed reads a layer into a dense copy first: the torch
path would run there, but is untested."""


@functools.cache
def _installed(kernel: PagedKernel) -> bool:
    """Whether ``kernel``'s compiler is importable (triton is optional; numba and torch are not)."""
    return kernel is not PagedKernel.TRITON or importlib.util.find_spec("triton") is not None


def paged_kernel(device: torch.device) -> PagedKernel | None:
    """The kernel that attends straight over pages on ``device`` (:data:`PAGED_KERNELS`), or
    None where a layer is read into a dense copy first."""
    return next((kernel for kernel in PAGED_KERNELS.get(device.type, ()) if _installed(kernel)), None)


def reads_pages_in_place(device: torch.device) -> bool:
    """Whether attention runs straight over pages on ``device`` (:func:`paged_kernel`: the numba
    kernel on the CPU, Triton's or the torch path on CUDA); elsewhere a layer is read into a dense
    copy first. A pool may still give no pages in place (a coded pool without its codec's loader
    for the kernel, partnered pools): its reads are dense then."""
    return paged_kernel(device) is not None


def byte_rows(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view ``[rows, bytes per row]`` of a contiguous CPU ``tensor`` of any dtype
    (bfloat16 too): for copies that must not start torch's intra-op thread pool, as those made
    off the main thread (a prefetch) would compete with the compute's."""
    return tensor.view(tensor.shape[0], -1).view(torch.uint8).numpy()


def copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream for copies that overlap compute on a CUDA ``device`` (None elsewhere: copies
    there run where they are issued)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Issue the work in the block on ``stream`` (and its device); nothing changes for None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def mark_done(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` after the work issued so far (None for no stream)."""
    return None if stream is None else stream.record_event()


def wait_done(event: torch.cuda.Event | None, device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
    """Order ``device``'s current stream after ``event``, and tell the allocator ``tensors`` (made
    on the event's stream) are used on it, so their memory is not reused while it runs. A no-op
    without an event."""
    if event is None:
        return
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for tensor in tensors:
        tensor.record_stream(current)


SMALL_MODEL_PARAMETERS = 30_000_000
"""Models with fewer parameters run on one CPU thread while other work keeps the machine busy
(:func:`cpu_threads`).

Their matrix products are too small to split well: each of torch's intra-op threads waits for
the others several times per layer. On a quiet 2-core machine a second thread still gains
~15% (a reduced ``kvlib compare`` of the 0.8M-parameter embedded model: 31-36 s on two threads
against 39 s on one); with another job running, every wait becomes a lost time slice (37/100/34 s
on one thread against 137/74/489 s on two, load 2 to 6). README, "Threads"."""

BUSY_LOAD = 1.0
"""A 1-minute load average at or above this means another job is running (:func:`cpu_threads`)."""


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` has run (CUDA launches return before their kernels
    finish); a no-op on the CPU. For timing: a clock read after it counts the work issued before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_cpu_threads(threads: int) -> None:
    """Run torch's intra-op work and kvlib's numba kernels on ``threads`` CPU threads (numba's
    capped at the pool it started with). Both are set, numba's first: starting numba's OpenMP
    pool and its launches set the calling thread's OpenMP thread count, which torch shares, so
    torch's setting alone does not hold once a numba kernel has run."""
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(threads)


def cpu_threads(parameters: int, requested: int | None = None, load: float | None = None) -> int:
    """Torch intra-op threads for a model of ``parameters`` on the CPU: ``requested`` when given
    (>= 1); for a model below :data:`SMALL_MODEL_PARAMETERS`, one when the machine is busy (the
    1-minute load average, or ``load``, at least :data:`BUSY_LOAD`); else torch's default (one
    per core)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be >= 1, got {requested}")
        return requested
    busy = (os.getloadavg()[0] if load is None else load) >= BUSY_LOAD
    return 1 if parameters < SMALL_MODEL_PARAMETERS and busy else torch.get_num_threads()
