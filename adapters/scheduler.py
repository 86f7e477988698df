"""What the engine runs each step: decodes first, then prefill chunks, then admissions, within a
token budget and the free pages (Sarathi-Serve's stall-free batching over vLLM-style paging).

One :meth:`Scheduler.plan` call decides a step:

1. every running request that decodes (one token to run) gets its token; if the pages for
   those tokens are short, unused prefix-cache pages are reclaimed, then the most recently
   admitted requests are preempted (swapped out or dropped for recompute) until they fit;
2. swapped requests come back, oldest first, while their pages fit;
3. running requests still prefilling get chunks from the remaining token budget, oldest first;
4. waiting requests are admitted while the budget and the pages allow, in prefix-aware order:
   requests whose prompt has the longest cached prefix first, a request whose next uncached
   block another request is computing right now waits for it (so a shared prefix is computed
   once), and a request that waited more than ``fairness_steps`` steps goes first, by arrival.
   Admission keeps ``reserve_pages`` free per running request for its coming decode tokens.

The scheduler decides; the engine (through :class:`PageLedger`) counts and frees pages.
Invariant: a plan never needs more pages than are free when it is made, and never more than
``max_batch_tokens`` tokens (decodes alone may exceed it: they are never stalled).

Progress: with a page budget that fits every request alone, every step either runs tokens or
frees pages (reclaiming cached pages, preempting the newest requests, down to the oldest alone)
or swaps a request back in to run next, so the engine finishes. This rests on the ledger's side:
a running request holds no pages but those its own sequence reads (the prefix index pins no
second copy of a block for it, :meth:`~kvlib.PrefixStore.insert`), and everything else is either
held by the other running requests or reclaimable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvlib.adapters.engine_request import Request


class PageLedger(Protocol):
    """The engine's side of scheduling: page counts and the actions that free pages."""

    def free_pages(self) -> int:
        """Pages free in the layer with the fewest free pages."""

    def pages_for(self, request: Request, tokens: int) -> int:
        """Pages (per layer, at most) that running ``tokens`` more tokens of ``request`` allocates."""

    def cached_tokens(self, request: Request) -> int:
        """Leading tokens of a waiting request that the prefix cache holds now (whole pages,
        never its last token)."""

    def admission_pages(self, request: Request, tokens: int) -> int:
        """Pages a waiting request's first chunk of ``tokens`` computed tokens allocates after its
        cached prefix."""

    def admit(self, request: Request) -> None:
        """Start ``request``: a sequence holding its longest cached prefix (whatever the cache
        holds now, which may differ from :meth:`cached_tokens` after a reclaim)."""

    def swap_in_pages(self, request: Request) -> int:
        """Pages a swapped request needs to come back."""

    def reclaim(self, pages: int) -> None:
        """Free up to ``pages`` pages held only by the prefix cache (least recently used first)."""

    def preempt(self, request: Request) -> None:
        """Take ``request``'s pages back (swap or drop, by configuration)."""

    def in_flight(self, request: Request) -> bool:
        """Whether ``request``'s next uncached prompt block is being computed by a running request."""


@dataclass
class StepPlan:
    """One step: ``chunks`` lists (request, tokens to run) with the decodes first; ``admitted``
    and ``resumed`` name the requests that start or come back (their chunks are in ``chunks``);
    ``preempted`` the requests that lost their pages. Admitted requests already hold their
    sequence (the plan admits them); resumed ones are swapped in by the engine."""

    chunks: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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
    """

    max_batch_tokens: int = 256
    max_running: int = 64
    reserve_pages: int = 1
    fairness_steps: int = 64

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_running", "fairness_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.reserve_pages, bool) or not isinstance(self.reserve_pages, int) or self.reserve_pages < 0:
            raise ValueError(f"reserve_pages must be an int >= 0, got {self.reserve_pages!r}")

    def plan(self, running: list[Request], swapped: list[Request], waiting: list[Request], ledger: PageLedger) -> StepPlan:
        """Decide the next step (``running``, ``swapped`` and ``waiting`` are oldest first and are
        not modified: the engine applies the plan)."""
        plan = StepPlan()
        active = list(running)
        decodes = self._fit_decodes(active, ledger, plan)
        plan.chunks.extend((request, 1) for request in decodes)
        budget = self.max_batch_tokens - len(decodes)
        free = ledger.free_pages()
        spent = sum(ledger.pages_for(request, 1) for request in decodes)
        if not plan.preempted:
            for request in swapped:
                need = ledger.swap_in_pages(request) + ledger.pages_for(request, 1)
                if len(active) >= self.max_running:
                    break
                if spent + need > free:
                    ledger.reclaim(spent + need - free)
                    free = ledger.free_pages()
                    if spent + need > free:
                        break
                plan.resumed.append(request)
                active.append(request)
                spent += need
        for request in list(active):
            if request.remaining <= 1 or budget <= 0 or request in plan.resumed or request in plan.preempted:
                continue
            tokens = self._chunk(request, min(request.remaining, budget), free - spent, ledger)
            if not tokens and not plan.chunks:  # nothing would run: the cache, then newer requests give pages back
                ledger.reclaim(ledger.pages_for(request, 1))
                while not self._chunk(request, 1, ledger.free_pages() - spent, ledger) and active[-1] is not request and active[-1] not in plan.resumed:
                    victim = active.pop()
                    ledger.preempt(victim)
                    plan.preempted.append(victim)
                free = ledger.free_pages()
                tokens = self._chunk(request, min(request.remaining, budget), free - spent, ledger)
            if tokens:
                plan.chunks.append((request, tokens))
                budget -= tokens
                spent += ledger.pages_for(request, tokens)
        if plan.preempted or swapped and not plan.resumed:
            return plan  # memory is short: admit nothing new
        reserve = self.reserve_pages * len(active)
        for request in self._admission_order(waiting, ledger):
            if budget <= 0 or len(active) >= self.max_running:
                break
            if request.waited_steps <= self.fairness_steps and ledger.in_flight(request):
                continue  # its next block is being computed: it will find it cached
            tokens = min(len(request.tokens) - ledger.cached_tokens(request), budget)
            need = ledger.admission_pages(request, tokens)
            if spent + need + reserve + self.reserve_pages > free:
                ledger.reclaim(spent + need + reserve + self.reserve_pages - free)
                free = ledger.free_pages()
                if spent + need + reserve + self.reserve_pages > free:
                    break
            ledger.admit(request)  # takes its cached prefix now, so nothing later reclaims it
            free = ledger.free_pages()
            plan.admitted.append(request)
            active.append(request)
            reserve += self.reserve_pages
            tokens = self._chunk(request, min(request.remaining, budget), free - spent, ledger)
            if tokens:
                plan.chunks.append((request, tokens))
                budget -= tokens
                spent += ledger.pages_for(request, tokens)
        return plan

    def _fit_decodes(self, active: list[Request], ledger: PageLedger, plan: StepPlan) -> list[Request]:
        """The decoding requests of ``active`` whose next token fits, preempting the most recently
        admitted requests (removed from ``active``) until the rest fit."""
        while True:
            decodes = [r for r in active if r.remaining == 1]
            need = sum(ledger.pages_for(r, 1) for r in decodes)
            if need <= ledger.free_pages():
                return decodes
            ledger.reclaim(need - ledger.free_pages())
            if need <= ledger.free_pages():
                return decodes
            victim = active.pop()
            ledger.preempt(victim)
            plan.preempted.append(victim)
            if not active:
                return []

    @staticmethod
    def _chunk(request: Request, tokens: int, free: int, ledger: PageLedger) -> int:
        """The largest chunk of at most ``tokens`` tokens of ``request`` whose pages fit in ``free``."""
        while tokens > 0 and ledger.pages_for(request, tokens) > free:
            tokens = tokens // 2
        return tokens

    def _admission_order(self, waiting: list[Request], ledger: PageLedger) -> list[Request]:
        """Overdue requests first (by arrival), then the longest cached prefix first (arrival
        order among equals)."""
        overdue = [r for r in waiting if r.waited_steps > self.fairness_steps]
        rest = [r for r in waiting if r.waited_steps <= self.fairness_steps]
        return overdue + sorted(rest, key=lambda r: -ledger.cached_tokens(r))

