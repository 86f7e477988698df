"""The ``jsonl`` task: LongBench- or RULER-style JSON Lines files (context, question, answers).

Each line is an object with the answers under ``answers``, ``outputs`` or ``answer`` (a string or a
list of strings) and the question under ``input``, ``question`` or ``query``; ``context`` is
optional (RULER puts the whole prompt in ``input``). The prompt is
``template.format(context=..., question=...)``; a prompt longer than the task's context keeps its
first and last halves (LongBench's middle truncation). The model decodes ``max_new_tokens``
greedily; the first line of what it writes is scored by ``scorer`` (:data:`~kvlib.eval.scoring.SCORERS`:
``f1`` as LongBench's QA, ``contains`` as RULER's string match, ``exact``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlib.errors import cut
from kvlib.eval.case_scores import case_scores
from kvlib.eval.scoring import SCORERS
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes, pad_id
from kvlib.eval.task_lines import json_lines
from kvlib.transformers_compat import cache_argument

ANSWER_FIELDS = ("answers", "outputs", "answer")
QUESTION_FIELDS = ("input", "question", "query")
BINARY_SCORERS = ("exact", "string_match_part")
"""Scorers whose per-case score is always 0 or 1."""
SINGLE_ANSWER_BINARY = ("contains", "string_match_all")
"""Scorers whose per-case score is 0 or 1 when the case has one answer."""
TEMPLATE = "{context}\n\nQuestion: {question}\nAnswer:"
CUT_CHARS_PER_TOKEN = 16
"""Characters of each end of a long prompt tokenized per token kept there, at first (:func:`middle_cut_ids`)."""
CUT_MARGIN_TOKENS = 64
"""Ids past each cut that :func:`middle_cut_ids` tokenizes and drops."""


@dataclass(frozen=True)
class JsonlExample:
    """One example: its context (may be empty), question and accepted answers."""

    context: str
    question: str
    answers: tuple[str, ...]


def _field(record: dict, names: tuple[str, ...], where: str) -> object:
    for name in names:
        if name in record:
            return record[name]
    raise ValueError(f"{where}: no {' / '.join(names)} field (has {cut(', '.join(sorted(record))) or 'nothing'})")


def _text(value: object, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: {name} must be a string, got {type(value).__name__}")
    return value


def load_jsonl(path: str | Path) -> list[JsonlExample]:
    """Every example in a JSONL file, read line by line within bounds (:func:`~kvlib.eval.task_lines.json_lines`:
    a file that cannot be read, a line too long, not UTF-8 or not JSON, NaN and nesting past the
    parser's depth included); a missing field or one of the wrong type raises one line naming the
    file and the line."""
    path = Path(path)
    examples = []
    for where, record in json_lines(path):
        answers = _field(record, ANSWER_FIELDS, where)
        answers = (answers,) if isinstance(answers, str) else answers
        if not isinstance(answers, (list, tuple)) or not all(isinstance(answer, str) for answer in answers):
            raise ValueError(f"{where}: answers must be a string or a list of strings")
        if not answers:
            raise ValueError(f"{where}: empty answers")
        context = _text(record.get("context", ""), "context", where)
        examples.append(JsonlExample(context, _text(_field(record, QUESTION_FIELDS, where), "the question", where), tuple(answers)))
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def middle_cut_ids(encode: Callable[[str], list[int]], text: str, room: int) -> list[int]:
    """``encode(text)`` middle-truncated to ``room`` tokens (its first ``room // 2`` ids and last
    ``room - room // 2``), LongBench's truncation, without tokenizing a long text whole: only its
    first and last :data:`CUT_CHARS_PER_TOKEN` ``* room`` characters are, widened until each end
    yields :data:`CUT_MARGIN_TOKENS` more ids than it keeps (the ids near a cut may differ from
    the whole text's; those are dropped). The same ids as tokenizing the whole text wherever no
    token spans more than the margin."""
    chars = CUT_CHARS_PER_TOKEN * room
    head_room, tail_room = room // 2, room - room // 2
    while len(text) > 2 * chars:
        head, tail = encode(text[:chars]), encode(text[-chars:])
        if len(head) >= head_room + CUT_MARGIN_TOKENS and len(tail) >= tail_room + CUT_MARGIN_TOKENS:
            return head[:head_room] + tail[len(tail) - tail_room :]
        chars *= 4
    ids = encode(text)
    return ids if len(ids) <= room else ids[:head_room] + ids[len(ids) - tail_room :]


@dataclass(frozen=True)
class JsonlTask:
    """Greedy answers to the first ``samples`` examples of ``path`` (all when ``None``), scored by ``scorer``."""

    path: str
    context: int = 1024
    samples: int | None = None
    max_new_tokens: int = 32
    scorer: str = "f1"
    template: str = TEMPLATE
    metric: str = "score"
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown jsonl scorer {self.scorer!r}; choose from {', '.join(SCORERS)}")
        load_jsonl(self.path)

    @property
    def name(self) -> str:
        return f"jsonl:{Path(self.path).stem}"

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        check_context(self.name, self.context + self.max_new_tokens, context)

    def prompt_ids(self, tokenizer, example: JsonlExample) -> list[int]:
        """The example's prompt, BOS first, middle-truncated to ``context`` tokens (a long text is
        cut before it is tokenized: :func:`middle_cut_ids`)."""
        bos = tokenizer.encode("", bos=True)
        text = self.template.format(context=example.context, question=example.question)
        return bos + middle_cut_ids(tokenizer.encode, text, self.context - len(bos))

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult:
        examples = load_jsonl(self.path)[: self.samples]
        score = SCORERS[self.scorer]
        pad = pad_id(tokenizer)
        device = next(model.parameters()).device
        scores, predictions, held, full = [], [], 0, 0
        for example in examples:
            ids = torch.tensor([self.prompt_ids(tokenizer, example)], device=device)
            cache = make_cache(ids.shape[1])
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    **cache_argument(cache),
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            text = tokenizer.decode(out[0, ids.shape[1] :].tolist()).strip().split("\n")[0]
            predictions.append(text)
            scores.append(score(text, example.answers))
            kv, whole = kv_bytes(cache)
            held, full = held + kv, full + whole
        return TaskResult(
            self.name,
            self.metric,
            float(np.mean(scores)),
            True,
            held,
            full,
            {"scorer": self.scorer, "examples": len(examples), "predictions": predictions, "context": self.context},
            len(examples),
            case_scores(scores, self.case_kind(examples), examples),
        )

    def case_kind(self, examples: list[JsonlExample]) -> str:
        """``"pass_fail"`` when the scorer gives only 0 or 1 on these examples (exact and
        string_match_part always; contains and string_match_all when each has one answer), else ``"mean"``."""
        if self.scorer in BINARY_SCORERS or (self.scorer in SINGLE_ANSWER_BINARY and all(len(e.answers) == 1 for e in examples)):
            return "pass_fail"
        return "mean"
