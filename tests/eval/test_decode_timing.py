"""The timing harness's logic, with timers that report fixed seconds (nothing here depends on how
fast the machine is): the warm-up comes first and is kept apart, rounds interleave every timer in
order, ratios pair each round with the reference's same round, spreads are median and range, and a
failing timer stops alone."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib.eval.decode_timing import Decoded, Spread, Timing, measure, schedule


class Scripted:
    """A timer whose calls report the given decode seconds in turn (or raise the given exception),
    logging each call as ``(name, call number)`` in ``log``."""

    def __init__(self, name: str, seconds: list[float | BaseException], log: list, tokens: int = 10) -> None:
        self.name, self.seconds, self.log, self.tokens = name, list(seconds), log, tokens

    def __call__(self) -> Decoded:
        number = sum(1 for name, _ in self.log if name == self.name)
        self.log.append((self.name, number))
        value = self.seconds[number]
        if isinstance(value, BaseException):
            raise value
        return Decoded(self.tokens, value, detail=number)


def test_the_schedule_is_a_warm_up_round_then_every_round_in_timer_order():
    assert schedule(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert schedule(1, 1) == [(0, 0), (1, 0)] and schedule(0, 3) == []


def test_timers_are_called_interleaved_with_the_warm_up_kept_apart():
    log: list = []
    full = Scripted("full", [9.0, 1.0, 2.0, 1.0], log)
    policy = Scripted("policy", [30.0, 2.0, 2.0, 4.0], log)
    rounds, calls = [], []
    timings = measure([full, policy], 3, on_call=lambda r, i: calls.append((r, i)), on_round=lambda r, t: rounds.append(r))
    assert log == [("full", 0), ("policy", 0), ("full", 1), ("policy", 1), ("full", 2), ("policy", 2), ("full", 3), ("policy", 3)]
    assert calls == schedule(2, 3) and rounds == [0, 1, 2, 3]
    own = timings[1]
    assert own.warmup.seconds == 30.0 and [run.detail for run in own.runs] == [1, 2, 3]  # the warm-up is in no round
    assert own.tokens_per_s == [5.0, 5.0, 2.5] and own.speed == Spread(5.0, 2.5, 5.0)
    # each round against the reference's same round: 5/10, 5/5, 2.5/10; not the ratio of the medians (5 / 10)
    assert own.vs(timings[0]) == [0.5, 1.0, 0.25] and Spread.of(own.vs(timings[0])) == Spread(0.5, 0.25, 1.0)
    assert timings[0].vs(timings[0]) == [1.0, 1.0, 1.0]
    assert len(own.walls) == 3 and own.warmup_wall_s is not None and own.seconds == pytest.approx(own.warmup_wall_s + sum(own.walls))


def test_the_first_call_s_extra_is_the_warm_up_wall_over_the_median_timed_wall():
    timing = Timing(warmup=Decoded(1, 4.0), warmup_wall_s=5.0, runs=[Decoded(1, 1.0)] * 3, walls=[1.0, 3.0, 2.0])
    assert timing.first_call_s == 3.0 and timing.seconds == 11.0
    assert Timing(warmup=Decoded(1, 1.0), warmup_wall_s=1.0).first_call_s is None  # no timed round yet
    assert Timing().speed is None and Timing().first_call_s is None


def test_a_timer_that_raises_stops_alone_and_keeps_its_rounds():
    log: list = []
    full = Scripted("full", [1.0, 1.0, 1.0, 1.0], log)
    failing = Scripted("failing", [1.0, 2.0, ValueError("bad\nsecond line"), 2.0], log)
    other = Scripted("other", [1.0, 1.0, 1.0, 1.0], log)
    timings = measure([full, failing, other], 3)
    assert timings[1].error == "ValueError: bad" and [run.detail for run in timings[1].runs] == [1]
    assert [name for name, _ in log].count("failing") == 3  # warm-up, round 1, round 2 (raised); never again
    assert len(timings[0].runs) == len(timings[2].runs) == 3 and timings[2].error is None
    assert timings[1].vs(timings[0]) == [0.5]  # only the round both ran
    assert timings[0].vs(timings[1]) == [2.0]


def test_a_failed_warm_up_leaves_no_rounds_and_errors_outside_the_list_propagate():
    log: list = []
    timings = measure([Scripted("full", [1.0, 1.0], log), Scripted("broken", [RuntimeError("no")], log)], 1)
    assert timings[1].error == "RuntimeError: no" and timings[1].runs == [] and timings[1].speed is None
    with pytest.raises(RuntimeError, match="no"):
        measure([Scripted("broken", [RuntimeError("no")], [])], 1, errors=())
    with pytest.raises(KeyboardInterrupt):
        measure([Scripted("stopped", [1.0, KeyboardInterrupt()], [])], 2)


def test_rounds_below_one_are_refused_before_any_call():
    log: list = []
    with pytest.raises(ValueError, match="at least 1 timed round, got 0"):
        measure([Scripted("full", [1.0], log)], 0)
    assert log == []


@given(st.lists(st.floats(min_value=1e-6, max_value=1e6), min_size=1, max_size=20), st.randoms())
def test_a_spread_holds_its_median_within_its_range_in_any_order(values, random):
    spread = Spread.of(values)
    assert spread.low <= spread.median <= spread.high
    assert (spread.low, spread.high) == (min(values), max(values))
    shuffled = list(values)
    random.shuffle(shuffled)
    assert Spread.of(shuffled) == spread
    assert spread.overlaps(spread) and spread.overlaps(Spread.of([spread.high, spread.high * 2]))
    assert not spread.overlaps(Spread.of([spread.high * 2 + 1, spread.high * 3 + 1]))


def test_a_spread_needs_a_value():
    with pytest.raises(ValueError, match="at least one value"):
        Spread.of([])
    assert Spread.of([3.0, 1.0, 2.0, 10.0]) == Spread(2.5, 1.0, 10.0)  # an even count: the mean of the middle two
