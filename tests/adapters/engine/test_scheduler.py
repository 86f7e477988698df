"""The scheduler's rules on a stand-in page ledger: decodes first and never stalled, chunks within
the token budget, admission within free pages and the reserve, preemption of the newest,
prefix-aware order with a fairness bound, waiting for a block another request computes; a plan
is a pure decision (computed twice, the same; nothing moves until it is applied), on the
stand-in and on a real Engine."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.adapters.engine.engine_request import Request, RequestState
from kvlib.adapters.engine.scheduler import Scheduler, StepPlan
from kvlib.adapters.engine.suffix_speculator import Draft
from tests.adapters.conftest import build_model

PAGE = 4


@dataclass
class Forecast:
    """The stand-in ledger's counts as a plan would leave them."""

    free: int
    cached: dict[int, int]
    in_flight_ids: set[int]
    reclaimable: int
    computed_after_admission: dict[int, int] = field(default_factory=dict)
    reclaimed: list[str] = field(default_factory=list)

    def free_pages(self) -> int:
        return self.free

    def computed(self, request: Request) -> int:
        return self.computed_after_admission.get(request.request_id, request.computed)

    def pages_for(self, request: Request, tokens):
        computed = self.computed(request)
        return -((computed + tokens) // -PAGE) - math.ceil(computed / PAGE)  # an int, or elementwise

    def cached_tokens(self, request: Request) -> int:
        return self.cached.get(request.request_id, 0)

    def admission_pages(self, request: Request, tokens):
        cached = self.cached_tokens(request)
        return -((cached + tokens) // -PAGE) - cached // PAGE

    def swap_in_pages(self, request: Request) -> int:
        return math.ceil(request.computed / PAGE)

    def reclaim(self, pages: int) -> None:
        taken = min(pages, self.reclaimable)
        self.reclaimable -= taken
        self.free += taken
        self.reclaimed += ["block"] * taken

    def preempt(self, request: Request) -> None:
        self.free += math.ceil(self.computed(request) / PAGE)

    def admit(self, request: Request) -> None:
        self.computed_after_admission[request.request_id] = self.cached_tokens(request)

    def in_flight(self, request: Request) -> bool:
        return request.request_id in self.in_flight_ids

    def held_pages(self, request: Request) -> int:
        return math.ceil(self.computed(request) / PAGE)


@dataclass
class Ledger:
    """Pages as plain counts: one KV head, ``PAGE`` tokens per page, one page per cached block."""

    free: int
    cached: dict[int, int] = field(default_factory=dict)
    in_flight_ids: set[int] = field(default_factory=set)
    reclaimable: int = 0
    preempted: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    swap: bool = False

    def forecast(self, running: list[Request]) -> Forecast:
        return Forecast(self.free, dict(self.cached), set(self.in_flight_ids), self.reclaimable)

    def preempt(self, request: Request) -> bool:
        self.free += math.ceil(request.computed / PAGE)
        self.preempted.append(request.request_id)
        return self.swap

    def reclaim(self, blocks: list[str]) -> None:
        self.reclaimable -= len(blocks)
        self.free += len(blocks)

    def admit(self, request: Request) -> None:
        request.computed = self.cached.get(request.request_id, 0)
        self.admitted.append(request.request_id)

    def swap_in(self, request: Request) -> None:
        self.free -= math.ceil(request.computed / PAGE)


def request(request_id: int, prompt: int, computed: int = 0, output: int = 0, waited: int = 0) -> Request:
    r = Request(request_id, list(range(prompt)), max_new_tokens=8, computed=computed, waited_steps=waited)
    r.output = [0] * output
    return r


def scheduler(running=(), swapped=(), waiting=(), **settings) -> Scheduler:
    return Scheduler(**settings, running=list(running), swapped=list(swapped), waiting=list(waiting))


def step(scheduler: Scheduler, ledger: Ledger) -> StepPlan:
    """Plan one step and apply it."""
    plan = scheduler.plan(ledger)
    scheduler.apply(plan, ledger)
    return plan


def test_decodes_run_first_and_chunks_fill_the_budget() -> None:
    decoding = [request(i, 8, computed=8 + 0, output=1) for i in range(3)]  # one token to run each
    prefilling = request(3, 40, computed=4)
    waiting = [request(4, 30)]
    plan = scheduler([*decoding, prefilling], [], waiting, max_batch_tokens=16).plan(Ledger(free=100))
    assert plan.chunks[:3] == [(r, 1) for r in decoding]
    assert plan.chunks[3] == (prefilling, 13)
    assert plan.tokens == 16 and not plan.admitted  # the budget is spent before admission


def test_decodes_are_never_stalled_by_the_token_budget() -> None:
    decoding = [request(i, 8, computed=8, output=1) for i in range(5)]
    plan = scheduler(decoding, [], [request(9, 4)], max_batch_tokens=2).plan(Ledger(free=100))
    assert [n for _, n in plan.chunks] == [1] * 5 and not plan.admitted


def test_admission_keeps_the_decode_reserve() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(3)]  # their next tokens need a page each
    waiting = [request(7, 8)]
    ledger = Ledger(free=3 + 2 + 3)  # 3 decode pages, 2 for the prompt, a reserve of 1 for each of 4 requests: 1 short
    plan = scheduler(running, [], waiting, reserve_pages=1).plan(ledger)
    assert not plan.admitted
    ledger = Ledger(free=3 + 2 + 4)
    plan = scheduler(running, [], waiting, reserve_pages=1).plan(ledger)
    assert plan.admitted == waiting and plan.chunks[-1] == (waiting[0], 8)


def test_unused_cache_pages_are_reclaimed_before_anyone_is_preempted() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(2)]
    ledger = Ledger(free=1, reclaimable=1)
    plan = scheduler(running).plan(ledger)
    assert not plan.preempted and [n for _, n in plan.chunks] == [1, 1]


def test_short_pages_preempt_the_most_recently_admitted() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(3)]
    ledger = Ledger(free=2)
    plan = step(scheduler(running, [], [request(9, 4)]), ledger)
    assert ledger.preempted == [2] and plan.preempted == [running[2]]
    assert [r for r, _ in plan.chunks] == running[:2]
    assert not plan.admitted  # memory is short: nothing new starts


def test_prefills_that_cannot_advance_free_the_newest() -> None:
    first, second = request(0, 40, computed=12), request(1, 40, computed=12)
    ledger = Ledger(free=0)
    plan = step(scheduler([first, second]), ledger)
    assert ledger.preempted == [1] and plan.chunks and plan.chunks[0][0] is first


def test_swapped_requests_come_back_before_new_ones() -> None:
    swapped = request(5, 8, computed=8, output=1)
    waiting = [request(6, 4)]
    plan = scheduler([], [swapped], waiting).plan(Ledger(free=100))
    assert plan.resumed == [swapped] and plan.admitted == waiting


def test_longest_cached_prefix_is_admitted_first_within_the_fairness_bound() -> None:
    waiting = [request(0, 16), request(1, 16), request(2, 16, waited=11)]
    ledger = Ledger(free=100, cached={1: 12})
    plan = step(scheduler([], [], waiting, max_batch_tokens=4, fairness_steps=10), ledger)
    assert ledger.admitted == [2]  # overdue: first, whatever its match
    waiting = [request(0, 16), request(1, 16), request(2, 16, waited=11)]
    ledger = Ledger(free=100, cached={1: 12})
    plan = step(scheduler([], [], waiting, max_batch_tokens=4, fairness_steps=20), ledger)
    assert ledger.admitted == [1] and plan.chunks == [(waiting[1], 4)]


def test_a_request_waits_while_its_next_block_is_being_computed() -> None:
    waiting = [request(0, 16), request(1, 16), request(2, 16, waited=65)]
    ledger = Ledger(free=100, in_flight_ids={0, 2})
    step(scheduler([], [], waiting, fairness_steps=64), ledger)
    assert ledger.admitted == [2, 1]  # 0 waits for the block; 2 waited too long to wait more


def test_forecast_admission_plans_for_the_worst_case_without_a_history() -> None:
    """A decoding request (7 tokens to go at most: 2 more pages, then it gives back 3) and a
    candidate of 8 prompt tokens (4 pages by its 8th token): the peak is 6 pages, at step 7."""
    for free, admitted in ((5, False), (6, True)):
        running, waiting = [request(0, 4, computed=4, output=1)], [request(1, 8)]
        plan = scheduler(running, [], waiting, admission="forecast").plan(Ledger(free=free))
        assert bool(plan.admitted) == admitted


def test_forecast_admission_admits_more_than_the_reserve_when_outputs_are_short() -> None:
    """Every request seen ended after 2 tokens: the decoding one has 1 to go (1 page, then it gives
    back 2), the candidate 2 (3 pages by its 2nd token, when the other has finished): a peak of 3."""
    results = {}
    for admission in ("forecast", "reserve"):
        running, waiting = [request(0, 4, computed=4, output=1)], [request(1, 8)]
        planner = scheduler(running, [], waiting, admission=admission, reserve_pages=1)
        for _ in range(20):
            planner.lengths.record(2)
        results[admission] = bool(planner.plan(Ledger(free=3)).admitted)
    assert results == {"forecast": True, "reserve": False}


def test_forecast_peak_is_a_quantile_of_the_batch_not_every_request_at_its_own() -> None:
    """Six decoding requests and a candidate, a history where 1 in 5 requests runs 40 tokens and
    the rest 2: at the 0.9 quantile the batch's peak plans for some long requests, not for all
    seven running long at once (what summing each request's 0.9-quantile planned for); it grows
    with the quantile (the same seeded draws) and sits between the all-short and all-long peaks."""

    def peak(history: list[int], quantile: float) -> int:
        running = [request(i, 4, computed=4, output=1) for i in range(6)]
        planner = scheduler(running, [], [request(9, 8)], admission="forecast", forecast_quantile=quantile)
        for length in history:
            planner.lengths.record(length)
        for r in running:
            r.max_new_tokens = 64
        return planner.forecast_peak(running, planner.waiting[0], Ledger(free=0).forecast(running))

    skewed = [2] * 8 + [40] * 2
    short, long = peak([2] * 10, 0.9), peak([40] * 10, 0.9)
    assert short <= peak(skewed, 0.5) <= peak(skewed, 0.9) <= peak(skewed, 1.0) < long
    assert short < peak(skewed, 0.9) < long / 2


@pytest.mark.parametrize("option, value", [("admission", "greedy"), ("forecast_quantile", 0), ("forecast_quantile", 2.0)])
def test_bad_admission_options_are_refused(option, value) -> None:
    with pytest.raises(ValueError, match=rf"^{option} must be "):
        Scheduler(**{option: value})


@pytest.mark.parametrize("name", ["max_batch_tokens", "max_running", "fairness_steps"])
def test_bad_settings_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Scheduler(**{name: 0})
    with pytest.raises(ValueError, match="reserve_pages"):
        Scheduler(reserve_pages=-1)


def plan_state(scheduler: Scheduler, ledger: Ledger) -> tuple:
    """What a plan must leave as it found: the queues, every request's fields, the ledger."""
    requests = scheduler.waiting + scheduler.running + scheduler.swapped
    return (
        [list(q) for q in (scheduler.waiting, scheduler.running, scheduler.swapped)],
        [copy.copy(vars(r)) for r in requests],
        copy.deepcopy(ledger),
    )


def test_short_pages_preempt_the_most_recently_admitted_first() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(4)]  # each needs a page to decode
    plan = scheduler(running).plan(Ledger(free=0))
    assert plan.preempted == [running[3], running[2]]  # newest first, until the others' pages fit
    assert plan.chunks == [(running[0], 1), (running[1], 1)]


def test_a_plan_is_a_pure_decision() -> None:
    running = [request(0, 4, computed=4, output=1), request(1, 40, computed=8), request(2, 4, computed=4, output=1)]
    waiting = [request(3, 16), request(4, 9, waited=70)]
    sched = scheduler(running, [request(5, 8, computed=8, output=1)], waiting, max_batch_tokens=24)
    ledger = Ledger(free=0, cached={3: 8}, in_flight_ids={3}, reclaimable=1)
    before = plan_state(sched, ledger)
    first, second = sched.plan(ledger), sched.plan(ledger)
    assert first == second and first.preempted and first.reclaimed  # the same decisions, twice
    assert plan_state(sched, ledger) == before  # nothing moved, nothing freed
    sched.apply(first, ledger)
    assert ledger.preempted == [r.request_id for r in first.preempted] and ledger.reclaimable == 0


@settings(max_examples=60, deadline=None)
@given(
    decoding=st.lists(st.integers(1, 30), max_size=5),
    prefilling=st.lists(st.tuples(st.integers(2, 60), st.integers(0, 40)), max_size=3),
    waiting=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), max_size=4),
    free=st.integers(0, 30),
    reclaimable=st.integers(0, 6),
    max_batch_tokens=st.integers(1, 48),
    reserve_pages=st.integers(0, 2),
)
def test_a_plan_fits_the_token_budget_and_the_pages_it_frees(
    decoding, prefilling, waiting, free, reclaimable, max_batch_tokens, reserve_pages
) -> None:
    running = [request(i, length, computed=length, output=1) for i, length in enumerate(decoding)]
    running += [request(10 + i, length, computed=min(done, length - 2)) for i, (length, done) in enumerate(prefilling)]
    queued = [request(20 + i, length, waited=waited) for i, (length, waited) in enumerate(waiting)]
    ledger = Ledger(free=free, reclaimable=reclaimable)
    sched = scheduler(running, [], queued, max_batch_tokens=max_batch_tokens, reserve_pages=reserve_pages)
    plan = sched.plan(ledger)
    decodes = [r for r, n in plan.chunks if n == 1 and r.remaining == 1]
    assert plan.tokens <= max(max_batch_tokens, len(decodes))  # decodes alone may exceed the budget
    assert len(plan.reclaimed) <= reclaimable
    assert not set(plan.preempted) & {r for r, _ in plan.chunks}
    assert not plan.preempted or not plan.admitted  # memory is short: nothing new starts
    step_pages = sum(math.ceil((r.computed + n) / PAGE) - math.ceil(r.computed / PAGE) for r, n in plan.chunks if r not in plan.admitted)
    sched.apply(plan, ledger)
    step_pages += sum(math.ceil((r.computed + n) / PAGE) - math.ceil(r.computed / PAGE) for r, n in plan.chunks if r in plan.admitted)
    assert step_pages <= ledger.free  # the chunks' pages are free once the plan is applied


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preemption=st.sampled_from(["swap", "recompute"]), steps=st.integers(1, 12))
def test_an_engine_plan_changes_nothing_until_applied(preemption, steps) -> None:
    model = build_model("llama")
    generator = torch.Generator().manual_seed(steps)
    system = torch.randint(3, 97, (20,), generator=generator).tolist()
    page_bytes = 2 * 4 * 2 * 8 * 4  # layers x page_size x (keys + values) x head_dim x float32
    engine = kvlib.Engine(
        model, max_batch_tokens=12, page_size=4, page_budget_bytes=40 * page_bytes, preemption=preemption, reserve_pages=0
    )
    for extra in range(5):
        engine.add_request(system + torch.randint(3, 97, (3 + 4 * extra,), generator=generator).tolist(), max_new_tokens=6)
    for _ in range(steps):
        engine.step()

    def state() -> tuple:
        index = engine.kv.prefix.index
        return (
            [[r.request_id for r in q] for q in (engine.scheduler.waiting, engine.scheduler.running, engine.scheduler.swapped)],
            [(r.seq, r.computed, r.state, r.waited_steps, r.indexed_blocks, list(r.entries)) for r in engine.requests.values()],
            [pool.refcount.clone() for pool in engine.kv.store.pools],
            list(index.lru),
            (index.hits, index.misses, index.evictions, index.nbytes),
        )

    def same(a: tuple, b: tuple) -> bool:
        return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2], b[2])) and a[3:] == b[3:]

    before = state()
    first, second = engine.scheduler.plan(engine.kv), engine.scheduler.plan(engine.kv)
    assert first == second and same(state(), before)
    engine.scheduler.apply(first, engine.kv)
    assert sum(engine.kv.pages_for(r.computed, n) for r, n in first.chunks) <= engine.kv.free_pages()  # the chunks fit
    assert all(r.state is RequestState.RUNNING for r, _ in first.chunks)


def test_verifications_run_the_length_the_cost_model_gains_most_by() -> None:
    """A verified token costs ``token_cost * R / (1 + token_cost * T)`` output tokens (here 0.5) and
    gains its chance of acceptance: every verification runs the one length of the largest total
    gain (a draft continued by its extension, then by its last token), for the requests that gain
    by it, the largest gains first while the token budget allows; a request with fewer outputs left
    runs them all the same, or only those where more would pass the model's context; where no
    token's chance beats its cost (a larger batch), or the gain does not pay for the verification
    segment itself, none verifies."""
    decoding = [request(i, 5, computed=5 + 1, output=2) for i in range(4)]  # each has its last output token to run
    decoding[3].max_new_tokens = 4  # one output after the verification's own: a draft of 1 at most
    drafts = {
        decoding[0]: Draft([7, 8], 1.8, [9, 10, 11], [0.9, 0.9, 0.6, 0.6, 0.2]),
        decoding[1]: Draft([1, 2, 3, 4], 4.0, [], [1.0, 1.0, 1.0, 1.0]),
        decoding[2]: Draft([5], 0.55, [], [0.55]),  # gains 0.05 alone, loses with filler after it
        decoding[3]: Draft([6, 6, 6], 1.0, [], [1.0]),
    }
    plan = scheduler(decoding).plan(Ledger(free=100), drafts, token_cost=0.25)  # cost 0.25 * 4 / (1 + 0.25 * 4)
    assert plan.drafts == {decoding[1]: [1, 2, 3, 4], decoding[0]: [7, 8, 9, 10]}  # gains 2.0, 1.0
    assert list(plan.drafts) == [decoding[1], decoding[0]]  # the last would run 4 for one output: a loss
    assert dict(plan.chunks) == {decoding[2]: 1, decoding[3]: 1} | {request: 1 + len(tokens) for request, tokens in plan.drafts.items()}
    near_context = scheduler(decoding).plan(Ledger(free=100), drafts, token_cost=0.25, context=9)  # 6 + 1 + 4 > 9
    assert near_context.drafts == plan.drafts | {decoding[3]: [6]}  # it may run only its one output, for a gain of 0.5
    tight = scheduler(decoding, max_batch_tokens=4 + 8).plan(Ledger(free=100), drafts, token_cost=0.25)
    assert list(tight.drafts) == [decoding[1], decoding[0]]  # the budget is spent: the third decodes plainly
    unsure = {request: draft._replace(chances=[0.6] * len(draft.chances)) for request, draft in drafts.items()}
    assert not scheduler(decoding).plan(Ledger(free=100), unsure, token_cost=10.0).drafts  # cost 40 / 41 > 0.6
    assert scheduler(decoding).plan(Ledger(free=100), unsure, token_cost=0.01).drafts
    assert not scheduler(decoding).plan(Ledger(free=100)).drafts  # no speculation: plain decodes
    # the segment itself costs 0.8 * 4 / (1 + 0.25 * 4) = 1.6 tokens: a gain of 3.0 pays for it
    assert scheduler(decoding).plan(Ledger(free=100), drafts, token_cost=0.25, segment_cost=0.8).drafts == plan.drafts
    alone = scheduler(decoding[2:3])  # one row: a token costs 0.25 / 1.25 = 0.2, the segment 0.8 / 1.25 = 0.64
    assert alone.plan(Ledger(free=100), drafts, token_cost=0.25).drafts == {decoding[2]: [5]}  # gains 0.55 - 0.2
    assert not alone.plan(Ledger(free=100), drafts, token_cost=0.25, segment_cost=0.8).drafts  # 0.35 < 0.64
