"""The scheduler's rules on a stand-in page ledger: decodes first and never stalled, chunks within
the token budget, admission within free pages and the reserve, preemption of the newest,
prefix-aware order with a fairness bound, waiting for a block another request computes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from kvlib.adapters.engine_request import Request, RequestState
from kvlib.adapters.scheduler import Scheduler

PAGE = 4


@dataclass
class Ledger:
    """Pages as plain counts: one KV head, ``PAGE`` tokens per page."""

    free: int
    cached: dict[int, int] = field(default_factory=dict)
    in_flight_ids: set[int] = field(default_factory=set)
    reclaimable: int = 0
    preempted: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)

    def free_pages(self) -> int:
        return self.free

    def pages_for(self, request: Request, tokens: int) -> int:
        return math.ceil((request.computed + tokens) / PAGE) - math.ceil(request.computed / PAGE)

    def cached_tokens(self, request: Request) -> int:
        return self.cached.get(request.request_id, 0)

    def admission_pages(self, request: Request, tokens: int) -> int:
        cached = self.cached_tokens(request)
        return math.ceil((cached + tokens) / PAGE) - cached // PAGE

    def admit(self, request: Request) -> None:
        request.computed = self.cached_tokens(request)
        request.state = RequestState.RUNNING
        self.admitted.append(request.request_id)

    def swap_in_pages(self, request: Request) -> int:
        return math.ceil(request.computed / PAGE)

    def reclaim(self, pages: int) -> None:
        taken = min(pages, self.reclaimable)
        self.reclaimable -= taken
        self.free += taken

    def preempt(self, request: Request) -> None:
        self.free += math.ceil(request.computed / PAGE)
        self.preempted.append(request.request_id)

    def in_flight(self, request: Request) -> bool:
        return request.request_id in self.in_flight_ids


def request(request_id: int, prompt: int, computed: int = 0, output: int = 0, waited: int = 0) -> Request:
    r = Request(request_id, list(range(prompt)), max_new_tokens=8, computed=computed, waited_steps=waited)
    r.output = [0] * output
    return r


def test_decodes_run_first_and_chunks_fill_the_budget() -> None:
    decoding = [request(i, 8, computed=8 + 0, output=1) for i in range(3)]  # one token to run each
    prefilling = request(3, 40, computed=4)
    waiting = [request(4, 30)]
    plan = Scheduler(max_batch_tokens=16).plan([*decoding, prefilling], [], waiting, Ledger(free=100))
    assert plan.chunks[:3] == [(r, 1) for r in decoding]
    assert plan.chunks[3] == (prefilling, 13)
    assert plan.tokens == 16 and not plan.admitted  # the budget is spent before admission


def test_decodes_are_never_stalled_by_the_token_budget() -> None:
    decoding = [request(i, 8, computed=8, output=1) for i in range(5)]
    plan = Scheduler(max_batch_tokens=2).plan(decoding, [], [request(9, 4)], Ledger(free=100))
    assert [n for _, n in plan.chunks] == [1] * 5 and not plan.admitted


def test_admission_keeps_the_decode_reserve() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(3)]  # their next tokens need a page each
    waiting = [request(7, 8)]
    ledger = Ledger(free=3 + 2 + 3)  # 3 decode pages, 2 for the prompt, a reserve of 1 for each of 4 requests: 1 short
    plan = Scheduler(reserve_pages=1).plan(running, [], waiting, ledger)
    assert not plan.admitted
    ledger = Ledger(free=3 + 2 + 4)
    plan = Scheduler(reserve_pages=1).plan(running, [], waiting, ledger)
    assert plan.admitted == waiting and plan.chunks[-1] == (waiting[0], 8)


def test_unused_cache_pages_are_reclaimed_before_anyone_is_preempted() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(2)]
    ledger = Ledger(free=1, reclaimable=1)
    plan = Scheduler().plan(running, [], [], ledger)
    assert not plan.preempted and [n for _, n in plan.chunks] == [1, 1]


def test_short_pages_preempt_the_most_recently_admitted() -> None:
    running = [request(i, 4, computed=4, output=1) for i in range(3)]
    ledger = Ledger(free=2)
    plan = Scheduler().plan(running, [], [request(9, 4)], ledger)
    assert ledger.preempted == [2] and plan.preempted == [running[2]]
    assert [r for r, _ in plan.chunks] == running[:2]
    assert not plan.admitted  # memory is short: nothing new starts


def test_prefills_that_cannot_advance_free_the_newest() -> None:
    first, second = request(0, 40, computed=12), request(1, 40, computed=12)
    ledger = Ledger(free=0)
    plan = Scheduler().plan([first, second], [], [], ledger)
    assert ledger.preempted == [1] and plan.chunks and plan.chunks[0][0] is first


def test_swapped_requests_come_back_before_new_ones() -> None:
    swapped = request(5, 8, computed=8, output=1)
    waiting = [request(6, 4)]
    plan = Scheduler().plan([], [swapped], waiting, Ledger(free=100))
    assert plan.resumed == [swapped] and plan.admitted == waiting


def test_longest_cached_prefix_is_admitted_first_within_the_fairness_bound() -> None:
    waiting = [request(0, 16), request(1, 16), request(2, 16, waited=11)]
    ledger = Ledger(free=100, cached={1: 12})
    plan = Scheduler(max_batch_tokens=4, fairness_steps=10).plan([], [], waiting, ledger)
    assert ledger.admitted == [2]  # overdue: first, whatever its match
    ledger = Ledger(free=100, cached={1: 12})
    plan = Scheduler(max_batch_tokens=4, fairness_steps=20).plan([], [], waiting, ledger)
    assert ledger.admitted == [1] and plan.chunks == [(waiting[1], 4)]


def test_a_request_waits_while_its_next_block_is_being_computed() -> None:
    waiting = [request(0, 16), request(1, 16), request(2, 16, waited=65)]
    ledger = Ledger(free=100, in_flight_ids={0, 2})
    Scheduler(fairness_steps=64).plan([], [], waiting, ledger)
    assert ledger.admitted == [2, 1]  # 0 waits for the block; 2 waited too long to wait more


@pytest.mark.parametrize("name", ["max_batch_tokens", "max_running", "fairness_steps"])
def test_bad_settings_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Scheduler(**{name: 0})
    with pytest.raises(ValueError, match="reserve_pages"):
        Scheduler(reserve_pages=-1)
