"""What the engine runs each step: decodes first, then prefill chunks, then admissions, within a
token budget and the free pages (Sarathi-Serve's stall-free batching over vLLM-style paging).

The :class:`Scheduler` owns the request queues (waiting, running, swapped, each oldest first).
A step is two calls, with data flowing one way:

- :meth:`Scheduler.plan` decides, and changes nothing: it spends, reclaims and preempts on a
  :class:`Forecast` (a what-if copy of the KV manager's page counts,
  :class:`~kvlib.adapters.engine.page_forecast.PageForecast`), and returns a
  :class:`StepPlan` holding every decision;
- :meth:`Scheduler.apply` carries the plan out: it moves requests between the queues and asks
  the KV manager (:class:`PageLedger`) to preempt and reclaim (in the plan's order), then to
  admit and swap in, which leaves the pages where the forecast said they would be.

The decisions of one plan:

1. every running request that decodes (one token to run) gets its token; if the pages for
   those tokens are short, unused prefix-cache pages are reclaimed, then the most recently
   admitted requests are preempted (swapped out or dropped for recompute) until they fit;
2. swapped requests come back, oldest first, while their pages fit;
3. running requests still prefilling get chunks from the remaining token budget, oldest first;
4. waiting requests are admitted while the budget and the pages allow, in prefix-aware order:
   requests whose prompt has the longest cached prefix first, a request whose next uncached
   block another request is computing right now waits for it (so a shared prefix is computed
   once), and a request that waited more than ``fairness_steps`` steps goes first, by arrival.
   Admission (``admission="reserve"``) keeps ``reserve_pages`` free per running request for
   its coming decode tokens; forecast admission (``"forecast"``, the Past-Future scheduler)
   admits while the forecast peak of the pages the running batch and the candidate will take
   fits in the free pages (:meth:`Scheduler.forecast_peak`);
5. with speculation, decoding requests' drafts (proposed before the plan) run with their tokens,
   all of one length (one segment), as many tokens and requests as the cost model finds worth it
   (:meth:`Scheduler._add_drafts`), within the token budget and the pages left over; a step that
   preempts runs no drafts. Drafts come last so that they never delay a prefill chunk or an
   admission.

Invariant: a plan never needs more pages than are free once it is applied, and never more than
``max_batch_tokens`` tokens (decodes alone may exceed it: they are never stalled).

Progress: with a page budget that fits every request alone, every step either runs tokens or
frees pages (reclaiming cached pages, preempting the newest requests, down to the oldest alone)
or swaps a request back in to run next, so the engine finishes. This rests on the KV manager's
side: a running request holds no pages but those its own sequence reads (the prefix index pins
no second copy of a block for it, :meth:`~kvlib.PrefixStore.insert`), and everything else is
either held by the other running requests or reclaimable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvlib.adapters.engine.engine_request import Request, RequestState
from kvlib.adapters.engine.output_lengths import OutputLengths, check_quantile
from kvlib.adapters.engine.suffix_speculator import Draft
from kvlib.errors import quoted

ADMISSION_POLICIES = ("reserve", "forecast")
FORECAST_SAMPLES = 64
"""Futures forecast admission draws to place a candidate's peak (:meth:`Scheduler.forecast_peak`)."""


class Forecast(Protocol):
    """The KV manager's page counts as they would be after the decisions a plan took so far; the
    plan spends, reclaims and preempts on it while the KV manager itself stays as it is."""

    reclaimed: list
    """The unused prefix-cache blocks the forecast reclaimed, in order (opaque to the scheduler)."""

    def free_pages(self) -> int:
        """Pages free in the layer with the fewest free pages."""

    def computed(self, request: Request) -> int:
        """Tokens ``request``'s sequence holds (after a planned admission: its cached prefix)."""

    def pages_for(self, request: Request, tokens: int | np.ndarray) -> int | np.ndarray:
        """Pages (per layer, at most) that running ``tokens`` more tokens of ``request`` allocates
        (elementwise for an integer array of ``tokens``)."""

    def cached_tokens(self, request: Request) -> int:
        """Leading tokens of a waiting request that the prefix cache holds (whole pages, never
        its last token)."""

    def admission_pages(self, request: Request, tokens: int | np.ndarray) -> int | np.ndarray:
        """Pages a waiting request's first chunk of ``tokens`` computed tokens allocates after its
        cached prefix (elementwise for an integer array)."""

    def swap_in_pages(self, request: Request) -> int:
        """Pages a swapped request needs to come back."""

    def reclaim(self, pages: int) -> None:
        """Free up to ``pages`` pages held only by the prefix cache (least recently used first)."""

    def preempt(self, request: Request) -> None:
        """Count ``request``'s pages as given back."""

    def admit(self, request: Request) -> None:
        """Count ``request`` as started, holding its longest cached prefix (whatever the cache
        holds now, which may differ from :meth:`cached_tokens` before a reclaim)."""

    def in_flight(self, request: Request) -> bool:
        """Whether ``request``'s next uncached prompt block is being computed by a running request."""

    def held_pages(self, request: Request) -> int:
        """Pages (per layer, at most) a running request holds beyond the cached prefix it attached
        (what finishing gives back)."""


class PageLedger(Protocol):
    """The KV manager as the scheduler sees it: a forecast to plan on, and the actions that apply
    a plan."""

    def forecast(self, running: Sequence[Request]) -> Forecast:
        """A fresh forecast of the pages now, ``running`` being the running requests."""

    def preempt(self, request: Request) -> bool:
        """Take ``request``'s pages back: True when swapped out (it comes back by :meth:`swap_in`),
        False when dropped (it is computed again)."""

    def reclaim(self, blocks: list) -> None:
        """Evict the unused prefix-cache blocks a forecast reclaimed."""

    def admit(self, request: Request) -> None:
        """Give ``request`` a sequence holding its longest cached prefix."""

    def swap_in(self, request: Request) -> None:
        """Bring a swapped-out request's pages back."""


@dataclass
class StepPlan:
    """Every decision of one step. ``chunks`` lists (request, tokens to run) with the decodes
    first; ``admitted`` and ``resumed`` name the requests that start or come back (their chunks
    are in ``chunks``); ``preempted`` the requests that lose their pages, newest first;
    ``reclaimed`` the unused prefix-cache blocks evicted for pages (least recently used first),
    the first ``reclaimed_before[i]`` of them before ``preempted[i]`` is (the plan's order, which
    the pools' free lists, and so the page ids handed out next, follow); ``drafts`` the draft
    tokens each verifying request runs after its last token (its chunk is ``1 + len(draft)``
    tokens)."""

    chunks: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    reclaimed: list = field(default_factory=list)
    reclaimed_before: list[int] = field(default_factory=list)
    drafts: dict[Request, list[int]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class Scheduler:
    """Chunked-prefill continuous batching under a token budget and a page budget.

    Args:
        max_batch_tokens: tokens per step (decodes count one each; prefill chunks fill the rest).
        max_running: requests running at once at most.
        reserve_pages: pages per layer kept free for each running request's coming decode tokens
            when admitting (0: admit whatever fits now; preemption handles the rest).
        fairness_steps: a waiting request that has waited more steps than this is admitted
            before any other (by arrival), whatever its prefix match.
        admission: ``"reserve"`` (keep ``reserve_pages`` per running request) or ``"forecast"``
            (admit while :meth:`forecast_peak` fits in the free pages).
        forecast_quantile: the quantile of the batch's peak pages, over futures drawn from the
            output-length history, that forecast admission plans for (:meth:`forecast_peak`);
            higher is safer.
        lengths: the output lengths of finished requests (the engine records them).

    Queues (oldest first; a request is in at most one): ``waiting`` (not admitted, or preempted
    for recompute: first in line), ``running`` (admitted, in admission order), ``swapped``.
    """

    max_batch_tokens: int = 256
    max_running: int = 64
    reserve_pages: int = 1
    fairness_steps: int = 64
    admission: str = "reserve"
    forecast_quantile: float = 0.9
    lengths: OutputLengths = field(default_factory=OutputLengths)
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    swapped: list[Request] = field(default_factory=list)
    _draws: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0), init=False, repr=False)
    """The futures forecast admission draws (seeded: a run's admissions repeat)."""

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_running", "fairness_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.reserve_pages, bool) or not isinstance(self.reserve_pages, int) or self.reserve_pages < 0:
            raise ValueError(f"reserve_pages must be an int >= 0, got {self.reserve_pages!r}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {quoted(self.admission)}")
        self.forecast_quantile = check_quantile(self.forecast_quantile)

    # -- the queues ------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request last in line."""
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out of whichever queue holds it (it finished or was aborted)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def stalled(self) -> bool:
        """Requests wait or are swapped out while none runs (after a plan that runs nothing, the
        page budget cannot hold any of them)."""
        return bool(self.waiting or self.swapped) and not self.running

    # -- deciding --------------------------------------------------------------------------------

    def plan(
        self,
        ledger: PageLedger,
        drafts: Mapping[Request, Draft] | None = None,
        token_cost: float = 0.0,
        segment_cost: float = 0.0,
        context: int | None = None,
    ) -> StepPlan:
        """Decide the next step on a forecast of ``ledger``'s pages; the queues, the requests and
        the ledger are left as they are (:meth:`apply` carries the plan out). ``drafts``: drafts
        proposed to follow running decoding requests' last tokens (speculation), verified where
        they pay for themselves by the cost model of :meth:`_add_drafts` (``token_cost``: a
        token's cost, ``segment_cost``: a verification segment's, each as a share of a step's
        fixed cost) and the budget and pages left over allow;
        ``context``: the model's positions (None: no limit), which no verification runs past."""
        forecast = ledger.forecast(self.running)
        plan = StepPlan()
        active = list(self.running)
        decodes = self._fit_decodes(active, forecast, plan)
        plan.chunks.extend((request, 1) for request in decodes)
        budget = self.max_batch_tokens - len(decodes)
        free = forecast.free_pages()
        spent = sum(forecast.pages_for(request, 1) for request in decodes)
        if not plan.preempted:
            for request in self.swapped:
                need = forecast.swap_in_pages(request) + forecast.pages_for(request, 1)
                if len(active) >= self.max_running:
                    break
                if spent + need > free:
                    forecast.reclaim(spent + need - free)
                    free = forecast.free_pages()
                    if spent + need > free:
                        break
                plan.resumed.append(request)
                active.append(request)
                spent += need
        for request in list(active):
            if request.remaining <= 1 or budget <= 0 or request in plan.resumed or request in plan.preempted:
                continue
            tokens = self._chunk(request, min(request.remaining, budget), free - spent, forecast)
            if not tokens and not plan.chunks:  # nothing would run: the cache, then newer requests give pages back
                forecast.reclaim(forecast.pages_for(request, 1))
                while (
                    not self._chunk(request, 1, forecast.free_pages() - spent, forecast)
                    and active[-1] is not request
                    and active[-1] not in plan.resumed
                ):
                    self._preempt(active.pop(), forecast, plan)
                free = forecast.free_pages()
                tokens = self._chunk(request, min(request.remaining, budget), free - spent, forecast)
            if tokens:
                plan.chunks.append((request, tokens))
                budget -= tokens
                spent += forecast.pages_for(request, tokens)
        if not (plan.preempted or self.swapped and not plan.resumed):  # memory is short: admit nothing new
            budget, spent = self._admit(plan, forecast, active=active, budget=budget, free=free, spent=spent)
            if drafts:
                left = forecast.free_pages() - spent
                costs = {"token_cost": token_cost, "segment_cost": segment_cost}
                self._add_drafts(plan, forecast, drafts, decodes, budget=budget, left=left, **costs, context=context)
        plan.reclaimed = list(forecast.reclaimed)
        return plan

    def _admit(self, plan: StepPlan, forecast: Forecast, *, active: list[Request], budget: int, free: int, spent: int) -> tuple[int, int]:
        """Add admissions (and their first chunks) to ``plan`` while the token ``budget`` left and
        the pages allow (``free`` pages, of which the plan's chunks so far take ``spent``); returns
        the token budget left and the pages the plan's chunks take."""
        reserve = self.reserve_pages * len(active)
        for request in self._admission_order(self.waiting, forecast):
            if budget <= 0 or len(active) >= self.max_running:
                break
            if request.waited_steps <= self.fairness_steps and forecast.in_flight(request):
                continue  # its next block is being computed: it will find it cached
            tokens = min(len(request.tokens) - forecast.cached_tokens(request), budget)
            need = forecast.admission_pages(request, tokens)
            want = spent + need + reserve + self.reserve_pages
            if self.admission == "forecast":
                want = max(spent + need, self.forecast_peak(active, request, forecast))
            if want > free:
                forecast.reclaim(want - free)
                free = forecast.free_pages()
                if want > free:
                    break
            forecast.admit(request)  # takes its cached prefix now, so nothing later reclaims it
            free = forecast.free_pages()
            plan.admitted.append(request)
            active.append(request)
            reserve += self.reserve_pages
            tokens = self._chunk(request, min(len(request.tokens) - forecast.computed(request), budget), free - spent, forecast)
            if tokens:
                plan.chunks.append((request, tokens))
                budget -= tokens
                spent += forecast.pages_for(request, tokens)
        return budget, spent

    @staticmethod
    def _add_drafts(
        plan: StepPlan,
        forecast: Forecast,
        drafts: Mapping[Request, Draft],
        decodes: list[Request],
        *,
        budget: int,
        left: int,
        token_cost: float,
        segment_cost: float,
        context: int | None,
    ) -> None:
        """Lengthen planned decodes of ``decodes`` into verifications of their ``drafts``, within
        the token ``budget`` and the ``left`` pages still free after the plan's chunks.

        The cost model: a step costs ``a + c * T`` for ``T`` tokens (``a``: its fixed cost,
        reading the weights and the host work; ``c``: a token's compute, ``token_cost = c / a``)
        and outputs ``R`` tokens (its decodes), so a verified token costs ``token_cost * R / (1 +
        token_cost * T)`` of them, and the verification segment itself (its writes, attention
        call and rollback in every layer; ``segment_cost = its cost / a``) ``segment_cost * R /
        (1 + token_cost * T)``; verifying ``n`` tokens of a draft gains the sum of their
        acceptance chances (:attr:`Draft.chances`). Every verification of the step runs the same
        ``n`` tokens, so that they are one segment of the packed batch (one append and one
        attention call a layer for all of them): the ``n`` of the largest total gain over the
        requests that gain by it, each verifying its draft and then its extension (then its last
        token again: any token is verified exactly), the largest gains first while the budget
        and the pages allow (one they cannot hold decodes without a draft). A request that may
        output fewer tokens than ``n`` runs ``n`` all the same (those past its end gain nothing,
        and the rollback drops them), unless they would pass the model's ``context``: then it
        runs only those it may output (its own, shorter segment). None verifies where no ``n``
        gains more than the segment costs: a batch large enough that a token costs more than it
        may save, or drafts too few or too unlikely to pay for the segment."""
        candidates = [request for request in decodes if request in drafts]
        if not candidates or budget <= 0:
            return
        cost = token_cost * len(decodes) / (1 + token_cost * plan.tokens)
        room = {request: request.max_new_tokens - len(request.output) - 1 for request in candidates}

        def run(request: Request, tokens: int) -> int:
            """Tokens ``request`` runs for a verification of ``tokens`` (its room, where more would pass the context)."""
            return tokens if context is None or request.computed + 1 + tokens <= context else min(tokens, room[request])

        def gain(request: Request, tokens: int) -> float:  # a filler token past the walk or the room: no chance, a token's cost
            return sum(drafts[request].chances[: min(tokens, room[request])]) - run(request, tokens) * cost

        longest = min(budget, max(min(len(drafts[request].chances), room[request]) for request in candidates))
        gains = {tokens: sum(max(gain(request, tokens), 0.0) for request in candidates) for tokens in range(1, longest + 1)}
        length = max(gains, key=lambda tokens: (gains[tokens], -tokens), default=0)
        if not length or gains[length] <= segment_cost * len(decodes) / (1 + token_cost * plan.tokens):
            return
        chunk = {id(request): index for index, (request, _) in enumerate(plan.chunks)}
        for request in sorted((request for request in candidates if gain(request, length) > 0), key=lambda request: -gain(request, length)):
            draft = drafts[request]
            count = run(request, length)
            tokens = (draft.tokens + draft.extension)[:count]
            tokens += tokens[-1:] * (count - len(tokens))
            extra = forecast.pages_for(request, 1 + len(tokens)) - forecast.pages_for(request, 1)
            if not tokens or len(tokens) > budget or extra > left:
                continue
            plan.drafts[request] = tokens
            plan.chunks[chunk[id(request)]] = (request, 1 + len(tokens))
            budget -= len(tokens)
            left -= extra

    def forecast_peak(self, running: Sequence[Request], candidate: Request, forecast: Forecast) -> int:
        """The most pages (per layer) the ``running`` requests and a waiting ``candidate`` will
        take beyond those held now, at any future step (Past-Future), at the
        :attr:`forecast_quantile` of :data:`FORECAST_SAMPLES` futures drawn from :attr:`lengths`.

        In one future each request ``i`` still produces ``d_i`` output tokens
        (:meth:`OutputLengths.sample_remaining
        <kvlib.adapters.engine.output_lengths.OutputLengths.sample_remaining>`, drawn apart for
        every request) and runs its pending prompt tokens with its first one; after ``t`` output
        tokens it has taken ``grow_i(t)`` pages, and once finished it gives back those and the
        pages it held. That future's peak is the largest, over the steps ``t`` at which a request
        finishes, of the growth of those still running less what the finished gave back. The
        quantile is of the batch's peak, not a sum of each request's quantiles (which plans for
        every request running long at once)."""
        requests = [*running, candidate]
        cached = forecast.cached_tokens(candidate)
        generated = np.array([len(request.output) for request in requests], dtype=np.int64)
        limit = np.array([request.max_new_tokens for request in requests], dtype=np.int64)
        ends = self.lengths.sample_remaining(generated, limit, self._draws.random((FORECAST_SAMPLES, len(requests))))
        # growth[s, k, i]: pages request i has taken by the step at which request k ends, future s
        growth = np.stack(
            [forecast.pages_for(request, request.remaining - 1 + ends) for request in running]
            + [forecast.admission_pages(candidate, len(candidate.tokens) - cached - 1 + ends)],
            axis=-1,
        )
        held = np.array([forecast.held_pages(request) for request in running] + [0], dtype=np.int64)
        freed = held + np.diagonal(growth, axis1=1, axis2=2)  # [s, i]: given back when i ends
        still = ends[:, None, :] >= ends[:, :, None]  # [s, k, i]: i runs at k's end
        peaks = np.maximum(np.where(still, growth, -freed[:, None, :]).sum(axis=-1).max(axis=-1), 0)
        return int(np.quantile(peaks, self.forecast_quantile, method="higher"))

    def _fit_decodes(self, active: list[Request], forecast: Forecast, plan: StepPlan) -> list[Request]:
        """The decoding requests of ``active`` whose next token fits, preempting the most recently
        admitted requests (removed from ``active``) until the rest fit."""
        while True:
            decodes = [r for r in active if r.remaining == 1]
            need = sum(forecast.pages_for(r, 1) for r in decodes)
            if need <= forecast.free_pages():
                return decodes
            forecast.reclaim(need - forecast.free_pages())
            if need <= forecast.free_pages():
                return decodes
            self._preempt(active.pop(), forecast, plan)
            if not active:
                return []

    @staticmethod
    def _preempt(victim: Request, forecast: Forecast, plan: StepPlan) -> None:
        """Preempt ``victim`` on the forecast, after the blocks reclaimed so far."""
        plan.reclaimed_before.append(len(forecast.reclaimed))
        forecast.preempt(victim)
        plan.preempted.append(victim)

    @staticmethod
    def _chunk(request: Request, tokens: int, free: int, forecast: Forecast) -> int:
        """The largest chunk of at most ``tokens`` tokens of ``request`` whose pages fit in ``free``."""
        while tokens > 0 and forecast.pages_for(request, tokens) > free:
            tokens = tokens // 2
        return tokens

    def _admission_order(self, waiting: list[Request], forecast: Forecast) -> list[Request]:
        """Overdue requests first (by arrival), then the longest cached prefix first (arrival
        order among equals)."""
        overdue = [r for r in waiting if r.waited_steps > self.fairness_steps]
        rest = [r for r in waiting if r.waited_steps <= self.fairness_steps]
        return overdue + sorted(rest, key=lambda r: -forecast.cached_tokens(r))

    # -- applying --------------------------------------------------------------------------------

    def apply(self, plan: StepPlan, ledger: PageLedger) -> None:
        """Carry ``plan`` out: preemptions (newest first; a dropped request goes first in line) and
        reclaims in the plan's order, then admissions and swap-ins; every request left waiting
        has waited one more step."""
        reclaimed = 0
        for victim, before in zip(plan.preempted, plan.reclaimed_before):
            ledger.reclaim(plan.reclaimed[reclaimed:before])
            reclaimed = before
            self.running.remove(victim)
            victim.preemptions += 1
            if ledger.preempt(victim):
                victim.state = RequestState.SWAPPED
                self.swapped.append(victim)
            else:
                victim.state = RequestState.WAITING
                victim.waited_steps = 0
                self.waiting.insert(0, victim)  # recomputed first: it was admitted before those waiting
        ledger.reclaim(plan.reclaimed[reclaimed:])
        for request in plan.admitted:
            self.waiting.remove(request)
            ledger.admit(request)
            request.state = RequestState.RUNNING
            request.waited_steps = 0
            self.running.append(request)
        for request in plan.resumed:
            self.swapped.remove(request)
            ledger.swap_in(request)
            request.state = RequestState.RUNNING
            self.running.append(request)
        for request in self.waiting:
            request.waited_steps += 1
