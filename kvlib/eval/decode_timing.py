"""Decode speed taken fairly: every configuration warmed up, then timed over interleaved rounds.

:func:`measure` takes one *timer* per configuration (a callable that runs one whole decode of it,
prefill and cache building included, and returns a :class:`Decoded`: tokens decoded and the seconds
its timed decode steps took) and calls them in the order :func:`schedule` gives:

1. **Warm-up** (round 0): every timer once, in order. A configuration's first call compiles the
   kernels it is the first in this process to reach (numba on the CPU, Triton on CUDA) and makes
   its first-call allocations, so none of that falls in a timed round; the warm-up is the same
   call as a timed one, so whatever a timed round reaches the warm-up reached first. What the
   first call cost beyond a warm one is kept apart, :attr:`Timing.first_call_s`: the warm-up
   call's wall seconds (the whole call: compilation can fall in the prefill as well as in the
   steps) minus the median of the timed calls'. A user's first call in a process pays it too; a
   configuration whose kernels an earlier one compiled pays about nothing.
2. **Rounds** 1..``rounds``: every timer once per round, in the given order, so each configuration
   is timed under the load of every round; put the reference (the full cache, ``DynamicCache``)
   first. :meth:`Timing.vs` gives each round's ratio of tokens/s to the reference's in the same
   round, so a change of machine load during the run moves both sides of each ratio.
3. **Figures**: per timer, tokens/s of each round and, with :class:`Spread`, their median and
   range (min, max); the per-round ratios the same way.

A timer that raises one of ``errors`` is recorded with its one-line error and not called again
(its rounds stop there, so ``runs[i]`` is always round ``i + 1``); ratios pair rounds that both
sides ran. Anything else a timer raises (``KeyboardInterrupt`` included) propagates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decoded:
    """One run of a timer: ``tokens`` decoded (rows x timed steps), ``seconds`` the timed decode
    steps took (wall seconds, read after the device has finished them), and ``detail``, what the
    caller keeps of the run (the cache's bytes, the tokens it chose, ...)."""

    tokens: int
    seconds: float
    detail: object = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


Timer = Callable[[], Decoded]
"""Runs one whole decode of a configuration (a fresh cache each call) and returns its timing."""


@dataclass(frozen=True)
class Spread:
    """The median of some measurements and their range: ``low`` <= ``median`` <= ``high``."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The median, min and max of ``values`` (at least one)."""
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values))

    def text(self, number: Callable[[float], str] = "{:.3g}".format) -> str:
        """``median [low, high]``, each figure written by ``number``."""
        return f"{number(self.median)} [{number(self.low)}, {number(self.high)}]"

    def overlaps(self, other: Spread) -> bool:
        """Whether the two ranges share a value."""
        return self.low <= other.high and other.low <= self.high


@dataclass
class Timing:
    """What :func:`measure` found for one timer: its warm-up run and the wall seconds of that call,
    then one run and one call's wall seconds per timed round (round ``i + 1`` at index ``i``), or
    the one-line ``error`` that stopped it (the runs before it are kept)."""

    warmup: Decoded | None = None
    warmup_wall_s: float | None = None
    runs: list[Decoded] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tokens_per_s(self) -> list[float]:
        """Tokens/s of each timed round, in order."""
        return [run.tokens_per_s for run in self.runs]

    @property
    def speed(self) -> Spread | None:
        """Tokens/s over the timed rounds (None before the first)."""
        return Spread.of(self.tokens_per_s) if self.runs else None

    @property
    def first_call_s(self) -> float | None:
        """Seconds the warm-up call took beyond the median timed call (compilation and first-call
        allocations; noise around 0 when it had nothing to compile); None before a timed round."""
        if self.warmup_wall_s is None or not self.walls:
            return None
        return self.warmup_wall_s - statistics.median(self.walls)

    @property
    def seconds(self) -> float:
        """Wall seconds of every call made, the warm-up's included."""
        return (self.warmup_wall_s or 0.0) + sum(self.walls)

    def vs(self, reference: Timing) -> list[float]:
        """Each round's tokens/s over ``reference``'s in the same round, for the rounds both ran."""
        return [own.tokens_per_s / theirs.tokens_per_s for own, theirs in zip(self.runs, reference.runs)]


def schedule(timers: int, rounds: int) -> list[tuple[int, int]]:
    """The calls :func:`measure` makes, in order, as ``(round, timer index)``: round 0 (the warm-up)
    then rounds 1..``rounds``, each calling every timer in index order."""
    return [(round_, index) for round_ in range(rounds + 1) for index in range(timers)]


def measure(
    timers: Sequence[Timer],
    rounds: int,
    *,
    errors: tuple[type[BaseException], ...] = (Exception,),
    on_call: Callable[[int, int], None] | None = None,
    on_round: Callable[[int, list[Timing]], None] | None = None,
) -> list[Timing]:
    """Warm up every timer, then time them over ``rounds`` interleaved rounds (module docstring);
    one :class:`Timing` per timer, in order. ``errors``: what a timer may raise and be recorded
    with (``()``: everything propagates). ``on_call(round, index)`` follows each scheduled call
    (made or skipped after an error), ``on_round(round, timings)`` each finished round (0: the
    warm-up). ``ValueError`` for ``rounds`` < 1, before anything runs."""
    if rounds < 1:
        raise ValueError(f"decode speed needs at least 1 timed round, got {rounds}")
    timings = [Timing() for _ in timers]
    for round_, index in schedule(len(timers), rounds):
        timing = timings[index]
        if timing.error is None:
            started = time.perf_counter()
            try:
                decoded = timers[index]()
            except errors as exc:
                timing.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            else:
                wall = time.perf_counter() - started
                if round_ == 0:
                    timing.warmup, timing.warmup_wall_s = decoded, wall
                else:
                    timing.runs.append(decoded)
                    timing.walls.append(wall)
        if on_call is not None:
            on_call(round_, index)
        if on_round is not None and index == len(timers) - 1:
            on_round(round_, timings)
    return timings
