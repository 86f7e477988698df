"""The comparison's tasks case by case: each batch's prompt runs once for every configuration.

:func:`run_tasks_shared` runs every task for every configuration, task by task. A task that
shares a prefill (``shares_prefill``, the RULER tasks unless their context is read first) runs the
configurations that can share it (:func:`~kvlib.eval.shared_generation.shares`) together through
its ``run_shared``: each batch's prompt is computed once, with an exact cache, and each
configuration's cache gets that prompt call replayed into it before it decodes
(:mod:`kvlib.adapters.cache.shared_prefill`); the results equal separate runs', token for token.
The other configurations (and every configuration of a task without a shared path) run apart, as
:func:`~kvlib.eval.compare_units.run_unit` runs them. The speed runs share the speed prompt's
prefill the same way (:mod:`kvlib.eval.compare_speed`, through :func:`sharing` and
:func:`replaying`). Each run's :attr:`~kvlib.eval.compare_units.CompareRun.prefill` says, per
task, which path it took: :data:`SHARED`, or ``"separate: <reason>"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlib.adapters.cache.shared_prefill import PrefillNeeds, PrefillRecorder, replay
from kvlib.eval.compare_units import CompareRun, Outcome, Unit, cache_factory, run_unit
from kvlib.eval.models import LoadedModel
from kvlib.eval.shared_generation import Sharing, shares
from kvlib.eval.task import CacheFactory, Task

SHARED = "shared"
"""A run's prefill path on a task where its prompts were computed once for every configuration."""


def sharing(model: torch.nn.Module, run: CompareRun) -> Sharing:
    """Whether ``run``'s configuration can take a shared prefill (a probe cache that cannot be built
    is a refusal: the separate run then reports its error)."""
    try:
        return shares(model, cache_factory(model, run.policy, run.budget))
    except Exception as exc:  # noqa: BLE001 - the separate run records the error
        return Sharing(PrefillNeeds(), f"its cache cannot be built ({type(exc).__name__})")


def run_tasks_shared(
    loaded: LoadedModel,
    runs: Sequence[CompareRun],
    tasks: Sequence[Task],
    *,
    done: Callable[[CompareRun, int], None] = lambda run, units: None,
) -> None:
    """Record every task's result (or the first error) in each of ``runs`` (configurations not yet
    run), task by task; see the module docstring. ``done(run, units)`` is called as units finish:
    ``units`` is 1 for a task, or 1 + the tasks left for a run that failed (it runs none of them)."""
    model = loaded.model
    paths = [sharing(model, run) for run in runs]
    for index, task in enumerate(tasks):
        remaining = len(tasks) - index - 1
        live = [i for i, run in enumerate(runs) if run.error is None]
        task_shares = getattr(task, "shares_prefill", False)
        together = [i for i in live if paths[i].refusal is None] if task_shares else []
        apart = f"{task.name} runs each configuration apart"
        reasons = {i: f"separate: {paths[i].refusal if task_shares else apart}" for i in live}
        if together:
            needs = PrefillNeeds()
            for i in together:
                needs = needs | paths[i].needs
            factories = [cache_factory(model, runs[i].policy, runs[i].budget) for i in together]
            try:
                results = task.run_shared(model, loaded.tokenizer, factories, needs)
            except Exception as exc:  # noqa: BLE001 - the shared prompt call failed: each runs apart
                reason = f"separate: the shared prompt call raised {type(exc).__name__}"
                reasons.update(dict.fromkeys(together, reason))
                together = []
            else:
                for i, result in zip(together, results):
                    runs[i].prefill[task.name] = SHARED
                    outcome = Outcome(error=result) if isinstance(result, str) else Outcome(result=result)
                    done(runs[i], 1 if outcome.record(runs[i]) else 1 + remaining)
        for i in live:
            if i in together:
                continue
            runs[i].prefill[task.name] = reasons[i]
            recorded = run_unit(loaded, Unit(runs[i].policy, runs[i].budget, task)).record(runs[i])
            done(runs[i], 1 if recorded else 1 + remaining)


def replaying(make: CacheFactory, source, recorder: PrefillRecorder) -> CacheFactory:
    """``make``'s caches, each given the prompt call ``source`` ran while ``recorder`` recorded it."""

    def made(tokens: int):
        cache = make(tokens)
        with torch.inference_mode():
            replay(cache, source, recorder)
        return cache

    return made
