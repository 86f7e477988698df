"""What every evaluation task returns, how cache memory is measured, and task names for the CLI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvlib.errors import quoted

CacheFactory = Callable[[int], object]
"""Builds a fresh cache for one run, given how many tokens each sequence will have seen by the end
of it (the comparison turns its budget fraction into a token cap of that many tokens); the full
reference ignores the argument: ``lambda tokens: kvlib.make_cache(model)``."""


@dataclass(frozen=True)
class TaskResult:
    """One task's score for one cache configuration.

    ``score`` is the task's headline metric (``metric``; ``higher_is_better`` says its direction);
    ``metrics`` holds the rest (per depth, per sample, ...); ``samples`` is how many cases
    (prompts, windows, examples) the score averages over. ``kv_bytes`` is what the cache held
    at the end of the task (key/value pages plus codec metadata: the compressed KV itself, not the
    read mirror or tables) and ``full_bytes`` what the uncompressed keys and values of every token
    seen would take in the same dtype.
    """

    task: str
    metric: str
    score: float
    higher_is_better: bool
    kv_bytes: int
    full_bytes: int
    metrics: dict = field(default_factory=dict)
    samples: int = 0

    @property
    def kv_fraction(self) -> float:
        """``kv_bytes / full_bytes`` (1.0 when nothing was stored)."""
        return self.kv_bytes / self.full_bytes if self.full_bytes else 1.0


class Task(Protocol):
    """An evaluation task: ``check`` before anything runs, then ``run`` once per cache factory."""

    name: str
    metric: str
    higher_is_better: bool

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        """Raise ``ValueError`` (one line) when the task cannot run on this model and tokenizer."""

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult: ...


def kv_bytes(cache) -> tuple[int, int]:
    """``(kv_bytes, full_bytes)`` of a kvlib cache, as defined by :class:`TaskResult`."""
    report = cache.memory_report()
    held = report["by_component"]["pages"] + report["by_component"]["codec_metadata"]
    return held, report["full_equivalent_bytes"]


def pad_id(tokenizer) -> int:
    """The id ``generate`` pads finished rows with: the tokenizer's pad id, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def check_context(task: str, needed: int, context: int) -> None:
    """Refuse a task whose sequences are longer than the model's context."""
    if needed > context:
        raise ValueError(f"task {task!r} needs {needed} tokens but the model's context is {context}")


BASE_TASKS = ("needle", "perplexity", "agreement")
RULER_NAMES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
"""The RULER-style tasks (:mod:`kvlib.eval.ruler`)."""
TASK_NAMES = BASE_TASKS + RULER_NAMES
"""Built-in task names; ``jsonl:PATH`` adds a LongBench/RULER-style file."""


def parse_tasks(text: str, *, context: int, samples: int | None = None, seed: int = 0) -> list[Task]:
    """Tasks from a comma-separated list such as ``"needle,niah_single,jsonl:data/qa.jsonl"``.

    ``context`` is the sequence length the tasks use (needle context, perplexity window, agreement
    prompt plus continuation, RULER prompt plus answer); ``samples`` overrides each task's default
    sample count.
    """
    from kvlib.eval.agreement import AgreementTask
    from kvlib.eval.jsonl import JsonlTask
    from kvlib.eval.needle import NeedleTask
    from kvlib.eval.perplexity import PerplexityTask
    from kvlib.eval.ruler import RULER_TASKS

    builders = {"needle": NeedleTask, "perplexity": PerplexityTask, "agreement": AgreementTask, **RULER_TASKS}
    extra = {} if samples is None else {"samples": samples}
    tasks: list[Task] = []
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"no tasks given; choose from {', '.join(TASK_NAMES)} or jsonl:PATH")
    for name in names:
        if name.startswith("jsonl:"):
            tasks.append(JsonlTask(path=name.removeprefix("jsonl:"), context=context, **extra))
        elif name in builders:
            tasks.append(builders[name](context=context, seed=seed, **extra))
        else:
            raise ValueError(f"unknown task {quoted(name)}; choose from {', '.join(TASK_NAMES)} or jsonl:PATH")
    return tasks
