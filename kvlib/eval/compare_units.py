"""The comparison's pieces: configurations, the caches they make, and units of work.

A configuration is ``(policy, budget)`` (:func:`configurations`; the full cache is :data:`FULL`);
its results are a :class:`CompareRun`. The work comes in units (:class:`Unit`): one configuration
on one task, or its decode-speed run, each run by :func:`run_unit` and independent of the others;
:func:`kvlib.eval.compare.compare` runs the task units in order here (or case by case with one
prefill shared, :mod:`kvlib.eval.shared_compare`) and then every configuration's decode speed
together (:mod:`kvlib.eval.compare_speed`), :mod:`kvlib.eval.ray_compare` runs every unit as a Ray
task, and each records a configuration's outcomes the same way (:meth:`Outcome.record`), so all
give the same scores and bytes. Decode speed (:class:`DecodeSpeed`) is always taken by
:func:`kvlib.eval.decode_timing.measure`: each configuration warmed up, then timed over
interleaved rounds with the full cache in each. Everything that can be checked before the first
run is checked by :func:`check_inputs` and :func:`check_speed`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kvlib
from kvlib.devices import synchronize
from kvlib.errors import quoted
from kvlib.eval.decode_timing import Decoded, Spread, Timer, Timing, measure
from kvlib.eval.models import LoadedModel
from kvlib.eval.task import CacheFactory, Task, TaskResult, kv_bytes
from kvlib.eval.texts import text_ids, windows
from kvlib.transformers_compat import cache_argument

FULL = "full"
"""The policy name of the uncompressed reference."""


@dataclass(frozen=True)
class DecodeSpeed:
    """A configuration's decode speed as a comparison records it: tokens/s of each timed round (in
    order), each round's ratio to the full cache's tokens/s in the same round, and the seconds its
    warm-up call took beyond a timed one (:attr:`kvlib.eval.decode_timing.Timing.first_call_s`:
    kernel compilation and first-call allocations). A record made before speeds were warmed up and
    repeated loads as its one figure, with no ratios and ``first_call_s`` None."""

    tokens_per_s: tuple[float, ...]
    vs_full: tuple[float, ...] = ()
    first_call_s: float | None = None

    @classmethod
    def measured(cls, timing: Timing, full: Timing) -> DecodeSpeed | None:
        """The speed of ``timing`` (``full``: the full cache's, from the same measurement), or None
        when it has no timed round."""
        if not timing.runs:
            return None
        return cls(tuple(timing.tokens_per_s), tuple(timing.vs(full)), timing.first_call_s)

    @property
    def spread(self) -> Spread:
        """Tokens/s: the median over the rounds, and their range."""
        return Spread.of(self.tokens_per_s)

    @property
    def ratio(self) -> Spread | None:
        """The per-round ratios to the full cache: their median and range (None without any)."""
        return Spread.of(self.vs_full) if self.vs_full else None

    def to_json(self) -> dict:
        """The rounds, their median and range, the per-round ratios likewise, and the first call."""
        spread, ratio = self.spread, self.ratio
        return {
            "rounds": len(self.tokens_per_s),
            "tokens_per_s": list(self.tokens_per_s),
            "median": spread.median,
            "low": spread.low,
            "high": spread.high,
            "vs_full": list(self.vs_full),
            "vs_full_median": None if ratio is None else ratio.median,
            "vs_full_low": None if ratio is None else ratio.low,
            "vs_full_high": None if ratio is None else ratio.high,
            "first_call_s": self.first_call_s,
        }

    @classmethod
    def from_record(cls, entry: dict) -> DecodeSpeed | None:
        """A run's speed from its JSON entry (:meth:`to_json` under ``"decode_speed"``, or a record's
        single ``"decode_tokens_per_s"`` from before rounds were kept); None when it has none."""
        recorded = entry.get("decode_speed")
        if recorded:
            return cls(tuple(recorded["tokens_per_s"]), tuple(recorded["vs_full"]), recorded["first_call_s"])
        single = entry.get("decode_tokens_per_s")
        return None if single is None else cls((single,))


@dataclass
class CompareRun:
    """One configuration's results: per task, plus decode speed, and KV bytes at the end of a speed run."""

    policy: str
    budget: float | None
    results: dict[str, TaskResult] = field(default_factory=dict)
    speed: DecodeSpeed | None = None
    kv_bytes: int = 0
    full_bytes: int = 0
    error: str | None = None
    prefill: dict[str, str] = field(default_factory=dict)
    """Per task, how its prompts were computed: ``"shared"`` (once for every configuration that
    shares them, :mod:`kvlib.eval.shared_compare`) or ``"separate: <reason>"``; empty for runs
    made before this was recorded."""

    @property
    def kv_fraction(self) -> float | None:
        """KV bytes over the full cache's at the end of the speed run."""
        return self.kv_bytes / self.full_bytes if self.full_bytes else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode tokens/s: the median over the timed rounds (None before any)."""
        return None if self.speed is None else self.speed.spread.median

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy} @ {self.budget:g}"


def evicts(policy: str) -> bool:
    """Whether ``policy`` drops tokens (has an eviction policy), so that it takes budgets."""
    return policy != FULL and kvlib.parse_spec(policy).eviction is not None


def configurations(policies: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, float | None]]:
    """The full cache, then every policy at every budget (once, with no budget, if it does not evict)."""
    return [(FULL, None)] + [(p, b) for p in policies for b in (budgets if evicts(p) else [None])]


def cache_factory(model: torch.nn.Module, policy: str, budget: float | None) -> CacheFactory:
    """Caches for one configuration: a token cap of ``round(budget * tokens)``; exact for full; the
    policy as it is when it takes no budget."""
    if policy == FULL:
        return lambda tokens: kvlib.make_cache(model)
    if budget is None:
        return lambda tokens: kvlib.make_cache(model, policy)
    return lambda tokens: kvlib.make_cache(model, policy, budget=max(1, round(budget * tokens)))


def check_policies_and_budgets(policies: Sequence[str], budgets: Sequence[float]) -> None:
    """Raise ``ValueError`` (one line) for a bad policy list or budget; needs no model."""
    if not policies:
        raise ValueError("no policies given")
    if not budgets:
        raise ValueError("no budgets given")
    bad = [b for b in budgets if not 0.0 < b <= 1.0]
    if bad:
        raise ValueError(f"budgets are fractions of the full cache in (0, 1], got {bad}")
    for policy in policies:
        if policy == FULL:
            raise ValueError(f"{FULL!r} is always run as the reference; leave it out of the policies")
        if not kvlib.parse_spec(policy).policies():
            raise ValueError(f"spec {quoted(policy)} names no policy")


def check_inputs(loaded: LoadedModel, policies: Sequence[str], budgets: Sequence[float], tasks: Sequence[Task]) -> None:
    """Raise ``ValueError`` (one line) for anything that would fail later; runs nothing heavy."""
    check_policies_and_budgets(policies, budgets)
    for policy in policies:
        kvlib.make_cache(loaded.model, policy, budget=1 if evicts(policy) else None)
    for task in tasks:
        task.check(loaded.model, loaded.tokenizer, loaded.context)


@dataclass(frozen=True)
class SpeedRun:
    """How a comparison takes decode speed: ``steps`` greedy single-token steps timed after a
    prefill of ``prompt`` (int64 ``[1, tokens]``, :func:`speed_prompt`) and 2 untimed steps, every
    configuration warmed up, then timed over ``rounds`` interleaved rounds with the full cache in
    each (:func:`kvlib.eval.decode_timing.measure`)."""

    prompt: torch.Tensor
    steps: int
    rounds: int


def check_speed(context: int, steps: int, rounds: int) -> None:
    """Raise ``ValueError`` (one line) unless ``steps`` fits a ``context``-token speed run (1 to
    half of it) and ``rounds`` >= 1; needs no model."""
    if not 1 <= steps <= context // 2:
        raise ValueError(f"speed steps must be in [1, {context // 2}] (half of the {context}-token context), got {steps}")
    if rounds < 1:
        raise ValueError(f"speed rounds must be >= 1, got {rounds}")


def speed_run(loaded: LoadedModel, context: int, steps: int, rounds: int) -> SpeedRun:
    """The comparison's :class:`SpeedRun` for ``context`` tokens (checked by :func:`check_speed`)."""
    check_speed(context, steps, rounds)
    return SpeedRun(speed_prompt(loaded, context, steps), steps, rounds)


def decode_once(
    model: torch.nn.Module, make_cache: CacheFactory, prompt: torch.Tensor, steps: int, first: torch.Tensor | None = None
) -> Decoded:
    """One speed run: a fresh cache from ``make_cache``, ``prompt``'s prefill (untimed), 2 untimed
    greedy steps, then ``steps`` timed ones; ``detail`` is the cache's ``(kv_bytes, full_bytes)`` at
    the end. ``first``: the prefill's greedy token (int64 ``[batch, 1]``) where ``make_cache``'s
    cache already holds ``prompt`` (a shared prefill), else None (it runs here)."""
    cache = make_cache(prompt.shape[1] + steps + 2)
    with torch.inference_mode():
        token = first
        if token is None:
            token = (
                model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            )
        for step in range(steps + 2):
            if step == 2:
                synchronize(prompt.device)
                started = time.perf_counter()
            token = model(input_ids=token, **cache_argument(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        synchronize(prompt.device)
        elapsed = time.perf_counter() - started
    return Decoded(steps * prompt.shape[0], elapsed, kv_bytes(cache))


def speed_prompt(loaded: LoadedModel, context: int, speed_steps: int) -> torch.Tensor:
    """The decode-speed run's prompt ``[1, context - speed_steps - 2]`` (BOS, then a window of the
    evaluation text), on the model's device; the same for every configuration and every process."""
    bos = loaded.tokenizer.encode("", bos=True)
    window = windows(text_ids(loaded.tokenizer), context - speed_steps - 2 - len(bos), 1, seed=2)[0]
    return torch.tensor([bos + window], device=next(loaded.model.parameters()).device)


@dataclass(frozen=True)
class Unit:
    """One piece of a comparison's work: configuration ``(policy, budget)`` on ``task``, or, with
    ``task`` None, its decode-speed run (against the full cache's, in the same process). The serial
    loop runs task units through :func:`run_unit` (and every configuration's speed together,
    :mod:`kvlib.eval.compare_speed`), the Ray tasks every unit; a unit needs nothing from another,
    so they can run in any order or process."""

    policy: str
    budget: float | None
    task: Task | None

    @property
    def label(self) -> str:
        name = "decode speed" if self.task is None else self.task.name
        return f"{CompareRun(self.policy, self.budget).label}: {name}"


def units(policy: str, budget: float | None, tasks: Sequence[Task]) -> list[Unit]:
    """A configuration's units: each task, then the speed run."""
    return [Unit(policy, budget, task) for task in tasks] + [Unit(policy, budget, None)]


@dataclass(frozen=True)
class Outcome:
    """What a unit gave: a task's ``result``, or the speed run's speed and KV bytes, or the
    one-line ``error`` of a policy that raised."""

    result: TaskResult | None = None
    speed: DecodeSpeed | None = None
    kv_bytes: int = 0
    full_bytes: int = 0
    error: str | None = None

    def record(self, run: CompareRun) -> bool:
        """Add this outcome to ``run``; False when it is an error (the configuration stops there:
        the units after it are not recorded, as the serial loop does not run them)."""
        if self.error is not None:
            run.error = self.error
            return False
        if self.result is not None:
            run.results[self.result.task] = self.result
        else:
            run.speed, run.kv_bytes, run.full_bytes = self.speed, self.kv_bytes, self.full_bytes
        return True


def run_unit(loaded: LoadedModel, unit: Unit, speed: SpeedRun | None = None) -> Outcome:
    """Run one unit on ``loaded``; a speed unit needs ``speed`` (:func:`speed_run`). A policy that
    raises gives an :class:`Outcome` with its error (one line), not an exception.

    A speed unit is the configuration's decode speed against the full cache's, both warmed up and
    timed in ``speed.rounds`` interleaved rounds in this process (:func:`kvlib.eval.decode_timing.measure`;
    the full cache's own unit times it alone): a unit needs nothing from another, so Ray can run it
    anywhere (:mod:`kvlib.eval.compare_speed` times every configuration together instead)."""
    if unit.task is None and speed is None:
        raise ValueError(f"{unit.label} needs the speed run's prompt, steps and rounds")
    try:
        if unit.task is not None:
            return Outcome(result=unit.task.run(loaded.model, loaded.tokenizer, cache_factory(loaded.model, unit.policy, unit.budget)))
        configs = [(FULL, None)] + ([(unit.policy, unit.budget)] if unit.policy != FULL else [])
        timers = [_speed_timer(loaded.model, cache_factory(loaded.model, *config), speed) for config in configs]
        timings = measure(timers, speed.rounds)
        own = timings[-1]
        if own.error is not None:
            return Outcome(error=own.error)
        held, full = own.runs[-1].detail
        return Outcome(speed=DecodeSpeed.measured(own, timings[0]), kv_bytes=held, full_bytes=full)
    except Exception as exc:  # noqa: BLE001 - a failing policy is reported, the rest still run
        return Outcome(error=f"{type(exc).__name__}: {exc}".splitlines()[0])


def _speed_timer(model: torch.nn.Module, make: CacheFactory, speed: SpeedRun) -> Timer:
    """A timer of one configuration's speed run (its own prefill)."""
    return lambda: decode_once(model, make, speed.prompt, speed.steps)


def progress_bar(configs: Sequence[tuple[str, float | None]], tasks: Sequence[Task], speed_calls: int, progress: bool):
    """The comparison's tqdm bar: one step per task unit and ``speed_calls`` per configuration's
    speed (1 for a Ray speed unit; the warm-up and each round when every configuration is timed
    together)."""
    from tqdm.auto import tqdm

    return tqdm(total=len(configs) * (len(tasks) + speed_calls), desc="kvlib compare", unit="run", disable=not progress)
