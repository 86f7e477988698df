"""What every evaluation task returns and how cache memory is measured (the task names and the
CLI's task list are :mod:`kvlib.eval.task_table`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvlib.eval.case_scores import CaseScores
from kvlib.transformers_compat import cache_argument

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
    read mirror or tables) and ``full_bytes`` what the uncompressed keys and values a full cache
    keeps would take in the same dtype (every token seen; a sliding-window layer's last ``window -
    1``, as ``DynamicCache`` keeps them). ``cases``: the per-case scores behind ``score`` (in case
    order, the same cases for every configuration), from which reports draw its interval and the
    paired tests; None for a result recorded before they were kept (reports say "no interval").
    """

    task: str
    metric: str
    score: float
    higher_is_better: bool
    kv_bytes: int
    full_bytes: int
    metrics: dict = field(default_factory=dict)
    samples: int = 0
    cases: CaseScores | None = None

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


def prefill_context(model: torch.nn.Module, cache, context_ids: torch.Tensor, tokenizer, memo: dict | None = None) -> None:
    """Read ``context_ids`` (int64 ``[batch, tokens]``, no padding) into the fresh kvlib ``cache``
    ahead of a question: by its eviction policy's own procedure where it has one
    (:meth:`~kvlib.policy.Eviction.context_prefill`, KVzip's reconstruction), else as a prompt,
    one forward call through the cache. ``memo``: the caller's dict for this context and model,
    kept across the caches it is read into (see :data:`~kvlib.policy.ContextPrefill`)."""
    prefill = None if cache.evictor is None else cache.evictor.policy.context_prefill()
    if prefill is None:
        model(input_ids=context_ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
    else:
        prefill(model, cache, context_ids, tokenizer, {} if memo is None else memo)


def pad_id(tokenizer) -> int:
    """The id ``generate`` pads finished rows with: the tokenizer's pad id, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def check_context(task: str, needed: int, context: int) -> None:
    """Refuse a task whose sequences are longer than the model's context."""
    if needed > context:
        raise ValueError(f"task {task!r} needs {needed} tokens but the model's context is {context}")
