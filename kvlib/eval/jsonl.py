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

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlib.errors import cut
from kvlib.eval.scoring import SCORERS
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes, pad_id
from kvlib.eval.texts import utf8_text
from kvlib.limits import MAX_TASK_FILE_BYTES, read_bounded
from kvlib.transformers_compat import cache_argument

ANSWER_FIELDS = ("answers", "outputs", "answer")
QUESTION_FIELDS = ("input", "question", "query")
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


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def load_jsonl(path: str | Path) -> list[JsonlExample]:
    """Every example in a JSONL file (at most :data:`~kvlib.limits.MAX_TASK_FILE_BYTES`); a file
    that cannot be read, a line that is not JSON (NaN and nesting past the parser's depth
    included) and a missing field or one of the wrong type raise one line naming the file (and
    the line)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"jsonl file not found: {path}")
    examples = []
    for number, line in enumerate(utf8_text(read_bounded(path, MAX_TASK_FILE_BYTES, "jsonl file"), path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{where}: not a task line ({cut(str(exc)) or 'nested too deep'})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object per line")
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
        )
