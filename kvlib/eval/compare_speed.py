"""The comparison's decode speeds: every configuration warmed up, then timed in interleaved rounds.

:func:`measure_speeds` makes one timer per configuration (a speed run,
:func:`~kvlib.eval.compare_units.decode_once`, with a fresh cache each call) and hands them to
:func:`kvlib.eval.decode_timing.measure`, the full cache's first: a warm-up call of every
configuration (its kernels compiled there, the cost kept as its first-call seconds), then
``rounds`` rounds in which every configuration is timed once, the full cache first, so each
round's ratio to the full cache is taken under the same load. After each round every run's
:class:`~kvlib.eval.compare_units.DecodeSpeed` (tokens/s per round, ratios per round, first-call
seconds) and KV bytes are updated, so ``on_round`` can write the rounds done.

A configuration that can take a shared prefill (:func:`~kvlib.eval.shared_compare.sharing`) gets
the speed prompt's prefill computed once, by an exact cache that records what it needs, and
replayed into each of its caches; the others (every one with ``shared`` False) prefill it
themselves. Neither is timed: only the decode steps are. Each run records its path under
:data:`SPEED` in its ``prefill``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import kvlib
from kvlib.adapters.cache.shared_prefill import PrefillNeeds, PrefillRecorder, recording
from kvlib.eval.compare_units import FULL, CompareRun, DecodeSpeed, SpeedRun, cache_factory, decode_once
from kvlib.eval.decode_timing import Timer, Timing, measure
from kvlib.eval.models import LoadedModel
from kvlib.eval.shared_compare import SHARED, replaying, sharing
from kvlib.eval.task import CacheFactory
from kvlib.transformers_compat import cache_argument

SPEED = "decode speed"
"""The key of a run's speed run in :attr:`~kvlib.eval.compare_units.CompareRun.prefill`."""


def measure_speeds(
    loaded: LoadedModel,
    runs: Sequence[CompareRun],
    speed: SpeedRun,
    *,
    shared: bool = True,
    on_call: Callable[[int, int], None] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> list[tuple[CompareRun, Timing]]:
    """Take the decode speed of each of ``runs`` that has no error yet (module docstring) and record
    it in the run, with its KV bytes at the end of its last speed run, or its error. ``runs`` must
    hold the full cache's run (``ValueError`` otherwise, before anything runs): it is timed first
    in every round. ``on_call(round, index)`` follows each call, ``on_round(round)`` each round once
    the runs hold it (round 0: the warm-up, which records no speed). Returns each timed run with its
    :class:`~kvlib.eval.decode_timing.Timing`, in the order timed."""
    full = [run for run in runs if run.policy == FULL]
    if not full:
        raise ValueError(f"decode speed is taken against the full cache: the runs must hold {FULL!r}")
    timed = [full[0]] + [run for run in runs if run.error is None and run is not full[0]]
    timers = _timers(loaded, timed, speed, shared)

    def record(round_: int, timings: list[Timing]) -> None:
        for run, timing in zip(timed, timings):
            if timing.error is not None:
                run.error = timing.error
            last = timing.runs[-1] if timing.runs else timing.warmup
            if last is not None:
                run.kv_bytes, run.full_bytes = last.detail
            run.speed = DecodeSpeed.measured(timing, timings[0])
        if on_round is not None:
            on_round(round_)

    timings = measure(timers, speed.rounds, on_call=on_call, on_round=record)
    return list(zip(timed, timings))


def _timers(loaded: LoadedModel, runs: Sequence[CompareRun], speed: SpeedRun, shared: bool) -> list[Timer]:
    """One timer per run: from the shared prefill where the run can take it (``shared``), else its own."""
    model = loaded.model
    paths = [sharing(model, run) if shared else None for run in runs]
    sharers = [path for path in paths if path is not None and path.refusal is None]
    source = first = recorder = None
    if sharers:
        needs = PrefillNeeds()
        for path in sharers:
            needs = needs | path.needs
        source, recorder = kvlib.make_cache(model), PrefillRecorder(needs)
        with recording(source, recorder), torch.inference_mode():
            logits = model(input_ids=speed.prompt, **cache_argument(source), use_cache=True, logits_to_keep=1).logits
        first = logits[:, -1].argmax(-1, keepdim=True)
    timers = []
    for run, path in zip(runs, paths):
        make = cache_factory(model, run.policy, run.budget)
        if path is not None and path.refusal is None:
            run.prefill[SPEED] = SHARED
            timers.append(_timer(model, replaying(make, source, recorder), speed, first))
        else:
            if path is not None:
                run.prefill[SPEED] = f"separate: {path.refusal}"
            timers.append(_timer(model, make, speed, None))
    return timers


def _timer(model: torch.nn.Module, make: CacheFactory, speed: SpeedRun, first: torch.Tensor | None) -> Timer:
    """A timer of one speed run with caches from ``make`` (``first``: see :func:`decode_once`)."""
    return lambda: decode_once(model, make, speed.prompt, speed.steps, first)
