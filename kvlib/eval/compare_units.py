"""The comparison's pieces: configurations, the caches they make, and units of work.

A configuration is ``(policy, budget)`` (:func:`configurations`; the full cache is :data:`FULL`);
its results are a :class:`CompareRun`. The work comes in units (:class:`Unit`): one configuration
on one task, or its decode-speed run, each run by :func:`run_unit` and independent of the others;
:func:`kvlib.eval.compare.compare` runs them in order here (or case by case with one prefill
shared, :mod:`kvlib.eval.shared_compare`), :mod:`kvlib.eval.ray_compare` as Ray tasks, and each
records a configuration's outcomes the same way (:meth:`Outcome.record`), so all give the same
results. Everything that can be checked before the first run is checked by :func:`check_inputs`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kvlib
from kvlib.errors import quoted
from kvlib.eval.models import LoadedModel
from kvlib.eval.task import CacheFactory, Task, TaskResult, kv_bytes
from kvlib.eval.texts import text_ids, windows
from kvlib.transformers_compat import cache_argument

FULL = "full"
"""The policy name of the uncompressed reference."""


@dataclass
class CompareRun:
    """One configuration's results: per task, plus decode speed and KV bytes in the speed run."""

    policy: str
    budget: float | None
    results: dict[str, TaskResult] = field(default_factory=dict)
    decode_tokens_per_s: float | None = None
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
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy} @ {self.budget:g}"


def evicts(policy: str) -> bool:
    """Whether ``policy`` drops tokens (has an eviction strategy), so that it takes budgets."""
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
        if not kvlib.parse_spec(policy).strategies():
            raise ValueError(f"policy {quoted(policy)} has no strategy")


def check_inputs(loaded: LoadedModel, policies: Sequence[str], budgets: Sequence[float], tasks: Sequence[Task]) -> None:
    """Raise ``ValueError`` (one line) for anything that would fail later; runs nothing heavy."""
    check_policies_and_budgets(policies, budgets)
    for policy in policies:
        kvlib.make_cache(loaded.model, policy, budget=1 if evicts(policy) else None)
    for task in tasks:
        task.check(loaded.model, loaded.tokenizer, loaded.context)


def decode_speed(
    model: torch.nn.Module, make_cache: CacheFactory, prompt: torch.Tensor, steps: int, first: torch.Tensor | None = None
) -> tuple[float, object]:
    """Greedy decode tokens/s over ``steps`` single-token steps after a prefill and 2 warm-up steps,
    and the cache at the end. ``first``: the prefill's greedy token (int64 ``[batch, 1]``) where
    ``make_cache``'s cache already holds ``prompt`` (a shared prefill), else None (it runs here)."""
    cache = make_cache(prompt.shape[1] + steps + 2)
    with torch.inference_mode():
        token = first
        if token is None:
            token = (
                model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            )
        for step in range(steps + 2):
            if step == 2:
                started = time.perf_counter()
            token = model(input_ids=token, **cache_argument(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        elapsed = time.perf_counter() - started
    return steps * prompt.shape[0] / elapsed, cache


def speed_prompt(loaded: LoadedModel, context: int, speed_steps: int) -> torch.Tensor:
    """The decode-speed run's prompt ``[1, context - speed_steps - 2]`` (BOS, then a window of the
    evaluation text), on the model's device; the same for every configuration and every process."""
    bos = loaded.tokenizer.encode("", bos=True)
    window = windows(text_ids(loaded.tokenizer), context - speed_steps - 2 - len(bos), 1, seed=2)[0]
    return torch.tensor([bos + window], device=next(loaded.model.parameters()).device)


@dataclass(frozen=True)
class Unit:
    """One piece of a comparison's work: configuration ``(policy, budget)`` on ``task``, or, with
    ``task`` None, its decode-speed run. Both the serial loop and the Ray tasks run units through
    :func:`run_unit`; a unit needs nothing from another, so they can run in any order or process."""

    policy: str
    budget: float | None
    task: Task | None

    @property
    def label(self) -> str:
        name = "decode speed" if self.task is None else self.task.name
        return f"{CompareRun(self.policy, self.budget).label}: {name}"


def units(policy: str, budget: float | None, tasks: Sequence[Task]) -> list[Unit]:
    """A configuration's units in the order they run serially: each task, then the speed run."""
    return [Unit(policy, budget, task) for task in tasks] + [Unit(policy, budget, None)]


@dataclass(frozen=True)
class Outcome:
    """What a unit gave: a task's ``result``, or the speed run's tokens/s and KV bytes, or the
    one-line ``error`` of a strategy that raised."""

    result: TaskResult | None = None
    decode_tokens_per_s: float | None = None
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
            run.decode_tokens_per_s, run.kv_bytes, run.full_bytes = self.decode_tokens_per_s, self.kv_bytes, self.full_bytes
        return True


def run_unit(
    loaded: LoadedModel,
    unit: Unit,
    prompt: torch.Tensor,
    speed_steps: int,
    make: CacheFactory | None = None,
    first: torch.Tensor | None = None,
) -> Outcome:
    """Run one unit on ``loaded``; ``prompt`` is :func:`speed_prompt`'s. A strategy that raises
    gives an :class:`Outcome` with its error (one line), not an exception. ``make`` and ``first``:
    a speed run from a shared prefill (see :func:`decode_speed`); by default the unit's own caches."""
    try:
        make = make or cache_factory(loaded.model, unit.policy, unit.budget)
        if unit.task is not None:
            return Outcome(result=unit.task.run(loaded.model, loaded.tokenizer, make))
        tokens_per_s, cache = decode_speed(loaded.model, make, prompt, speed_steps, first)
        held, full = kv_bytes(cache)
        return Outcome(decode_tokens_per_s=tokens_per_s, kv_bytes=held, full_bytes=full)
    except Exception as exc:  # noqa: BLE001 - a failing strategy is reported, the rest still run
        return Outcome(error=f"{type(exc).__name__}: {exc}".splitlines()[0])


def progress_bar(configs: Sequence[tuple[str, float | None]], tasks: Sequence[Task], progress: bool):
    """The comparison's tqdm bar: one step per unit."""
    from tqdm.auto import tqdm

    return tqdm(total=len(configs) * (len(tasks) + 1), desc="kvlib compare", unit="run", disable=not progress)
