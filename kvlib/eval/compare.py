"""The policy comparison: every (policy, budget) pair, plus the full cache, on every task.

A budget is a fraction ``f`` of the tokens a task's sequences see; each run gets
``kvlib.make_cache(model, policy, budget=max(1, round(f * tokens)))``, an int token cap per layer
and KV head held at every forward call, so KV bytes stay near ``f`` of the full cache's throughout
(prefill, streaming and decoding alike). The full cache is ``kvlib.make_cache(model)`` (exact).
A spec with no eviction policy (a codec alone, ``"kivi(bits=4)"``) keeps every token, so it
runs once, with no budget; with one (``"snapkv+kivi(bits=4)"``) it runs at every budget.
Decode speed is measured on one ``context``-token prompt of the evaluation text: ``speed_steps``
greedy single-token steps after a prefill and two untimed steps, once the tasks are done, for every
configuration together (:mod:`kvlib.eval.compare_speed`): each warmed up first (its kernels
compiled there; what that cost is kept apart as its first-call seconds), then ``speed_rounds``
interleaved rounds with the full cache in each; the table shows the median tokens/s with its
range, and the ratio to the full cache taken round by round.

The tasks come in units (:class:`~kvlib.eval.compare_units.Unit`, with the configurations and
their caches in :mod:`kvlib.eval.compare_units`): :func:`compare` runs them in order here, or
task case by task case with one prefill shared by every configuration that can take it
(:mod:`kvlib.eval.shared_compare`); :mod:`kvlib.eval.ray_compare` runs them, and each
configuration's speed against the full cache, as Ray tasks.

Everything that can be checked is checked before the first run: specs parse, every policy builds a
cache for the model, every task fits the model's context, budgets are in (0, 1]. A policy that
raises while running is recorded with its error and the comparison goes on. The finished runs are
handed to ``on_run`` as configurations finish their tasks and again after each speed round (the
CLI writes its files then), so an interruption loses only the configuration (or round) running.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlib.eval.compare_speed import measure_speeds
from kvlib.eval.compare_units import CompareRun, Unit, check_inputs, configurations, progress_bar, run_unit, speed_run
from kvlib.eval.models import LoadedModel
from kvlib.eval.shared_compare import run_tasks_shared
from kvlib.eval.task import Task


def compare(
    loaded: LoadedModel,
    policies: Sequence[str],
    budgets: Sequence[float],
    tasks: Sequence[Task],
    *,
    context: int,
    speed_steps: int = 32,
    speed_rounds: int = 3,
    progress: bool = True,
    on_run: Callable[[list[CompareRun]], None] | None = None,
    shared_prefill: bool = True,
) -> list[CompareRun]:
    """Run the full cache and every (policy, budget) on every task, then take every configuration's
    decode speed, in this process; see the module docstring (:func:`kvlib.eval.ray_compare.compare_on_ray`
    runs the same units on a Ray cluster). ``on_run`` is called with the runs finished so far, in
    order, each time more finish: after each configuration's tasks, and with every run after each
    speed round.

    ``shared_prefill`` (the default): the tasks run case by case, each batch's prompt computed
    once for every configuration that can share it (:mod:`kvlib.eval.shared_compare`; the same
    results), and so does the speed prompt (an interruption during the tasks keeps none). False:
    configuration by configuration, each computing its own prompts."""
    check_inputs(loaded, policies, budgets, tasks)
    speed = speed_run(loaded, context, speed_steps, speed_rounds)
    configs = configurations(policies, budgets)
    runs = [CompareRun(policy, budget) for policy, budget in configs]
    calls = speed_rounds + 1
    with progress_bar(configs, tasks, calls, progress) as bar:

        def done(run: CompareRun, count: int) -> None:
            bar.set_postfix_str(run.label)
            bar.update(count)

        if shared_prefill:
            run_tasks_shared(loaded, runs, tasks, done=done)
            if on_run is not None:
                on_run(runs)
        else:
            for index, run in enumerate(runs):
                for position, task in enumerate(tasks):
                    done(run, 1 if run_unit(loaded, Unit(run.policy, run.budget, task)).record(run) else len(tasks) - position)
                    if run.error is not None:
                        break
                if on_run is not None:
                    on_run(runs[: index + 1])
        for run in runs:
            if run.error is not None:  # not timed: its speed calls count as done
                done(run, calls)

        def called(round_: int, index: int) -> None:
            bar.set_postfix_str(f"decode speed, {'warm-up' if round_ == 0 else f'round {round_} of {speed_rounds}'}")
            bar.update(1)

        def measured(round_: int) -> None:
            if on_run is not None and round_ > 0:
                on_run(runs)

        measure_speeds(loaded, runs, speed, shared=shared_prefill, on_call=called, on_round=measured)
    return runs
