"""The policy comparison: every (policy, budget) pair, plus the full cache, on every task.

A budget is a fraction ``f`` of the tokens a task's sequences see; each run gets
``kvlib.make_cache(model, policy, budget=max(1, round(f * tokens)))``, an int token cap per layer
and KV head held at every forward call, so KV bytes stay near ``f`` of the full cache's throughout
(prefill, streaming and decoding alike). The full cache is ``kvlib.make_cache(model)`` (exact).
A policy with no eviction strategy (a codec alone, ``"kivi(bits=4)"``) keeps every token, so it
runs once, with no budget; with one (``"snapkv+kivi(bits=4)"``) it runs at every budget.
Decode speed is measured per configuration on one ``context``-token prompt of the evaluation text:
``speed_steps`` greedy single-token steps after a prefill and two warm-up steps.

The work comes in units (:class:`~kvlib.eval.compare_units.Unit`, with the configurations and
their caches in :mod:`kvlib.eval.compare_units`): :func:`compare` runs them in order here, or
task case by task case with one prefill shared by every configuration that can take it
(:mod:`kvlib.eval.shared_compare`); :mod:`kvlib.eval.ray_compare` runs them as Ray tasks.

Everything that can be checked is checked before the first run: specs parse, every policy builds a
cache for the model, every task fits the model's context, budgets are in (0, 1]. A strategy that
raises while running is recorded with its error and the comparison goes on. Each configuration
is handed to ``on_run`` as it finishes (the CLI writes its files then), so an interruption loses
only the configuration running.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlib.eval.compare_units import CompareRun, Unit, check_inputs, configurations, progress_bar, run_unit, speed_prompt, units
from kvlib.eval.models import LoadedModel
from kvlib.eval.shared_compare import run_speeds_shared, run_tasks_shared
from kvlib.eval.task import Task


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
