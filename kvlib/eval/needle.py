"""The ``needle`` task: a passkey hidden at a chosen depth of a long filler text, asked for at the end.

Each case is ``BOS + filler[:cut] + needle line + filler[cut:] + question``: ``context`` tokens
minus room for the answer (``key_digits + 2``), so prompt and answer fit the context
(:mod:`kvlib.eval.needle_format` gives the wording). The filler is a window of the evaluation text (:mod:`kvlib.eval.texts`) that ends a line; ``cut`` is the first line start at or
after ``depth`` x filler length (depth 0: right after BOS, 1: right before the question). Keys
are random ``key_digits``-digit numbers. The model decodes greedily; a case is right when the
first number it writes is exactly the key (:func:`kvlib.eval.scoring.passkey_match`). Score:
accuracy over ``depths`` x ``samples`` cases; ``metrics["by_depth"]`` has each depth's; the
result's ``cases`` are pass/fail.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvlib.eval.case_scores import case_scores
from kvlib.eval.needle_format import QUESTION, needle_line
from kvlib.eval.scoring import passkey_match
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes, pad_id
from kvlib.eval.texts import text_ids
from kvlib.transformers_compat import cache_argument

DEPTHS = tuple(round(0.1 * i, 1) for i in range(11))


@dataclass(frozen=True)
class NeedleCase:
    """One prompt (BOS first), the key it hides and the needle's depth."""

    ids: tuple[int, ...]
    key: str
    depth: float


@dataclass(frozen=True)
class NeedleTask:
    """Passkey retrieval at every depth in ``depths`` (fractions of the filler), ``samples`` keys each.

    ``context``: prompt plus answer, in tokens; ``batch_size``: cases per ``generate`` call;
    ``text``: a filler text file (default: the evaluation text).
    """

    context: int = 1024
    depths: tuple[float, ...] = DEPTHS
    samples: int = 2
    key_digits: int = 5
    batch_size: int = 32
    seed: int = 0
    text: str | None = None
    name: str = "needle"
    metric: str = "accuracy"
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"needle depths must be in [0, 1], got {self.depths}")
        if self.samples < 1 or self.key_digits < 1 or self.batch_size < 1:
            raise ValueError("needle samples, key_digits and batch_size must be >= 1")

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        check_context(self.name, self.context, context)
        self.cases(tokenizer)

    @property
    def answer_room(self) -> int:
        """Tokens left after the prompt for the answer: the key's digits and two more."""
        return self.key_digits + 2

    def cases(self, tokenizer) -> list[NeedleCase]:
        """Every (depth, sample) case, in depth order; the same for the same settings."""
        return _cases(self, tokenizer)

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult:
        cases = self.cases(tokenizer)
        new_tokens = self.answer_room
        pad = pad_id(tokenizer)
        device = next(model.parameters()).device
        correct, held, full = [], 0, 0
        for start in range(0, len(cases), self.batch_size):
            chunk = cases[start : start + self.batch_size]
            ids = torch.tensor([c.ids for c in chunk], device=device)
            cache = make_cache(ids.shape[1])
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    **cache_argument(cache),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            for case, row in zip(chunk, out[:, ids.shape[1] :].tolist()):
                correct.append(passkey_match(tokenizer.decode(row), case.key))
            kv, whole = kv_bytes(cache)
            held, full = held + kv, full + whole
        by_depth = {str(d): float(np.mean([ok for ok, c in zip(correct, cases) if c.depth == d])) for d in self.depths}
        return TaskResult(
            self.name,
            self.metric,
            float(np.mean(correct)),
            True,
            held,
            full,
            {"by_depth": by_depth, "cases": len(cases), "context": self.context},
            len(cases),
            case_scores([float(ok) for ok in correct], "pass_fail", [(c.ids, c.key) for c in cases]),
        )


@functools.lru_cache(maxsize=8)
def _cases(task: NeedleTask, tokenizer) -> list[NeedleCase]:
    filler_ids = text_ids(tokenizer, task.text)
    question = tokenizer.encode(QUESTION)
    rng = np.random.default_rng(task.seed)
    cases = []
    for depth in task.depths:
        for _ in range(task.samples):
            key = str(int(rng.integers(10 ** (task.key_digits - 1), 10**task.key_digits)))
            needle = tokenizer.encode(needle_line(key))
            prompt = task.context - task.answer_room
            length = prompt - 1 - len(needle) - len(question)
            if length < 1 or len(filler_ids) < length + 1:
                raise ValueError(
                    f"needle context {task.context} leaves no room for filler around the needle and question"
                    f" ({len(needle) + len(question) + 1} tokens) or the filler text is too small"
                )
            filler = _filler(tokenizer, filler_ids, length, int(rng.integers(0, len(filler_ids) - length)))
            cut = _line_start_at(tokenizer, filler, round(depth * length))
            ids = tokenizer.encode("", bos=True)
            ids += filler[:cut] + needle + filler[cut:] + question
            cases.append(NeedleCase(tuple(ids[-prompt:]), key, depth))
    return cases


def _ends_line(tokenizer, token: int) -> bool:
    return tokenizer.decode([token]).endswith("\n")


def _filler(tokenizer, ids: tuple[int, ...], length: int, start: int) -> list[int]:
    """``length`` ids from ``start`` or the nearest later offset whose window ends a line."""
    end = start + length
    while end < len(ids) and not _ends_line(tokenizer, ids[end - 1]):
        end += 1
    if end >= len(ids):
        end = start + length
    return list(ids[end - length : end])


def _line_start_at(tokenizer, filler: list[int], target: int) -> int:
    """The first index ``>= target`` that starts a line (or the end of ``filler``)."""
    for index in range(target, len(filler)):
        if index == 0 or _ends_line(tokenizer, filler[index - 1]):
            return index
    return len(filler)
