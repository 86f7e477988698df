"""``kvlib.Engine``: continuous batching of many requests over one paged store.

The Engine wires three parts, each with one job, and data flows one way through a step:

- the :class:`~kvlib.adapters.engine.scheduler.Scheduler` owns the request queues; its ``plan`` decides
  what the step runs (decodes first, then prefill chunks, then admissions, within
  ``max_batch_tokens`` and the free pages) and changes nothing; its ``apply`` carries the plan out;
- the :class:`~kvlib.adapters.engine.kv_manager.KVManager` owns the paged store, the page budget, the
  prefix index and swap space: it forecasts pages for the plan, then preempts, reclaims, admits
  and swaps in as the applied plan says, indexes full blocks and releases finished requests;
- the :class:`~kvlib.adapters.engine.model_runner.ModelRunner` runs the plan's chunks in one forward pass
  of the model as a packed ragged batch (:mod:`kvlib.adapters.engine.packed_batch`: no padding,
  positions per token, each sequence attending over its own block table), evicts per request
  and chooses each finished request's next token.

Memory: with ``page_budget_bytes`` the store's pools are fixed (keys and values of that many
bytes over all layers). Admission keeps pages in reserve for decode tokens; when pages still
run out, the most recently admitted requests are preempted: swapped to host memory
(``preemption="swap"``) or dropped and recomputed later (``"recompute"``). Full pages of
prompts and outputs go into a prefix index (:class:`~kvlib.PrefixStore`), so requests sharing
a prefix (system prompts, documents, earlier chat turns) attach its pages instead of
recomputing them; unused cached pages are reclaimed before anyone is preempted.

Invariants (``tests/adapters/engine/test_engine*.py``): with no eviction, each request's greedy
output equals ``model.generate`` on its prompt alone, whatever the batch mix, chunking, page
budget and preemption; every page is released when requests finish or abort (only the prefix
index holds pages then); the pools never exceed the budget; a running request holds only the
prefix index entries its own sequence reads (never a second copy of a block it computed again),
so with a budget that fits every request alone, every step either runs tokens or frees pages
(or swaps a request back in to run next), and the engine finishes (``tests/adapters/engine/test_engine_schedules.py``).

Speculation (``speculate="suffix"``, SuffixDecoding): before each plan, every decoding request
proposes draft tokens from suffix tries over its own tokens and the engine's recent outputs
(:mod:`~kvlib.adapters.engine.suffix_speculator`); the plan runs what fits after the decodes,
chunks and admissions, and the runner verifies each draft in the same forward pass and truncates
what it rejects. Greedy outputs equal the engine's without it; sampled outputs keep their
distribution (``tests/adapters/engine/test_engine_speculate.py``).

Finished requests: ``engine.requests`` keeps a finished or aborted request (its output, its
stats) until :meth:`Engine.collect` takes it, and at most ``max_finished`` of them (the oldest
go first), so a server running for weeks holds a bounded number of requests whatever its
callers collect (``tests/adapters/engine/test_engine.py``).

Threads: an Engine is driven by one thread (``step``, ``receive``, ``generate``, ``abort`` and
``collect`` from the thread that serves it); see ``docs/security.md``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvlib.adapters.engine.engine_options import check_engine, check_speculation, engine_codec, request_evictor, without_codec
from kvlib.adapters.engine.engine_request import Request, RequestState
from kvlib.adapters.engine.handover_roles import MAX_AGE_S, HandOverKey, HandOverRole, check_role
from kvlib.adapters.engine.kv_manager import KVManager
from kvlib.adapters.engine.model_runner import ModelRunner
from kvlib.adapters.engine.page_budget import page_budget
from kvlib.adapters.engine.prefix_groups import prefix_groups
from kvlib.adapters.engine.request_checks import REQUEST_OPTIONS, checked_request
from kvlib.adapters.engine.scheduler import Scheduler, StepPlan
from kvlib.adapters.engine.suffix_speculator import Draft, SuffixSpeculation, SuffixSpeculator, speculation
from kvlib.adapters.runtime.attention import route_attention
from kvlib.errors import quoted
from kvlib.kernels.shared_prefix import MIN_SAVED_READS
from kvlib.limits import MAX_REQUEST_TOKENS
from kvlib.model_shape import kv_shape, model_context
from kvlib.spec import parse_spec
from kvlib.storage.tiers.open_tiers import remote_tier

if TYPE_CHECKING:
    from kvlib.adapters.engine.handover import HandOver
    from kvlib.storage.prefix.prefix_store import PrefixStore
    from kvlib.storage.store.paged_store import PagedStore
    from kvlib.storage.tiers.remote_tier import RemoteTier


class Engine:
    """Serve many prompts at once on ``model`` (a `transformers` causal LM).

    Args:
        model: the model; its attention is routed through kvlib (:func:`~kvlib.adapters.runtime.attention.route_attention`).
        spec: default eviction spec for requests that name none (None: keep every token);
            with ``budget`` (tokens per head, or a fraction of the prompt), as in ``make_cache``.
            A quantization codec in it (``"kivi(bits=4)"``, ``"snapkv+int8"``) applies to every
            request: full pages are sealed after each layer's attention and stored encoded.
        max_batch_tokens: tokens per forward pass (decodes first, prefill chunks fill the rest).
        page_budget_bytes: bytes of keys and values the store may hold over all layers between
            steps (None: the pools grow as needed and nothing is ever preempted). With a codec,
            sealed pages count at their encoded size and each head's open last page at its raw
            size (rounded up to whole encoded pages); a step's prefill chunk is raw on top until
            its layer seals it. The pools take it up front, so with their positions (int64 per
            page slot, not in the budget) it must fit in the memory the model's device has available.
        page_size: tokens per page (at most :data:`~kvlib.limits.MAX_PAGE_SIZE`).
        preemption: ``"recompute"`` or ``"swap"`` (to host memory), when pages run out.
        prefix_cache: index full pages for reuse across requests.
        prefix_cache_bytes: bytes of cached pages kept once no request uses them (default:
            the page budget, or 1 GiB); at most the page budget (the cached pages live in it),
            or without one, the memory the model's device has available.
        max_running: requests running at once at most.
        reserve_pages: pages per layer held back per running request at admission.
        fairness_steps: steps a waiting request may be passed over by prefix-aware ordering.
        admission: ``"reserve"`` (keep ``reserve_pages`` free per running request) or
            ``"forecast"`` (the Past-Future scheduler: admit while the forecast peak of the pages
            the running batch will take fits, each request's remaining output length forecast from
            the output lengths of the requests finished so far, conditioned on what it has produced;
            :meth:`~kvlib.adapters.engine.scheduler.Scheduler.forecast_peak`).
        forecast_quantile: with ``admission="forecast"``, the quantile of the batch's peak pages
            over futures drawn from the output-length history that admission plans for, in (0, 1]
            (higher preempts less, admits less).
        read_cache: keep a dense mirror of the decoding batch (its bytes reported as
            ``read_cache``); off by default: the decode group attends straight over its pages
            (:mod:`~kvlib.adapters.engine.packed_batch`), and only prefill chunks take a transient dense
            workspace (``memory_report()["peak_workspace_bytes"]``).
        remote: a :class:`~kvlib.storage.tiers.remote_tier.RemoteTier` or a ``redis://host:port/db``
            URL: full prefix pages also go to that server, and lookups continue there after
            memory (with ``prefix_cache``); engines of several processes on one server share
            prefixes. Faults of the server are counted misses (``stats()["remote"]``).
        remote_key: the secret tagging remote records and hand-over messages (None:
            ``$KVLIB_REMOTE_KEY``); a URL without either is refused unless ``remote_trust``.
        remote_trust: ``"key"`` (default) or ``"any-writer"``: no key, records and messages
            unauthenticated, which anyone who can write to the server can forge (a private server only).
        role: ``"both"`` (prefill and decode here), ``"prefill"`` (run each prompt but its last
            token, publish its pages to the remote tier and hand the request over through
            ``handover_queue``) or ``"decode"`` (take requests over with :meth:`receive`); the
            two split roles need ``remote``. Protocol: :mod:`~kvlib.adapters.engine.handover`. A server
            whose ``maxmemory-policy`` evicts any key (``allkeys-*``) can evict queued messages:
            a split role warns about it (run it with ``volatile-lru``).
        handover_queue: the name of the hand-over queue prefill engines push to and decode engines
            read (its server name comes from the key, so tenants with other keys never share it).
        handover_max_age_s: seconds a handed-over message may take from the prefill engine to
            this decode engine; an older one (or a replay of one taken) is refused.
        max_finished: finished or aborted requests kept in :attr:`requests` (for their outputs and
            stats) until :meth:`collect` takes them; past that the oldest are dropped. None keeps
            every one (a long-running engine then grows without bound).
        speculate: None (off), ``"suffix"`` or a
            :class:`~kvlib.adapters.engine.suffix_speculator.SuffixSpeculation` (its options):
            speculative decoding without a draft model, drafts from suffix tries over each
            request's prompt and output and over recent outputs, verified in the step's forward
            pass. Refused with an eviction spec (its per-slot scores would keep what rejected
            tokens added), a codec (a rejected token's page would be sealed before the rollback)
            and sliding-window layers (a verification slides the window past tokens a rollback
            needs back).
        shared_prefix: where several decoding requests begin with the same full pages (a prefix
            the prefix cache attached to each), their decode attention reads those pages once
            for all of them and each request's own pages apart, merged exactly by log-sum-exp
            (Hydragen; :mod:`~kvlib.kernels.shared_prefix`), in a layer where that saves at
            least :data:`~kvlib.kernels.shared_prefix.MIN_SAVED_READS` (token, KV head) reads (below
            it the split costs more than it saves on the CPU); an int sets that least saving (0:
            wherever pages are shared); False reads every request's pages apart. Outputs are the same either way; ``stats()["kv_read_bytes"]`` counts what was read.
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
        admission: str = "reserve",
        forecast_quantile: float = 0.9,
        read_cache: bool = False,
        remote: RemoteTier | str | None = None,
        remote_key: str | bytes | None = None,
        remote_trust: str = "key",
        role: str = "both",
        handover_queue: str = "default",
        handover_max_age_s: float = MAX_AGE_S,
        max_finished: int | None = 1024,
        speculate: str | SuffixSpeculation | None = None,
        shared_prefix: bool | int = True,
    ) -> None:
        check_engine(model, preemption, page_size, page_budget_bytes, prefix_cache_bytes, prefix_cache, remote, shared_prefix)
        speculation_options = speculation(speculate)
        check_role(role, handover_queue, remote, handover_max_age_s)
        if max_finished is not None and (isinstance(max_finished, bool) or not isinstance(max_finished, int) or max_finished < 0):
            raise ValueError(f"max_finished must be an int >= 0 (requests) or None, got {quoted(max_finished)}")
        remote = remote_tier(remote, remote_key, remote_trust)  # a missing key fails before the model is touched
        self.role, self.handover_queue = role, handover_queue
        self.page_size = page_size
        self.scheduler = Scheduler(max_batch_tokens, max_running, reserve_pages, fairness_steps, admission, forecast_quantile)
        self.model = model
        self.shape = kv_shape(model)
        self.vocab = model.config.get_text_config().vocab_size
        self.context = model_context(model)
        """Most tokens (prompt plus new) of a request: the model's declared context (None: none declared)."""
        parsed = parse_spec(spec)
        self.codec = engine_codec(parsed)
        self.default_spec = (without_codec(parsed), budget)
        request_evictor(model, *self.default_spec, None, page_size=page_size)  # a bad default spec fails now
        if speculation_options is not None:
            check_speculation(model, self.codec, self.default_spec[0])
        self.speculator = SuffixSpeculator(speculation_options) if speculation_options is not None else None
        """Proposes each decoding request's draft (None: no speculation)."""
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        pages = {"codec": self.codec, "page_size": page_size, "dtype": self.dtype, "device": self.device}
        sizes = page_budget(self.shape, **pages, page_budget_bytes=page_budget_bytes, prefix_cache_bytes=prefix_cache_bytes)
        if any(codec is not None and codec.learns and not codec.ready for codec in sizes.codecs or ()):
            raise ValueError(
                f"{self.codec.spec()} fits itself to each prompt's first call; the engine's pages are shared by requests and"
                " fitted by none: give it a fit made beforehand (squat(calibration=...) from kvlib.policies.quantization.squat."
                "calibrate_squat) or use a codec that needs none (kivi, int8, fp8)"
            )
        route_attention(model)  # everything is checked: the model's attention goes through kvlib from now on
        self.kv = KVManager(
            model, self.shape, sizes, **pages, read_cache=read_cache, prefix_cache=prefix_cache, preemption=preemption, remote=remote
        )
        self.handover_role = HandOverRole(
            role, handover_queue, self.kv, vocab=self.vocab, max_tokens=self.context or MAX_REQUEST_TOKENS, max_age_s=handover_max_age_s
        )
        """The prefill or decode side of hand-overs (:mod:`~kvlib.adapters.engine.handover_roles`; idle for role ``"both"``)."""
        self.runner = ModelRunner(
            model, self.kv.store, self.shape, codec=self.codec, device=self.device, shared_prefix=_least_saved_reads(shared_prefix)
        )
        self._token_bytes = (self.shape.head_dim + self.shape.value_dim) * self.dtype.itemsize
        """Bytes of one stored token's key and value in one KV head, in the compute dtype."""
        self.requests: dict[int, Request] = {}
        """Requests by id: those queued or running, and finished or aborted ones until collected
        (at most ``max_finished`` of those, oldest dropped first)."""
        self.max_finished = max_finished
        self._finished: dict[int, None] = {}
        """Ids of the finished or aborted requests still in :attr:`requests`, oldest first."""
        self._next_id = 0
        self._counters = {"steps": 0, "forward_tokens": 0, "output_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0, "preemptions": 0}
        self._counters |= {"verifications": 0, "draft_tokens": 0, "accepted_tokens": 0, "kv_read_bytes": 0}
        self._started: float | None = None

    @property
    def store(self) -> PagedStore:
        """The paged store every request's keys and values live in (the KV manager's)."""
        return self.kv.store

    @property
    def prefix(self) -> PrefixStore | None:
        """The prefix cache (the KV manager's), or None with ``prefix_cache=False``."""
        return self.kv.prefix

    @property
    def handover_sender(self) -> str:
        """The random token naming this engine in the hand-over messages it sends: a decode
        engine's :meth:`receive` keys this engine's requests by ``(handover_sender, request id)``."""
        return self.handover_role.sender

    @property
    def handover_s(self) -> dict[int, float]:
        """Decode role: seconds from a hand-over's start (prefill side) to its request queued here with its pages, by request id."""
        return self.handover_role.handover_s

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
        slack: int | None = None,
    ) -> int:
        """Queue a prompt (token ids); returns its request id. ``eos_token_id`` ends it early
        (default: none, it runs ``max_new_tokens``); ``spec``/``budget``: its own eviction
        (default: the engine's spec and budget; a budget alone is refused); ``slack``: tokens a
        head may hold over an int budget before it is compacted back (None: as
        :func:`kvlib.make_cache`, a page of them, or none for a ring; 0 holds the cap to the
        token); ``seed``: an int in
        ``[0, 2**63)`` seeding its sampling. Checked here, before any model work: prompt plus
        ``max_new_tokens`` within the model's context (``max_position_embeddings``; without one,
        :data:`~kvlib.limits.MAX_REQUEST_TOKENS`) and the page budget."""
        settings = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature, "top_k": top_k}
        settings |= {"top_p": top_p, "eos_token_id": eos_token_id, "spec": spec, "budget": budget, "seed": seed}
        return self._enqueue(*self._prepare(prompt, settings, slack))

    def _prepare(self, prompt: Sequence[int] | torch.Tensor, settings: dict, slack: int | None = None) -> tuple[Request, HandOver | None]:
        """The request ``add_request(prompt, **settings)`` queues (its id not given yet) and, on
        a prefill engine, its hand-over message; ``ValueError`` for any bad argument. Nothing is
        queued or run; the prompt's length is checked before its ids are read."""
        spec, budget, max_new_tokens, seed = settings["spec"], settings["budget"], settings["max_new_tokens"], settings["seed"]
        if self.role == "prefill" and spec is not None:
            raise ValueError("a prefill engine computes every prompt token exactly; give eviction specs to the decode engine")
        if self.speculator is not None and spec is not None:
            raise ValueError(
                f"spec={quoted(spec)} on a speculating engine: a rollback of rejected draft tokens would leave their"
                " share in the eviction scores; leave spec unset or build the Engine without speculate"
            )
        if spec is None and budget is not None:
            raise ValueError(
                f"budget={quoted(budget)} without spec: a request's budget goes with its own eviction spec"
                " (spec='snapkv', budget=...); without spec the request uses the engine's spec and budget"
            )
        ids, eos = checked_request(prompt, settings, vocab=self.vocab, context=self.context)
        do_sample, temperature, top_k, top_p = (settings[name] for name in ("do_sample", "temperature", "top_k", "top_p"))
        self.kv.check_fits(len(ids), max_new_tokens, self.scheduler.reserve_pages)
        evictor = request_evictor(self.model, *((spec, budget) if spec is not None else self.default_spec), slack, page_size=self.page_size)
        handover = None
        if self.role == "prefill":  # run all but the last token here; the decode side draws every output token
            handover = self.handover_role.message(ids, settings)
            ids, max_new_tokens, do_sample, eos, evictor = ids[:-1] or ids, 1, False, frozenset(), None
        generator = None
        if do_sample:
            generator = torch.Generator()
            generator.manual_seed(seed if seed is not None else torch.seed())
        request = Request(-1, ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos, evictor, generator)
        return request, handover

    def _enqueue(self, request: Request, handover: HandOver | None) -> int:
        """Give a prepared request its id and queue it (a prefill engine's one-token prompt is
        handed over at once); returns its id."""
        request.request_id, request.arrival = self._next_id, time.perf_counter()
        self._next_id += 1
        self.requests[request.request_id] = request
        if handover is not None and self.handover_role.queued(request, handover):  # nothing to prefill: handed over at once
            request.state = RequestState.FINISHED
            self._keep_finished(request.request_id)
            return request.request_id
        self.kv.fetch(request)
        if self.role == "decode":
            self.kv.fetch_tail(request)
        self.scheduler.add(request)
        if self._started is None:
            self._started = request.arrival
        return request.request_id

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> dict[int, list[int]]:
        """Run one forward pass; returns the tokens produced, per request id."""
        drafts, costs = self._drafts(), {}
        if self.speculator is not None:  # the chances' calibration weighs what a token costs against them
            options, calibration = self.speculator.options, self.speculator.calibration()
            costs = {"token_cost": options.token_cost / calibration, "segment_cost": options.segment_cost / calibration}
        plan = self.scheduler.plan(self.kv, drafts, **costs, context=self.context)
        self.scheduler.apply(plan, self.kv)
        self._count(plan)
        if not plan.chunks:
            if self.scheduler.stalled:
                raise RuntimeError("no waiting or swapped request fits in the free pages and none runs: the page budget is too small")
            return {}
        produced = self.runner.run(plan.chunks, plan.drafts)
        self._counters["forward_tokens"] += plan.tokens
        self._counters["kv_read_bytes"] += self.runner.decode_reads * self._token_bytes
        self._counters["output_tokens"] += sum(map(len, produced.values()))
        for request, draft in plan.drafts.items():
            tokens = produced.get(request.request_id, [])
            accepted = next((i for i, (a, b) in enumerate(zip(draft, tokens)) if a != b), min(len(draft), len(tokens)))
            self._counters["verifications"] += 1
            self._counters["draft_tokens"] += len(draft)
            self._counters["accepted_tokens"] += accepted
            self.speculator.observe(drafts[request], len(draft), accepted)
        for request, _ in plan.chunks:
            self.kv.index(request)
            if request.done:
                self.handover_role.finish(request, produced)  # prefill role: its token is the decode side's to draw
                self._leave(request, RequestState.FINISHED)
        self._counters["steps"] += 1
        return produced

    def _drafts(self) -> dict[Request, Draft]:
        """The drafts the running decoding requests propose (none without speculation, or where
        SuffixDecoding's rules find none)."""
        if self.speculator is None:
            return {}
        proposals = {request: self.speculator.propose(request) for request in self.scheduler.running if request.remaining == 1}
        return {request: draft for request, draft in proposals.items() if draft.tokens}

    def receive(self, wait_s: float = 0.0) -> dict[HandOverKey, int]:
        """Decode role: queue every request handed over so far, waiting up to ``wait_s`` seconds
        for the first (an empty queue returns after ``wait_s``), each with the pages the prefill
        side published; returns the local request id of each, by
        :class:`~kvlib.adapters.engine.handover_roles.HandOverKey` ``(sender, id)``: the prefill
        engine's :attr:`handover_sender` and its request id, so requests of several prefill
        engines never collide. Never raises for what it reads: a message that is not sealed with
        this engine's key, fails a check (:meth:`HandOver.from_bytes
        <kvlib.adapters.engine.handover.HandOver.from_bytes>`: fields, sizes, this engine's model
        and context, page budget), is older than ``handover_max_age_s`` or repeats one already
        taken on this server (by any decode engine, before any restart of theirs) is removed and
        counted in ``stats()["bad_handovers"]``; every genuine message read in the call is queued
        and returned whatever comes after it. At most
        :data:`~kvlib.adapters.engine.handover_roles.MAX_MESSAGES_PER_RECEIVE` messages are read
        per call (the rest wait for the next). A server refusing the credentials raises
        :class:`~kvlib.errors.RemoteAccessDenied`."""
        if self.role != "decode":
            raise ValueError(f"receive() is for an Engine with role='decode'; this one's role is {quoted(self.role)}")
        return self.handover_role.receive(wait_s, self._prepare, lambda prepared: self._enqueue(*prepared))

    def generate(
        self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int = 32, *, group_prefixes: bool = True, **options
    ) -> list[list[int]]:
        """Serve ``prompts`` to completion; returns each one's new tokens, in the caller's order.
        Every prompt is checked (as :meth:`add_request` does) before any is queued.

        ``group_prefixes`` (global prefix grouping, BatchLLM): the batch's prompts are grouped by
        shared prefix first (:func:`~kvlib.adapters.engine.prefix_groups.prefix_groups`) and queued
        one group at a time, the next once none of this call's requests waits for admission, so a
        group's shared prefix is computed once while its pages are held and the pages of a
        finished group are the first the prefix cache gives back. False queues every prompt at
        once, in order. Greedy outputs are the same either way."""
        if not isinstance(group_prefixes, bool):
            raise ValueError(f"group_prefixes must be True or False, got {quoted(group_prefixes)}")
        unknown = sorted(set(options) - set(REQUEST_OPTIONS))
        if unknown:
            raise ValueError(f"unknown options {unknown}; generate takes {sorted(REQUEST_OPTIONS)} and group_prefixes")
        settings = {**REQUEST_OPTIONS, "max_new_tokens": max_new_tokens, **options}
        prepared = [self._prepare(prompt, settings) for prompt in prompts]
        requests = [request for request, _ in prepared]  # held here: max_finished may drop them from self.requests
        groups = prefix_groups([request.prompt for request in requests], self.page_size) if group_prefixes else [list(range(len(requests)))]
        unfinished = (RequestState.WAITING, RequestState.RUNNING, RequestState.SWAPPED)
        queued, serving = 0, []  # groups queued so far; the queued groups not finished yet
        while queued < len(groups) or serving:
            if queued < len(groups) and not any(request.state is RequestState.WAITING for group in serving for request in group):
                for index in groups[queued]:
                    self._enqueue(*prepared[index])
                serving.append([requests[index] for index in groups[queued]])
                queued += 1
                continue
            self.step()
            for group in [group for group in serving if not any(request.state in unfinished for request in group)]:
                serving.remove(group)
                for request in group if group_prefixes else ():
                    self.kv.free_first(request)
        return [list(request.output) for request in requests]

    def collect(self, request_id: int) -> list[int]:
        """The output of finished or aborted request ``request_id``, which the engine then forgets
        (its id leaves :attr:`requests`); ``ValueError`` for an unknown id or a request still queued
        or running."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request id {request_id!r} (never added, or collected or dropped already)")
        if request_id not in self._finished:
            raise ValueError(f"request {request_id} is {request.state.value}: collect it once it has finished")
        self._drop(request_id)
        return list(request.output)

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
        ``tokens_per_s`` (output tokens per second since the first request), with speculation
        ``verifications`` (drafts verified), ``draft_tokens`` and ``accepted_tokens`` (of them; a
        verification outputs its accepted tokens and one more), ``kv_read_bytes`` (keys and values
        the decode groups' attention read over their pages, every layer, in the compute dtype: a
        shared prefix once per group with ``shared_prefix``, a codec's sealed pages as if raw;
        nothing for a group read densely), pages in use and
        free (per layer, the fullest layer; free is None without a page budget), the store's
        ``memory_bytes`` by component (pages, read mirror, ...), requests by state, and the remote
        tier's counters (``remote``: hits, misses, writes, faults; None without one)."""
        counters = self._counters | self.handover_role.counters
        elapsed = time.perf_counter() - self._started if self._started is not None else 0.0
        counters["prefix_hit_rate"] = counters["cached_tokens"] / counters["prompt_tokens"] if counters["prompt_tokens"] else 0.0
        counters["tokens_per_s"] = counters["output_tokens"] / elapsed if elapsed > 0 else 0.0
        counters["pages_in_use"] = max(pool.pages_in_use for pool in self.store.pools)
        counters["pages_free"] = self.kv.free_pages() if self.kv.fixed else None  # None: the pools grow
        counters["memory_bytes"] = self.store.memory_bytes()
        scheduler = self.scheduler
        counters.update(waiting=len(scheduler.waiting), running=len(scheduler.running), swapped=len(scheduler.swapped))
        counters["prefix_cache"] = self.prefix.stats() if self.prefix is not None else None
        counters["remote"] = self.prefix.remote.stats() if self.prefix is not None and self.prefix.remote is not None else None
        return counters

    def _count(self, plan: StepPlan) -> None:
        """Count an applied plan's preemptions and admissions (prompt tokens, cached tokens)."""
        self._counters["preemptions"] += len(plan.preempted)
        for request in plan.admitted:
            self._counters["prompt_tokens"] += len(request.tokens)
            self._counters["cached_tokens"] += request.computed

    def _leave(self, request: Request, state: RequestState) -> None:
        """The request ends (finished or aborted): its pages and swap space are released, and it is
        kept among the finished (the oldest beyond ``max_finished`` dropped)."""
        self.scheduler.remove(request)
        self.kv.release(request)
        if self.speculator is not None:
            self.speculator.finish(request, finished=state is RequestState.FINISHED)
        request.state = state
        if state is RequestState.FINISHED:
            self.scheduler.lengths.record(len(request.output))
        self._keep_finished(request.request_id)

    def _keep_finished(self, request_id: int) -> None:
        """Keep finished request ``request_id`` among the finished, dropping the oldest beyond ``max_finished``."""
        self._finished[request_id] = None
        if self.max_finished is not None:
            while len(self._finished) > self.max_finished:
                self._drop(next(iter(self._finished)))

    def _drop(self, request_id: int) -> None:
        """Forget finished request ``request_id`` (and what the hand-over role kept for it)."""
        del self._finished[request_id]
        del self.requests[request_id]
        self.handover_role.forget(request_id)


def _least_saved_reads(shared_prefix: bool | int) -> int | None:
    """The ``shared_prefix`` option as the runner takes it: the fewest (token, KV head) reads per
    layer a shared-prefix split must save, or None for never."""
    if shared_prefix is True:
        return MIN_SAVED_READS
    return None if shared_prefix is False else shared_prefix
