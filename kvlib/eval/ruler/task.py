"""What every RULER-style task shares: prompts sized to the context with the tokenizer, batched
greedy generation through a cache factory, and RULER's string-match score.

A task builds, for a haystack size (units: sentences, lines or words) and a random generator, a
:class:`Prompt`: the user's message, the start of the answer (RULER's ``answer_prefix``) and the
expected answers. The prompt the model reads is ``tokenizer.instruct(message, reply_start)``: the
model's chat template for instruct models, else the plain text after BOS (RULER's ``base``
template). Each case's haystack is the largest size whose prompt plus the task's
``tokens_to_generate`` fits ``context`` tokens (RULER's binary search, measured with the model's
tokenizer). Case ``i`` draws from ``random.Random`` seeded with the task's name, ``seed`` and ``i``,
afresh at every size tried: the same settings give the same prompts on any machine.

The model decodes greedily up to ``tokens_to_generate`` tokens (stopping at EOS). A case scores the
fraction of its answers contained in what the model wrote (RULER's ``string_match_all``, after its
clean-up); the task's score is the mean over cases. The result's ``cases`` are pass/fail when every
case has one answer (its score is then 0 or 1), else means.
"""

from __future__ import annotations

import abc
import functools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from kvlib.adapters.cache.shared_prefill import PrefillNeeds
from kvlib.eval.case_scores import case_scores
from kvlib.eval.scoring import ruler_postprocess, string_match_all
from kvlib.eval.shared_generation import generate_shared
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes, pad_id, prefill_context
from kvlib.transformers_compat import cache_argument

PREDICTION_CHARS = 200
"""Most characters of each prediction kept in a result's metrics."""


@dataclass(frozen=True)
class Prompt:
    """A task's prompt text for one haystack size, its answers, and where its items went.

    ``question``: the closing part of ``message`` that asks what the answers answer (empty for
    tasks whose question is not apart from their context); a context-first run reads it after the
    rest of the message.
    """

    message: str
    reply_start: str
    answers: tuple[str, ...]
    depths: tuple[float, ...] = ()
    question: str = ""

    def __post_init__(self) -> None:
        if not self.message.endswith(self.question):
            raise ValueError(f"the question {self.question!r} must close the message")


@dataclass(frozen=True)
class RulerCase:
    """One prompt as token ids (its template included), its answers, haystack size and item depths;
    ``context_tokens`` of the ids come before the question (0: the task has no question apart)."""

    ids: tuple[int, ...]
    answers: tuple[str, ...]
    size: int
    depths: tuple[float, ...]
    context_tokens: int = 0


@dataclass(frozen=True)
class RulerTask(abc.ABC):
    """Base of the RULER-style tasks: ``context`` tokens per case (prompt plus answer), ``samples``
    cases, ``seed``, ``batch_size`` cases per ``generate`` call. Subclasses set ``name``,
    ``tokens_to_generate`` and :meth:`prompt`."""

    context: int = 1024
    samples: int = 10
    seed: int = 0
    batch_size: int = 8
    metric: str = "string_match_all"
    higher_is_better: bool = True

    context_first: bool = False

    name: str = ""
    tokens_to_generate: int = 32
    asks_apart: ClassVar[bool] = False
    """Whether :meth:`prompt` sets a question apart from the context (``context_first`` needs it)."""
    context_memos: dict[tuple[int, tuple[int, ...]], dict] = field(default_factory=dict, init=False, repr=False, compare=False)
    """With ``context_first``: per (model, context ids), the memo its context procedure keeps
    (:data:`~kvlib.policy.ContextPrefill`), so the task's later configurations reuse what an
    earlier one computed from the same case's context alone (KVzip's reconstruction scores,
    float32 ``[kv_heads, context tokens]`` per layer: 1.5 MB a 4k case on SmolLM2). Lives as long
    as the task."""

    def __post_init__(self) -> None:
        if self.samples < 1 or self.batch_size < 1:
            raise ValueError(f"{self.name} samples and batch_size must be >= 1")
        if self.context_first and not self.asks_apart:
            raise ValueError(f"{self.name} has no question apart from its context: context_first needs one (niah_*, vt)")
        if self.context <= self.tokens_to_generate:
            raise ValueError(f"{self.name} context must exceed its {self.tokens_to_generate} answer tokens, got {self.context}")

    @property
    def min_size(self) -> int:
        """The smallest haystack size the task makes sense with."""
        return 1

    @abc.abstractmethod
    def prompt(self, size: int, rng: random.Random, tokenizer) -> Prompt:
        """The prompt with a haystack of ``size`` units, drawn from ``rng``."""

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        check_context(self.name, self.context, context)
        self.cases(tokenizer)

    def cases(self, tokenizer) -> list[RulerCase]:
        """Every case, sized to the context; the same for the same settings and tokenizer."""
        return _cases(self, tokenizer)

    def case(self, index: int, tokenizer) -> RulerCase:
        """Case ``index``: the largest haystack whose prompt and answer fit ``context`` tokens.

        Raises ``ValueError`` when even ``min_size`` does not fit.
        """
        room = self.context - self.tokens_to_generate

        def build(size: int) -> tuple[Prompt, list[int]]:
            prompt = self.prompt(size, self.rng(index), tokenizer)
            return prompt, tokenizer.instruct(prompt.message, prompt.reply_start)

        best = build(self.min_size)
        if len(best[1]) > room:
            raise ValueError(
                f"{self.name}: context {self.context} is too small; the smallest prompt takes {len(best[1])} tokens"
                f" plus {self.tokens_to_generate} for the answer"
            )
        low, high = self.min_size, self.min_size
        while len(build(high * 2)[1]) <= room:  # grow until too long, then bisect
            low, high = high * 2, high * 2
        high *= 2
        while high - low > 1:
            middle = (low + high) // 2
            if len(build(middle)[1]) <= room:
                low = middle
            else:
                high = middle
        prompt, ids = build(low)
        return RulerCase(tuple(ids), prompt.answers, low, prompt.depths, context_tokens(prompt, ids, tokenizer))

    def rng(self, index: int) -> random.Random:
        """Case ``index``'s random generator, fresh: seeded with the task's name, ``seed`` and ``index``."""
        return random.Random(f"{self.name}/{self.seed}/{index}")

    def score(self, prediction: str, answers: tuple[str, ...]) -> float:
        """RULER's ``string_match_all`` on the cleaned prediction."""
        return string_match_all(ruler_postprocess(prediction), answers)

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult:
        cases = self.cases(tokenizer)
        pad = pad_id(tokenizer)
        outcome = _Outcome()
        for chunk, ids, mask in self._batches(cases, tokenizer, model, 1 if self.context_first else self.batch_size):
            width = ids.shape[1]
            cache = make_cache(width)
            with torch.inference_mode():
                if self.context_first:
                    context = chunk[0].ids[: chunk[0].context_tokens]
                    memo = self.context_memos.setdefault((id(model), context), {})
                    prefill_context(model, cache, ids[:, : len(context)], tokenizer, memo)
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    **cache_argument(cache),
                    max_new_tokens=self.tokens_to_generate,
                    do_sample=False,
                    pad_token_id=pad,
                )
            outcome.add(self, tokenizer, chunk, out[:, width:], cache)
        return outcome.result(self, cases)

    @property
    def shares_prefill(self) -> bool:
        """Whether :meth:`run_shared` may run this task's configurations from one prompt call per
        batch: not when the context is read first (its policy's own procedure, KVzip's)."""
        return not self.context_first

    def run_shared(
        self, model: torch.nn.Module, tokenizer, factories: Sequence[CacheFactory], needs: PrefillNeeds
    ) -> list[TaskResult | str]:
        """:meth:`run` for every factory's configuration, each batch's prompt run once
        (:func:`~kvlib.eval.shared_generation.generate_shared`; ``needs``: the configurations'
        union); each result equals :meth:`run`'s. A configuration that raises gets its one-line
        error in its place and is left out of the later batches."""
        if not self.shares_prefill:
            raise ValueError(f"{self.name} reads its context first: its configurations run apart")
        cases = self.cases(tokenizer)
        pad = pad_id(tokenizer)
        outcomes = [_Outcome() for _ in factories]
        for chunk, ids, mask in self._batches(cases, tokenizer, model, self.batch_size):
            live = [i for i, outcome in enumerate(outcomes) if outcome.error is None]
            if not live:
                break
            generations = generate_shared(
                model, ids, mask, [factories[i] for i in live], needs, max_new_tokens=self.tokens_to_generate, pad=pad
            )
            for i, generation in zip(live, generations):
                if generation.error is not None:
                    outcomes[i].error = generation.error
                else:
                    outcomes[i].add(self, tokenizer, chunk, generation.tokens, generation.cache)
        return [outcome.error if outcome.error is not None else outcome.result(self, cases) for outcome in outcomes]

    def _batches(
        self, cases: list[RulerCase], tokenizer, model: torch.nn.Module, step: int
    ) -> Iterator[tuple[list[RulerCase], torch.Tensor, torch.Tensor]]:
        """The cases ``step`` at a time, with their ids left-padded to the longest and its mask (on the model's device)."""
        pad = pad_id(tokenizer)
        device = next(model.parameters()).device
        for start in range(0, len(cases), step):
            chunk = cases[start : start + step]
            width = max(len(c.ids) for c in chunk)
            ids = torch.tensor([[pad] * (width - len(c.ids)) + list(c.ids) for c in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(c.ids)) + [1] * len(c.ids) for c in chunk], device=device)
            yield chunk, ids, mask


@dataclass
class _Outcome:
    """One configuration's scores, predictions and cache bytes over the batches run so far."""

    scores: list[float] = field(default_factory=list)
    predictions: list[str] = field(default_factory=list)
    held: int = 0
    full: int = 0
    error: str | None = None

    def add(self, task: RulerTask, tokenizer, chunk: list[RulerCase], generated: torch.Tensor, cache) -> None:
        """A batch's generated tokens (``[batch, new]``) and its cache at the end."""
        for case, row in zip(chunk, generated.tolist()):
            text = tokenizer.decode(row)
            self.predictions.append(text[:PREDICTION_CHARS])
            self.scores.append(task.score(text, case.answers))
        kv, whole = kv_bytes(cache)
        self.held, self.full = self.held + kv, self.full + whole

    def result(self, task: RulerTask, cases: list[RulerCase]) -> TaskResult:
        metrics = {
            "cases": len(cases),
            "context": task.context,
            "scores": self.scores,
            "predictions": self.predictions,
            "depths": [list(c.depths) for c in cases],
            "prompt_tokens": [len(c.ids) for c in cases],
        }
        kind = "pass_fail" if all(len(c.answers) == 1 for c in cases) else "mean"
        per_case = case_scores(self.scores, kind, [(c.ids, c.answers) for c in cases])
        return TaskResult(task.name, task.metric, float(np.mean(self.scores)), True, self.held, self.full, metrics, len(cases), per_case)


def context_tokens(prompt: Prompt, ids: list[int], tokenizer) -> int:
    """How many leading ``ids`` (``prompt`` put to the model) come before its question: as many as
    they share with the ids of the message without the question (0 when it has none)."""
    if not prompt.question:
        return 0
    shorter = tokenizer.instruct(prompt.message[: len(prompt.message) - len(prompt.question)])
    return len(os.path.commonprefix([ids, shorter]))  # element-wise: works on lists of ids


@functools.lru_cache(maxsize=16)
def _cases(task: RulerTask, tokenizer) -> list[RulerCase]:
    return [task.case(index, tokenizer) for index in range(task.samples)]
