"""The policy comparison: every (policy, budget) pair, plus the full cache, on every task.

A budget is a fraction ``f`` of the tokens a task's sequences see; each run gets
``kvlib.make_cache(model, policy, budget=max(1, round(f * tokens)))``, an int token cap per layer
and KV head held at every forward call, so KV bytes stay near ``f`` of the full cache's throughout
(prefill, streaming and decoding alike). The full cache is ``kvlib.make_cache(model)`` (exact).
A policy with no eviction strategy (a codec alone, ``"kivi(bits=4)"``) keeps every token, so it
runs once, with no budget; with one (``"snapkv+kivi(bits=4)"``) it runs at every budget.
Decode speed is measured per configuration on one ``context``-token prompt of the evaluation text:
``speed_steps`` greedy single-token steps after a prefill and two warm-up steps.

The work comes in units (:class:`Unit`): one configuration on one task, or its decode-speed run,
each run by :func:`run_unit` and independent of the others; :func:`compare` runs them in order
here, :mod:`kvlib.eval.ray_compare` as Ray tasks, and both record a configuration's outcomes the
same way (:meth:`Outcome.record`), so both give the same results.

Everything that can be checked is checked before the first run: specs parse, every policy builds a
cache for the model, every task fits the model's context, budgets are in (0, 1]. A strategy that
raises while running is recorded with its error and the comparison goes on. Each configuration
is handed to ``on_run`` as it finishes (the CLI writes its files then), so an interruption loses
only the configuration running.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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


def compare(
    loaded: LoadedModel,
    policies: Sequence[str],
    budgets: Sequence[float],
    tasks: Sequence[Task],
    *,
    context: int,
    speed_steps: int = 32,
    progress: bool = True,
    on_run: Callable[[list[CompareRun]], None] | None = None,
    shared_prefill: bool = True,
) -> list[CompareRun]:
    """Run the full cache and every (policy, budget) on every task, in this process; see the module
    docstring (:func:`kvlib.eval.ray_compare.compare_on_ray` runs the same units on a Ray cluster).
    ``on_run`` is called with the finished runs, in order, each time one more finishes.

    ``shared_prefill`` (the default): the tasks run case by case, each batch's prompt computed
    once for every configuration that can share it (:mod:`kvlib.eval.shared_compare`; the same
    results), then each configuration's speed run, after which ``on_run`` gets the runs finished
    so far (an interruption during the tasks keeps none). False: configuration by configuration, each computing its own
    prompts."""
    check_inputs(loaded, policies, budgets, tasks)
    prompt = speed_prompt(loaded, context, speed_steps)
    configs = configurations(policies, budgets)
    if shared_prefill:
        return _compare_shared(loaded, configs, tasks, prompt, speed_steps, progress, on_run)
    runs = []
    with progress_bar(configs, tasks, progress) as bar:
        for policy, budget in configs:
            run = CompareRun(policy, budget)
            runs.append(run)
            todo = units(policy, budget, tasks)
            for done, unit in enumerate(todo, 1):
                bar.set_postfix_str(unit.label)
                recorded = run_unit(loaded, unit, prompt, speed_steps).record(run)
                bar.update(1 if recorded else len(todo) - done + 1)
                if not recorded:
                    break
            if on_run is not None:
                on_run(runs)
    return runs


def _compare_shared(
    loaded: LoadedModel,
    configs: Sequence[tuple[str, float | None]],
    tasks: Sequence[Task],
    prompt: torch.Tensor,
    speed_steps: int,
    progress: bool,
    on_run: Callable[[list[CompareRun]], None] | None,
) -> list[CompareRun]:
    """:func:`compare` with shared prefills: every task case by case, then each speed run."""
    from kvlib.eval.shared_compare import run_speeds_shared, run_tasks_shared  # they build on this module

    runs = [CompareRun(policy, budget) for policy, budget in configs]
    with progress_bar(configs, tasks, progress) as bar:

        def done(run: CompareRun, count: int) -> None:
            bar.set_postfix_str(run.label)
            bar.update(count)

        run_tasks_shared(loaded, runs, tasks, done=done)
        for index, (run, ran) in enumerate(run_speeds_shared(loaded, runs, prompt, speed_steps)):
            bar.set_postfix_str(Unit(run.policy, run.budget, None).label)
            bar.update(int(ran))
            if on_run is not None:
                on_run(runs[: index + 1])
    return runs
