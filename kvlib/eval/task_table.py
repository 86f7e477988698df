"""The built-in tasks by name, and the task list of ``kvlib compare --tasks``."""

from __future__ import annotations

from kvlib.errors import quoted
from kvlib.eval.agreement import AgreementTask
from kvlib.eval.jsonl import JsonlTask
from kvlib.eval.kvpress_task import KvpressTask
from kvlib.eval.needle import NeedleTask
from kvlib.eval.perplexity import PerplexityTask
from kvlib.eval.ruler import RULER_TASKS
from kvlib.eval.task import Task

BASE_TASKS = ("needle", "perplexity", "agreement")
RULER_NAMES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
"""The RULER-style tasks (:mod:`kvlib.eval.ruler`)."""
TASK_NAMES = BASE_TASKS + RULER_NAMES
"""Built-in task names; ``jsonl:PATH`` adds a LongBench/RULER-style file, ``kvpress:PATH`` a dataset
in kvpress's evaluation format (:mod:`kvlib.eval.kvpress_task`)."""


def parse_tasks(text: str, *, context: int, samples: int | None = None, seed: int = 0, context_first: bool = False) -> list[Task]:
    """Tasks from a comma-separated list such as ``"needle,niah_single,jsonl:data/qa.jsonl"``.

    ``context`` is the sequence length the tasks use (needle context, perplexity window, agreement
    prompt plus continuation, RULER prompt plus answer); ``samples`` overrides each task's default
    sample count. ``context_first``: kvpress's protocol, each case's context read into the cache
    before its question (:attr:`~kvlib.eval.ruler.task.RulerTask.context_first`); only tasks that
    ask a question apart from their context take it.
    """
    builders = {"needle": NeedleTask, "perplexity": PerplexityTask, "agreement": AgreementTask, **RULER_TASKS}
    extra = {} if samples is None else {"samples": samples}
    tasks: list[Task] = []
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no tasks given; choose from {', '.join(TASK_NAMES)}, jsonl:PATH or kvpress:PATH")
    if context_first:
        apart = [name for name, make in RULER_TASKS.items() if make().asks_apart]
        others = [name for name in names if name not in apart]
        if others:
            raise ValueError(
                f"context_first needs tasks that ask a question apart from their context ({', '.join(apart)}), got {', '.join(others)}"
            )
        extra["context_first"] = True
    for name in names:
        if name.startswith("jsonl:"):
            tasks.append(JsonlTask(path=name.removeprefix("jsonl:"), context=context, **extra))
        elif name.startswith("kvpress:"):
            tasks.append(KvpressTask(path=name.removeprefix("kvpress:"), context=context, **extra))
        elif name in builders:
            tasks.append(builders[name](context=context, seed=seed, **extra))
        else:
            raise ValueError(f"unknown task {quoted(name)}; choose from {', '.join(TASK_NAMES)}, jsonl:PATH or kvpress:PATH")
    return tasks
