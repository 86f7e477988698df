"""``kvlib.Engine``: continuous batching of many requests over one paged store.

Each :meth:`Engine.step` asks the :class:`~kvlib.adapters.scheduler.Scheduler` what to run
(decodes first, then prefill chunks, then admissions, within ``max_batch_tokens`` and the free
pages), runs all of it in one forward pass of the model as a packed ragged batch
(:mod:`kvlib.adapters.packed_batch`: no padding, positions per token, each sequence attending
over its own block table), and chooses each finished request's next token.

Memory: with ``page_budget_bytes`` the store's pools are fixed (keys and values of that many
bytes over all layers). Admission keeps pages in reserve for decode tokens; when pages still
run out, the most recently admitted requests are preempted: swapped to host memory
(``preemption="swap"``) or dropped and recomputed later (``"recompute"``). Full pages of
prompts and outputs go into a prefix index (:class:`~kvlib.PrefixStore`), so requests sharing
a prefix (system prompts, documents, earlier chat turns) attach its pages instead of
recomputing them; unused cached pages are reclaimed before anyone is preempted.

Invariants (``tests/adapters/test_engine*.py``): with no eviction, each request's greedy
output equals ``model.generate`` on its prompt alone, whatever the batch mix, chunking, page
budget and preemption; every page is released when requests finish or abort (only the prefix
index holds pages then); the pools never exceed the budget; a running request holds only the
prefix index entries its own sequence reads (never a second copy of a block it computed again),
so with a budget that fits every request alone, every step either runs tokens or frees pages
(or swaps a request back in to run next), and the engine finishes (``tests/adapters/test_engine_schedules.py``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import torch

from kvlib.adapters.attention import attach
from kvlib.adapters.compressor import AttentionInputs
from kvlib.adapters.engine_request import Request, RequestState
from kvlib.adapters.layer_step import LayerStep
from kvlib.adapters.make_cache import eviction_compressor
from kvlib.adapters.model_shape import kv_shape
from kvlib.adapters.packed_batch import PackedCache, Segment, visibility
from kvlib.adapters.sampling import check_sampling, next_token
from kvlib.adapters.scheduler import Scheduler, StepPlan
from kvlib.adapters.swap import SwappedSequence, swap_in, swap_out
from kvlib.paged_store import PagedStore
from kvlib.prefix_store import PrefixStore
from kvlib.read_cache import LayerRead
from kvlib.codec import Codec, layer_shapes
from kvlib.devices import check_fits
from kvlib.errors import quoted
from kvlib.limits import check_page_size
from kvlib.spec import Spec, parse_spec
from kvlib.store_config import StoreConfig
from kvlib.transformers_compat import cache_argument

PREEMPTION_MODES = ("recompute", "swap")


class Engine:
    """Serve many prompts at once on ``model`` (a `transformers` causal LM).

    Args:
        model: the model; its attention is routed through kvlib (:func:`kvlib.attach`).
        spec: default eviction spec for requests that name none (None: keep every token);
            with ``budget`` (tokens per head, or a fraction of the prompt), as in ``make_cache``.
            A quantization codec in it (``"kivi(bits=4)"``, ``"snapkv+int8"``) applies to every
            request: full pages are sealed after each layer's attention and stored encoded.
        max_batch_tokens: tokens per forward pass (decodes first, prefill chunks fill the rest).
        page_budget_bytes: bytes of keys and values the store may hold over all layers (None:
            the pools grow as needed and nothing is ever preempted). With a codec, pages count
            at their encoded size (each request's open last page is held raw on top). The pools
            take it up front, so with their positions it must fit in the memory the model's
            device has available.
        page_size: tokens per page (at most :data:`~kvlib.limits.MAX_PAGE_SIZE`).
        preemption: ``"recompute"`` or ``"swap"`` (to host memory), when pages run out.
        prefix_cache: index full pages for reuse across requests.
        prefix_cache_bytes: bytes of cached pages kept once no request uses them (default:
            the page budget, or 1 GiB); at most the page budget (the cached pages live in it),
            or without one, the memory the model's device has available.
        max_running: requests running at once at most.
        reserve_pages: pages per layer held back per running request at admission.
        fairness_steps: steps a waiting request may be passed over by prefix-aware ordering.
        read_cache: keep a dense mirror of the decoding batch (its bytes reported as
            ``read_cache``); off by default: the decode group attends straight over its pages
            (:mod:`~kvlib.adapters.packed_batch`), and only prefill chunks take a transient dense
            workspace (``memory_report()["peak_workspace_bytes"]``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: str | None = None,
        *,
        budget: int | float | None = None,
        max_batch_tokens: int = 256,
        page_budget_bytes: int | None = None,
        page_size: int = 16,
        preemption: str = "recompute",
        prefix_cache: bool = True,
        prefix_cache_bytes: int | None = None,
        max_running: int = 64,
        reserve_pages: int = 1,
        fairness_steps: int = 64,
        read_cache: bool = False,
    ) -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {quoted(preemption)}")
        check_page_size(page_size)
        _check_bytes("page_budget_bytes", page_budget_bytes, minimum=1)
        _check_bytes("prefix_cache_bytes", prefix_cache_bytes, minimum=0)
        _check_model(model)
        self.scheduler = Scheduler(max_batch_tokens, max_running, reserve_pages, fairness_steps)
        self.model = model
        self.shape = kv_shape(model)
        parsed = parse_spec(spec)
        self.codec = _engine_codec(parsed)
        self.default_spec = (_without_codec(parsed), budget)
        self._compressor(*self.default_spec)  # a bad default spec fails now
        self.preemption = preemption
        self.page_size = page_size
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        shape = self.shape
        codecs = None
        if self.codec is not None:
            codecs = self.codec.layer_codecs(
                layer_shapes(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.value_dim, page_size, self.dtype, self.device)
            )
        kv_page_bytes = page_size * (shape.head_dim + shape.value_dim) * parameter.element_size()
        if codecs is not None:  # the budget counts sealed pages at their encoded size
            kv_page_bytes = codecs[0].page_bytes()
        pages = None if page_budget_bytes is None else page_budget_bytes // (shape.num_layers * kv_page_bytes)
        if pages is not None and pages < shape.num_kv_heads:
            raise ValueError(
                f"page_budget_bytes={page_budget_bytes} holds {pages} pages per layer; one token needs {shape.num_kv_heads}"
                f" (one page of {kv_page_bytes} bytes per KV head per layer, {shape.num_layers} layers)"
            )
        positions_bytes = 0 if pages is None else pages * shape.num_layers * page_size * 8  # int64 per page slot
        prefix_bytes = _check_memory_budgets(page_budget_bytes, prefix_cache_bytes, positions_bytes, self.device)

        def build() -> PagedStore:
            return PagedStore(StoreConfig(
                shape.num_layers, shape.num_kv_heads, shape.head_dim, value_dim=shape.value_dim, page_size=page_size,
                dtype=self.dtype, device=self.device, pages_per_layer=pages or 64, fixed_capacity=pages is not None,
                read_cache=read_cache, codecs=codecs,
            ))

        attach(model)  # everything is checked: the model's attention goes through kvlib from now on
        self.prefix = PrefixStore(model, prefix_bytes) if prefix_cache else None
        if self.prefix is not None:
            self.namespace = self.prefix.namespace("" if self.codec is None else self.codec.spec(), self.dtype, self.device, page_size)
            self.store = self.prefix.paged_store(self.namespace, build)
        else:
            self.store = build()
        self.requests: dict[int, Request] = {}
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._swapped: list[Request] = []
        self._swap_space: dict[int, SwappedSequence] = {}
        self._next_id = 0
        self._in_flight_keys: set[bytes] | None = None
        self._segments: list[tuple[Segment, list[Request]]] = []
        self._counters = {"steps": 0, "forward_tokens": 0, "output_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0, "preemptions": 0}
        self._started: float | None = None

    # -- public API ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        spec: str | None = None,
        budget: int | float | None = None,
        seed: int | None = None,
    ) -> int:
        """Queue a prompt (token ids); returns its request id. ``eos_token_id`` ends it early
        (default: none, it runs ``max_new_tokens``); ``spec``/``budget``: its own eviction
        (default: the engine's spec and budget; a budget alone is refused). Checked here, before
        any model work."""
        if spec is None and budget is not None:
            raise ValueError(
                f"budget={quoted(budget)} without spec: a request's budget goes with its own eviction spec"
                " (spec='snapkv', budget=...); without spec the request uses the engine's spec and budget"
            )
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        vocab = self.model.config.get_text_config().vocab_size
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt must be a non-empty sequence of token ids in [0, {vocab})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        check_sampling(do_sample, temperature, top_k, top_p)
        pool = self.store.pools[0]
        need = self.shape.num_kv_heads * math.ceil((len(ids) + max_new_tokens) / self.page_size)
        if pool.fixed and need + self.scheduler.reserve_pages > pool.capacity:
            raise ValueError(
                f"a request of {len(ids)} prompt + {max_new_tokens} new tokens needs {need} pages per layer; the page budget"
                f" holds {pool.capacity} (raise page_budget_bytes or shorten the request)"
            )
        compressor = self._compressor(*((spec, budget) if spec is not None else self.default_spec))
        eos = frozenset() if eos_token_id is None else frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        generator = None
        if do_sample:
            generator = torch.Generator()
            generator.manual_seed(seed if seed is not None else torch.seed())
        request = Request(
            self._next_id, ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos, compressor, generator,
            arrival=time.perf_counter(),
        )
        self._next_id += 1
        self.requests[request.request_id] = request
        self._waiting.append(request)
        if self._started is None:
            self._started = request.arrival
        return request.request_id

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._swapped)

    def step(self) -> dict[int, list[int]]:
        """Run one forward pass; returns the tokens produced, per request id."""
        self._in_flight_keys = None
        plan = self.scheduler.plan(self._running, self._swapped, self._waiting, self)
        for request in plan.resumed:
            self._resume(request)
        for request in self._waiting:
            request.waited_steps += 1
        if not plan.chunks:
            if (self._waiting or self._swapped) and not self._running:
                raise RuntimeError("no waiting or swapped request fits in the free pages and none runs: the page budget is too small")
            return {}
        produced = self._run(plan)
        self._counters["steps"] += 1
        return produced

    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int = 32, **options) -> list[list[int]]:
        """Serve ``prompts`` to completion; returns each one's new tokens, in order."""
        ids = [self.add_request(prompt, max_new_tokens=max_new_tokens, **options) for prompt in prompts]
        while any(self.requests[i].state in (RequestState.WAITING, RequestState.RUNNING, RequestState.SWAPPED) for i in ids):
            self.step()
        return [list(self.requests[i].output) for i in ids]

    def abort(self, request_id: int) -> None:
        """Stop a request; its pages are released at once."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}")
        if request.state in (RequestState.FINISHED, RequestState.ABORTED):
            return
        self._leave(request, RequestState.ABORTED)

    def request_stats(self, request_id: int) -> dict:
        """Timings and counts of one request (see :meth:`Request.stats`)."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r}")
        return self.requests[request_id].stats()

    def memory_report(self) -> dict:
        """Bytes the engine's store holds now, by component, and its high-water marks.

        Keys: ``total_bytes`` (the sum of ``by_component``); ``by_component``: ``pages`` (keys
        and values of pages in use, running requests' and the prefix index's), ``positions``,
        ``codec_metadata``, ``tables`` (block tables and lengths), ``read_cache`` (the decode
        group's dense mirror, 0 unless ``read_cache=True``); ``reserved_bytes``: whole arenas,
        free pages included; ``peak_pages_bytes``: the most ``pages`` bytes held at any moment;
        ``peak_workspace_bytes``: the largest transient dense copy a segment attended over
        (prefill chunks, decode groups that could not read their pages in place), freed after
        its forward pass, so not in ``total_bytes``.
        """
        held = self.store.memory_bytes()
        components = {name: held[name] for name in ("pages", "positions", "codec_metadata", "tables", "read_cache")}
        return {
            "total_bytes": sum(components.values()),
            "by_component": components,
            "reserved_bytes": held["reserved"],
            "peak_pages_bytes": self.store.peak_page_bytes,
            "peak_workspace_bytes": self.store.peak_workspace,
        }

    def stats(self) -> dict:
        """Engine counters: steps, tokens (forward, output, prompt, cached), ``prefix_hit_rate``
        (prompt tokens taken from the prefix cache / prompt tokens admitted), ``preemptions``,
        ``tokens_per_s`` (output tokens per second since the first request), pages in use and
        free (per layer, the fullest layer; free is None without a page budget), the store's
        ``memory_bytes`` by component (pages, read mirror, ...), requests by state."""
        counters = dict(self._counters)
        elapsed = time.perf_counter() - self._started if self._started is not None else 0.0
        counters["prefix_hit_rate"] = counters["cached_tokens"] / counters["prompt_tokens"] if counters["prompt_tokens"] else 0.0
        counters["tokens_per_s"] = counters["output_tokens"] / elapsed if elapsed > 0 else 0.0
        counters["pages_in_use"] = max(pool.pages_in_use for pool in self.store.pools)
        counters["pages_free"] = self.free_pages() if self.store.pools[0].fixed else None  # None: the pools grow
        counters["memory_bytes"] = self.store.memory_bytes()
        counters.update(waiting=len(self._waiting), running=len(self._running), swapped=len(self._swapped))
        counters["prefix_cache"] = self.prefix.stats() if self.prefix is not None else None
        return counters

    # -- the page ledger the scheduler asks -----------------------------------------------------

    def free_pages(self) -> int:
        return min(pool.free_pages for pool in self.store.pools) if self.store.pools[0].fixed else 2**62

    def pages_for(self, request: Request, tokens: int) -> int:
        held = request.computed
        if request.compressor is not None and request.seq is not None:
            held = max(int(self.store.physical_lengths(layer, [request.seq]).max()) for layer in range(self.store.num_layers))
        return self.shape.num_kv_heads * (math.ceil((held + tokens) / self.page_size) - math.ceil(held / self.page_size))

    def cached_tokens(self, request: Request) -> int:
        if self.prefix is None or request.compressor is not None:
            return 0
        blocks = self._lookup_blocks(request)
        return self.prefix.cached_blocks(self._block_keys(request)[: len(blocks)], blocks) * self.page_size

    def admission_pages(self, request: Request, tokens: int) -> int:
        cached = self.cached_tokens(request)
        return self.shape.num_kv_heads * (math.ceil((cached + tokens) / self.page_size) - cached // self.page_size)

    def swap_in_pages(self, request: Request) -> int:
        return self.shape.num_kv_heads * math.ceil(self._swap_space[request.request_id].tokens / self.page_size)

    def reclaim(self, pages: int) -> None:
        if self.prefix is None:
            return
        target = self.free_pages() + pages
        while self.free_pages() < target and self.prefix.index.evict_oldest():
            pass

    def preempt(self, request: Request) -> None:
        self._counters["preemptions"] += 1
        request.preemptions += 1
        self._running.remove(request)
        if self.preemption == "swap" and request.compressor is None:
            self._swap_space[request.request_id] = swap_out(self.store, request.seq)
            request.seq = None
            self._release_entries(request)
            request.state = RequestState.SWAPPED
            self._swapped.append(request)
            return
        self._release(request)
        request.computed = 0
        request.waited_steps = 0
        if request.compressor is not None:
            request.compressor.reset()
        request.state = RequestState.WAITING
        self._waiting.insert(0, request)  # recomputed first: it was admitted before those waiting

    def in_flight(self, request: Request) -> bool:
        if self.prefix is None or request.compressor is not None:
            return False
        if self._in_flight_keys is None:
            self._in_flight_keys = set()
            for other in self._running:
                if other.compressor is None and other.remaining > 1:
                    keys = self._block_keys(other)
                    self._in_flight_keys.update(keys[other.computed // self.page_size :])
        keys = self._block_keys(request)
        first = self.cached_tokens(request) // self.page_size
        return first < len(keys) and keys[first] in self._in_flight_keys

    # -- running a step ------------------------------------------------------------------------

    def _run(self, plan: StepPlan) -> dict[int, list[int]]:
        """One forward pass over the plan's chunks; returns the tokens produced."""
        decodes = self._decode_order([request for request, tokens in plan.chunks if tokens == 1])
        chunks = [(request, tokens) for request, tokens in plan.chunks if tokens > 1]
        ids, positions, segments, start = [], [], [], 0
        groups = ([(decodes, 1)] if decodes else []) + [([request], tokens) for request, tokens in chunks]
        for requests, length in groups:
            rows = []
            for request in requests:
                rows.append(list(range(request.computed, request.computed + length)))
                ids.extend(request.tokens[request.computed : request.computed + length])
            segment_positions = torch.tensor(rows, dtype=torch.int64)
            positions.append(segment_positions.flatten())
            uniform = all(request.compressor is None for request in requests)
            segments.append((Segment([r.seq for r in requests], start, length, segment_positions, uniform), requests))
            start += len(requests) * length
        self._segments = segments
        finishing, last_index = [], []
        for segment, requests in segments:
            for b, request in enumerate(requests):
                if segment.length == request.remaining:
                    finishing.append(request)
                    last_index.append(segment.start + (b + 1) * segment.length - 1)
        cache = PackedCache(self.store, [segment for segment, _ in segments], self._after_attention)
        input_ids = torch.tensor([ids], dtype=torch.int64, device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids, position_ids=position_ids, **cache_argument(cache), use_cache=True,
                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device),  # unused: kvlib masks each segment
                logits_to_keep=torch.tensor(last_index, dtype=torch.int64, device=self.device),
            ).logits[0]
        self._counters["forward_tokens"] += len(ids)
        for segment, requests in segments:
            for request in requests:
                request.computed += segment.length
        now = time.perf_counter()
        produced: dict[int, list[int]] = {}
        for row, request in zip(logits, finishing):
            token = next_token(row, do_sample=request.do_sample, temperature=request.temperature, top_k=request.top_k,
                               top_p=request.top_p, generator=request.generator)
            request.output.append(token)
            request.token_times.append(now)
            produced[request.request_id] = [token]
            self._counters["output_tokens"] += 1
        for request, _ in plan.chunks:
            self._index(request)
            if request.done:
                self._leave(request, RequestState.FINISHED)
        return produced

    def _decode_order(self, decodes: list[Request]) -> list[Request]:
        """The decode group in the order of the store's read mirror, then the requests new to it:
        the mirror then only appends rows (finished ones already left it)."""
        mirrored = {seq: rank for rank, seq in enumerate(self.store.mirrored_rows(0))}
        return sorted(decodes, key=lambda request: mirrored.get(request.seq, len(mirrored)))

    def _after_attention(self, layer: int, index: int, query: torch.Tensor, read: LayerRead | None, scaling: float | None) -> None:
        """Per-request eviction after a segment's attention in ``layer``, then sealing its full
        pages. ``read``: the segment's dense read, or None where it attended over its pages."""
        segment, requests = self._segments[index]
        self._evict(layer, segment, requests, query, read, scaling)
        if self.codec is not None:
            self.store.seal(layer, segment.seqs)

    def _evict(self, layer: int, segment: Segment, requests: list[Request], query: torch.Tensor, read: LayerRead | None, scaling: float | None) -> None:
        """Each request with an eviction spec scores its row of the layer and compacts it; rows
        without one are not read. The row is its slice of ``read``, or, after attention over the
        pages, its positions, with attention weights from its pages and, when it compacts with a
        strategy that scores with keys or values (``reads_kv``), a transient dense read of that row.
        A row whose pages cannot be read in place is read densely."""
        for b, request in enumerate(requests):
            if request.compressor is None:
                continue
            pages = None if read is not None else self.store.paged_layer(layer, [request.seq])
            stored = None
            if pages is not None:  # causal by the row's own positions: no mask needed
                row, mask = self.store.read_positions(layer, [request.seq]), None
                stored = functools.partial(self.store.read, layer, [request.seq], mirror=False)
            else:
                row = LayerRead(*(t[b : b + 1] for t in read)) if read is not None else self.store.read(layer, [request.seq], mirror=False)
                mask = visibility(row, segment.positions[b : b + 1], query.shape[1], uniform_heads=False)
            step = LayerStep(None, layer, row, request.computed, segment.length, False, paged=pages)
            inputs = AttentionInputs(query[b : b + 1], mask, None, scaling, None)
            compaction = request.compressor.compaction(step, inputs, torch.zeros(1, dtype=torch.int64, device=self.device), stored)
            if compaction is not None:
                layout = self.store.compact(layer, [request.seq], compaction.keep, compaction.values, reuse_slots=True)
                request.compressor.compacted(layer, layout)

    # -- request life cycle ----------------------------------------------------------------------

    def admit(self, request: Request) -> None:
        """Give a waiting request a sequence holding its longest cached prefix."""
        self._waiting.remove(request)
        request.seq = self.store.new_sequence()
        request.state = RequestState.RUNNING
        request.waited_steps = 0
        self._running.append(request)
        self._counters["prompt_tokens"] += len(request.tokens)
        if self.prefix is None or request.compressor is not None:
            return
        entries = self.prefix.lookup(self.namespace, self._lookup_blocks(request))
        self.prefix.attach(self.namespace, request.seq, entries)
        request.entries = entries
        request.computed = len(entries) * self.page_size
        request.indexed_blocks = len(entries)
        request.cached_tokens += request.computed
        self._counters["cached_tokens"] += request.computed
        if self._in_flight_keys is not None:  # requests admitted later in this plan wait for its blocks
            self._in_flight_keys.update(self._block_keys(request)[len(entries) :])

    def _resume(self, request: Request) -> None:
        self._swapped.remove(request)
        request.seq = swap_in(self.store, self._swap_space.pop(request.request_id))
        request.state = RequestState.RUNNING
        self._running.append(request)

    def _index(self, request: Request) -> None:
        """Put the request's newly completed full pages into the prefix index."""
        if self.prefix is None or request.compressor is not None or request.seq is None:
            return
        full = request.computed // self.page_size
        if full <= request.indexed_blocks:
            return
        entries = self.prefix.insert(self.namespace, request.seq, self._blocks(request.tokens, full), request.indexed_blocks)
        request.entries.extend(entries)
        request.indexed_blocks = full

    def _leave(self, request: Request, state: RequestState) -> None:
        """The request ends (finished or aborted): its pages and swap space are released."""
        for queue in (self._waiting, self._running, self._swapped):
            if request in queue:
                queue.remove(request)
        self._swap_space.pop(request.request_id, None)
        self._release(request)
        request.state = state

    def _release(self, request: Request) -> None:
        if request.seq is not None:
            self.store.release([request.seq])
            request.seq = None
        self._release_entries(request)

    def _release_entries(self, request: Request) -> None:
        if request.entries and self.prefix is not None:
            self.prefix.release(request.entries)
        request.entries = []
        request.indexed_blocks = 0

    # -- helpers ---------------------------------------------------------------------------------

    def _blocks(self, tokens: list[int], count: int) -> list[list[int]]:
        size = self.page_size
        return [tokens[i * size : (i + 1) * size] for i in range(count)]

    def _lookup_blocks(self, request: Request) -> list[list[int]]:
        """The request's full blocks a prefix lookup may return (never its last token, whose
        logits the model must compute)."""
        return self._blocks(request.tokens, (len(request.prompt) + len(request.output) - 1) // self.page_size)

    def _block_keys(self, request: Request) -> list[bytes]:
        """Chain keys of the request's full blocks (prompt and output so far), extended as it grows."""
        full = len(request.tokens) // self.page_size
        keys = request.block_keys or []
        if len(keys) < full:
            blocks = self._blocks(request.tokens, full)
            keys = self.prefix.block_keys(self.namespace, blocks)
            request.block_keys = keys
        return keys

    def _compressor(self, spec: str | None, budget: int | float | None):
        """A fresh compressor for ``spec`` (eviction and budget strategies only), or None."""
        parsed = parse_spec(spec)
        others = [kind for kind in ("quantization", "lowrank", "reuse", "tiering") if getattr(parsed, kind)]
        if others:
            raise ValueError(
                f"the engine applies eviction (and budget) strategies per request; {parsed} also has {', '.join(others)}"
                " (a quantization codec applies to every request: Engine(model, spec='kivi(bits=4)'); prefix reuse is"
                " built in: prefix_cache=True)"
            )
        compressor = eviction_compressor(self.model, parsed, budget)
        if compressor is not None and "hidden_states" in compressor.strategy.needs:
            raise ValueError(f"{parsed.eviction.spec()} needs the attention input (hidden_states), which the engine does not record")
        return compressor


def _engine_codec(spec: Spec) -> Codec | None:
    """The spec's quantization codec (every request's pages), or None; ``ValueError`` for codecs
    the engine cannot share between requests and for tiering."""
    if spec.lowrank is not None:
        raise ValueError(f"{spec.lowrank.spec()} fits itself to each prompt; the engine's pages are shared by requests: use a quantization codec")
    if spec.tiering is not None or spec.reuse:
        raise ValueError(f"the engine does not apply tiering or reuse strategies yet ({spec}); prefix reuse is built in: prefix_cache=True")
    return spec.quantization


def _without_codec(spec: Spec) -> str | None:
    """The spec's eviction and budget strategies as a spec string (None when it has neither)."""
    kept = [strategy.spec() for strategy in (spec.eviction, spec.budget) if strategy is not None]
    return "+".join(kept) or None


DEFAULT_PREFIX_CACHE_BYTES = 2**30
"""Bytes of unused cached pages kept without a page budget or ``prefix_cache_bytes``."""


def _check_bytes(name: str, value: object, *, minimum: int) -> None:
    """``ValueError`` unless ``value`` is None or an int >= ``minimum`` (bytes)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum} (bytes) or None, got {quoted(value)}")


def _check_memory_budgets(
    page_budget_bytes: int | None, prefix_cache_bytes: int | None, positions_bytes: int, device: torch.device
) -> int:
    """The prefix cache's byte budget; ``ValueError`` (before anything is allocated) when the
    page budget, which the pools take up front with ``positions_bytes`` of their pages'
    positions, is more than ``device`` has available, or when ``prefix_cache_bytes`` is more than
    the page budget its pages live in (without one, more than the device has available)."""
    if page_budget_bytes is not None:
        check_fits(f"page_budget_bytes={page_budget_bytes}", page_budget_bytes + positions_bytes, device)
    if prefix_cache_bytes is None:
        return page_budget_bytes or DEFAULT_PREFIX_CACHE_BYTES
    if page_budget_bytes is not None and prefix_cache_bytes > page_budget_bytes:
        raise ValueError(
            f"prefix_cache_bytes={prefix_cache_bytes} is more than page_budget_bytes={page_budget_bytes}: the cached"
            " pages live in the page budget"
        )
    if page_budget_bytes is None:
        check_fits(f"prefix_cache_bytes={prefix_cache_bytes} (cached pages, no page budget)", prefix_cache_bytes, device)
    return prefix_cache_bytes


def _check_model(model: torch.nn.Module) -> None:
    """``ValueError`` for models kvlib cannot cache (:func:`kv_shape`: MLA, no attention KV, ...)
    or the packed batch cannot serve exactly (sliding-window attention); before ``attach``."""
    kv_shape(model)
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if layer_types != {"full_attention"} or sliding:
        raise ValueError(
            f"the engine serves models whose layers all use full causal attention; {type(model).__name__} has"
            f" {sorted(layer_types)} layers{' with a sliding window' if sliding else ''}"
        )
