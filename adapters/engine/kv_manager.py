"""The Engine's KV manager: the paged store, its page budget, the prefix index and swap space (the
store's sizes are worked out and checked by :mod:`~kvlib.adapters.engine.page_budget`).

It answers the scheduler's page questions through a :class:`~kvlib.adapters.engine.page_forecast.PageForecast`
(pages a request's tokens need, cached tokens, admission and swap-in pages, what a reclaim or a
preemption would free) and carries out the decisions of an applied plan: preempt (swap out or
drop), reclaim (evict unused prefix-cache blocks), admit (attach the cached prefix), swap in;
after a step it indexes full blocks, and it releases what a finished or aborted request held.

Units: pages are counted per layer (one page holds ``page_size`` tokens of one KV head), tokens
per sequence. With a codec and a page budget, pages count as *budget pages*: a sealed page is one
(its encoded bytes), an open page (a head's partly filled last page, held raw) is
``open_page_cost`` of them (its raw bytes over a sealed page's, rounded up), so the bytes of keys
and values held between steps stay within ``page_budget_bytes``; without a codec both are one. Invariants: a request's ``seq`` holds the keys and values of its first
``computed`` tokens (in a sliding-window layer, the last ``window - 1`` of them); it holds the prefix index entries its sequence reads and no others (so an
unused entry's pages are held by the index alone, and reclaiming it frees one page per KV head
in every layer); a swapped-out request holds no pages, only host memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvlib.adapters.engine.engine_options import keeps_prefix_cache
from kvlib.adapters.engine.engine_request import Request
from kvlib.adapters.engine.handover import Tail, read_tail, tail_key, tail_layout, tail_record
from kvlib.adapters.engine.page_budget import PageBudget
from kvlib.adapters.engine.page_forecast import PageForecast
from kvlib.adapters.engine.swap import SwappedSequence, swap_in, swap_out
from kvlib.codec import Codec
from kvlib.model_shape import KVShape
from kvlib.storage.prefix.prefix_index import Entry
from kvlib.storage.prefix.prefix_store import PrefixStore
from kvlib.storage.records.prefix_block_record import BlockLayout
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig
from kvlib.storage.tiers.remote_tier import RemoteTier

GROWING_FREE_PAGES = 2**62
"""Free pages reported for pools that grow as needed (never short)."""


class KVManager:
    """The store, page budget, prefix index and swap space of one Engine.

    Args:
        model: the served model (its fingerprint keys the prefix index).
        shape: its KV shape (layers, KV heads, head sizes).
        budget: the checked sizes (:func:`~kvlib.adapters.engine.page_budget.page_budget`).
        codec: the engine-wide page codec (its spec names the prefix namespace), or None.
        page_size: tokens per page.
        dtype, device: of the model's parameters (the pages').
        read_cache: keep a dense mirror of the decoding batch in the store.
        prefix_cache: index full pages for reuse across requests (not for a model with
            sliding-window layers: :func:`~kvlib.adapters.engine.engine_options.keeps_prefix_cache`).
        preemption: ``"swap"`` (to host memory) or ``"recompute"``.
        remote: the prefix store's remote tier (:class:`~kvlib.storage.prefix.prefix_store.PrefixStore`), or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        shape: KVShape,
        budget: PageBudget,
        *,
        codec: Codec | None,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        read_cache: bool,
        prefix_cache: bool,
        preemption: str,
        remote: RemoteTier | None = None,
    ) -> None:
        self.shape = shape
        self.page_size = page_size
        self.dtype, self.device = dtype, device
        self.preemption = preemption
        self.every_layer_slides = bool(shape.windows) and None not in shape.windows
        """Whether every layer slides over a window: no layer then holds all of a sequence's tokens
        (page counts then follow what a sequence stores, :meth:`stored_tokens`)."""
        pages, codecs = budget.pages, budget.codecs
        self.open_page_cost = budget.open_page_cost if pages is not None else 1
        """Budget pages an open page counts for (see the module docstring; 1 when the pools grow)."""

        def build() -> PagedStore:
            return PagedStore(
                StoreConfig(
                    shape.num_layers,
                    shape.num_kv_heads,
                    shape.head_dim,
                    value_dim=shape.value_dim,
                    page_size=page_size,
                    dtype=self.dtype,
                    device=self.device,
                    pages_per_layer=pages or 64,
                    fixed_capacity=pages is not None,
                    read_cache=read_cache,
                    codecs=codecs,
                )
            )

        self.prefix = PrefixStore(model, budget.prefix_bytes, remote=remote) if prefix_cache and keeps_prefix_cache(shape) else None
        if self.prefix is not None:
            self.namespace = self.prefix.namespace("" if codec is None else codec.spec(), self.dtype, self.device, page_size)
            self.store = self.prefix.paged_store(self.namespace, build)
        else:
            self.store = build()
        self._swap_space: dict[int, SwappedSequence] = {}

    # -- page counts (read only) ---------------------------------------------------------------

    @property
    def fixed(self) -> bool:
        """Whether the pools have a fixed capacity (a page budget); otherwise they grow."""
        return self.store.pools[0].fixed

    def free_pages(self) -> int:
        """Pages free in the layer with the fewest free pages (:data:`GROWING_FREE_PAGES` when
        the pools grow)."""
        return min(self.free_pages_by_layer())

    def free_pages_by_layer(self) -> list[int]:
        """Free budget pages of each layer: the pool's free pages, less what its open pages count
        for beyond their own page."""
        if not self.fixed:
            return [GROWING_FREE_PAGES] * self.store.num_layers
        extra = self.open_page_cost - 1
        if not extra:
            return [pool.free_pages for pool in self.store.pools]
        return [pool.free_pages - extra * self._open_pages(table.lengths) for pool, table in zip(self.store.pools, self.store.tables)]

    def check_fits(self, prompt_tokens: int, new_tokens: int, reserve_pages: int) -> None:
        """``ValueError`` when a request of ``prompt_tokens + new_tokens`` tokens could never fit
        in the page budget beside ``reserve_pages`` pages."""
        pool = self.store.pools[0]
        need = self.pages_for(0, prompt_tokens + new_tokens)
        if pool.fixed and need + reserve_pages > pool.capacity:
            raise ValueError(
                f"a request of {prompt_tokens} prompt + {new_tokens} new tokens needs {need} pages per layer; the page budget"
                f" holds {pool.capacity} (raise page_budget_bytes or shorten the request)"
            )

    def pages_for(self, held: int, tokens: int | np.ndarray) -> int | np.ndarray:
        """Budget pages per layer that ``tokens`` more tokens take after ``held`` stored tokens, once
        their full pages are sealed (negative with a codec when they fill an open page);
        elementwise for an integer array of ``tokens``."""
        return self._budget_pages(held + tokens) - self._budget_pages(held)

    def _budget_pages(self, tokens: int | np.ndarray) -> int | np.ndarray:
        """Budget pages per layer of a sequence storing ``tokens`` tokens in every head, full pages
        sealed (elementwise for an integer array)."""
        full, partial = divmod(tokens, self.page_size)
        return self.shape.num_kv_heads * (full + self.open_page_cost * (partial != 0))

    def _open_pages(self, lengths: torch.Tensor) -> int:
        """Open (partly filled) last pages of heads storing ``lengths`` tokens."""
        return int((lengths % self.page_size != 0).sum())

    def stored_tokens(self, request: Request) -> int:
        """The most tokens any head of any layer of a running request's sequence stores (its
        eviction keeps fewer than ``computed``)."""
        seq = [request.seq]
        return max(int(self.store.physical_lengths(layer, seq).max()) for layer in range(self.store.num_layers))

    def swap_in_pages(self, request: Request) -> int:
        """Budget pages per layer a swapped-out request takes when it comes back."""
        return self._budget_pages(self._swap_space[request.request_id].tokens)

    def released_pages(self, request: Request) -> list[int]:
        """Budget pages of each layer that releasing ``request``'s sequence frees (the pages
        nothing else holds; its open pages, never shared, count ``open_page_cost`` each)."""
        rows = torch.tensor([request.seq], dtype=torch.int64)
        freed = []
        for pool, table in zip(self.store.pools, self.store.tables):
            pages, holders = table.referenced_pages(rows).unique(return_counts=True)
            extra = (self.open_page_cost - 1) * self._open_pages(table.lengths[rows])
            freed.append(int((pool.refcount[pages] == holders).sum()) + extra)
        return freed

    def uses_prefix(self, request: Request) -> bool:
        """Whether ``request`` attaches and indexes prefix blocks (not with its own eviction)."""
        return self.prefix is not None and request.evictor is None

    def lookup_blocks(self, request: Request) -> list[list[int]]:
        """The request's full blocks a prefix lookup may return (never its last token, whose
        logits the model must compute)."""
        return self._blocks(request.tokens, (len(request.prompt) + len(request.output) - 1) // self.page_size)

    def block_keys(self, request: Request) -> list[bytes]:
        """Chain keys of the request's full blocks (prompt and output so far), extended as it grows."""
        full = len(request.tokens) // self.page_size
        keys = request.block_keys or []
        if len(keys) < full:
            keys = self.prefix.block_keys(self.namespace, self._blocks(request.tokens, full), keys)
            request.block_keys = keys
        return keys

    def forecast(self, running: Sequence[Request]) -> PageForecast:
        """A what-if copy of the page counts for the scheduler to plan on (see :class:`PageForecast`)."""
        return PageForecast(self, running)

    # -- applying a plan -----------------------------------------------------------------------

    def preempt(self, request: Request) -> bool:
        """Take ``request``'s pages back: swapped to host memory (``preemption="swap"``, requests
        without their own eviction; returns True), or released for recompute (False)."""
        if self.preemption == "swap" and request.evictor is None:
            self._swap_space[request.request_id] = swap_out(self.store, request.seq)
            request.seq = None
            self._release_entries(request)
            return True
        self._release(request)
        request.computed = 0
        if request.evictor is not None:
            request.evictor.reset()
        return False

    def reclaim(self, entries: list[Entry]) -> None:
        """Evict the planned unused prefix-cache ``entries`` (those a preemption's release
        already evicted are gone)."""
        if self.prefix is not None:
            self.prefix.index.evict(entries)

    def fetch(self, request: Request) -> None:
        """Bring the blocks of a new request that the prefix store's disk or remote tier holds
        into memory, before any plan counts on them: the scheduler plans with what memory holds,
        and :meth:`admit` attaches no more than that. Under a page budget, only as many blocks as
        the free pages hold are fetched (what no plan has counted on yet)."""
        if not self.uses_prefix(request) or not self.prefix.tiered:
            return
        blocks = self.lookup_blocks(request)
        if self.fixed:
            held = self.prefix.cached_blocks(self.block_keys(request)[: len(blocks)], blocks)
            blocks = blocks[: held + self.free_pages() // self.shape.num_kv_heads]
        self.prefix.fetch(self.namespace, blocks)

    def publish_tail(self, request: Request) -> bool:
        """Write the last partial page of ``request``'s computed tokens to the remote tier as a
        tail record (the hand-over's step 2, :mod:`~kvlib.adapters.engine.handover`); True when there was
        none to write or the server took it."""
        start = request.computed // self.page_size * self.page_size
        count = request.computed - start
        remote = self.prefix.remote if self.prefix is not None else None
        if count == 0 or remote is None:
            return True
        tokens = request.tokens[start : request.computed]
        parent = self.block_keys(request)[start // self.page_size - 1] if start else b""
        key = tail_key(parent, tokens, self.prefix.key_space(self.namespace))
        layers = [self.store.read(layer, [request.seq], mirror=False) for layer in range(self.store.num_layers)]
        tail = Tail(
            start,
            [read.keys[0, :, start : request.computed] for read in layers],
            [read.values[0, :, start : request.computed] for read in layers],
        )
        layout = self._tail_layout(count)
        return remote.put_many([(layout.namespace + key, tail_record(layout, key, parent, tokens, tail))]) == 1

    def fetch_tail(self, request: Request) -> None:
        """Fetch the tail record of a handed-over prompt (all but its last token: the decode
        side computes that one) into ``request.tail``; a miss leaves it None (computed instead).
        The remote tier counts it as a hit only once admission attaches it (:meth:`admit`)."""
        remote = self.prefix.remote if self.prefix is not None else None
        if remote is None or not self.uses_prefix(request):
            return
        end = len(request.prompt) - 1
        start = end // self.page_size * self.page_size
        if end == start:
            return
        tokens = request.prompt[start:end]
        parent = self.block_keys(request)[start // self.page_size - 1] if start else b""
        key = tail_key(parent, tokens, self.prefix.key_space(self.namespace))
        layout = self._tail_layout(end - start)
        (request.tail,) = remote.get_many([layout.namespace + key], lambda record: read_tail(layout, key, parent, tokens, start, record))

    def _tail_layout(self, tokens: int) -> BlockLayout:
        shape = self.shape
        namespace = self.prefix.record_namespace(self.namespace)
        return tail_layout(namespace, shape.num_kv_heads, tokens, shape.head_dim, shape.value_dim, self.dtype, shape.num_layers)

    def tail_tokens(self, request: Request, cached: int) -> int:
        """Tokens of ``request``'s fetched tail that attach after ``cached`` prefix tokens (0 unless they continue them)."""
        tail = request.tail
        return tail.length if tail is not None and tail.start == cached else 0

    def admit(self, request: Request) -> None:
        """Give a waiting request a sequence holding its longest prefix cached in memory (what the
        scheduler planned with: blocks on other tiers came in with :meth:`fetch`)."""
        request.seq = self.store.new_sequence()
        request.attached_tokens = 0
        if not self.uses_prefix(request):
            return
        entries = self.prefix.lookup(self.namespace, self.lookup_blocks(request), load=False)
        self.prefix.attach(self.namespace, request.seq, entries)
        request.entries = entries
        request.computed = request.attached_tokens = len(entries) * self.page_size
        request.indexed_blocks = len(entries)
        tail, attached = request.tail, self.tail_tokens(request, request.computed)
        request.tail = None
        if tail is not None:  # a hit only when it continues the attached prefix
            self.prefix.remote.count_use(1, int(attached > 0))
        if attached:
            positions = torch.arange(tail.start, tail.start + tail.length, device=self.device)
            for layer in range(self.store.num_layers):
                keys = tail.keys[layer].to(self.device, self.dtype, non_blocking=True)[None]
                values = tail.values[layer].to(self.device, self.dtype, non_blocking=True)[None]
                self.store.append(layer, [request.seq], keys, values, positions)
            request.computed += tail.length
        request.cached_tokens += request.computed

    def swap_in(self, request: Request) -> None:
        """A swapped-out request's tokens back in a new sequence, at the same positions."""
        request.seq = swap_in(self.store, self._swap_space.pop(request.request_id))
        request.attached_tokens = 0

    # -- after a step ----------------------------------------------------------------------------

    def index(self, request: Request) -> None:
        """Put the request's newly completed full pages into the prefix index."""
        if not self.uses_prefix(request) or request.seq is None:
            return
        full = request.computed // self.page_size
        if full <= request.indexed_blocks:
            return
        blocks = self._blocks(request.tokens, full)
        entries = self.prefix.insert(self.namespace, request.seq, blocks, request.indexed_blocks, self.block_keys(request))
        request.entries.extend(entries)
        request.indexed_blocks = full

    def free_first(self, request: Request) -> None:
        """Make the unused prefix index entries of a finished ``request``'s blocks the first to be
        reclaimed, its last block first (its offline batch needs them no more; they stay cached
        until pages are needed)."""
        if self.uses_prefix(request):
            self.prefix.index.demote(self.block_keys(request))

    def release(self, request: Request) -> None:
        """The request ends (finished or aborted): its pages, entries and swap space are released."""
        self._swap_space.pop(request.request_id, None)
        self._release(request)

    def _release(self, request: Request) -> None:
        if request.tail is not None:  # fetched, never attached (aborted while waiting)
            self.prefix.remote.count_use(1, 0)
            request.tail = None
        if request.seq is not None:
            self.store.release([request.seq])
            request.seq = None
        self._release_entries(request)

    def _release_entries(self, request: Request) -> None:
        if request.entries and self.prefix is not None:
            self.prefix.release(request.entries)
        request.entries = []
        request.indexed_blocks = 0

    def _blocks(self, tokens: list[int], count: int) -> list[list[int]]:
        size = self.page_size
        return [tokens[i * size : (i + 1) * size] for i in range(count)]
