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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlib.eval.scoring import SCORERS
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes, pad_id
from kvlib.transformers_compat import cache_argument

ANSWER_FIELDS = ("answers", "outputs", "answer")
QUESTION_FIELDS = ("input", "question", "query")
TEMPLATE = "{context}\n\nQuestion: {question}\nAnswer:"


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
    raise ValueError(f"{where}: no {' / '.join(names)} field (has {', '.join(sorted(record)) or 'nothing'})")


def load_jsonl(path: str | Path) -> list[JsonlExample]:
    """Every example in a JSONL file; a missing file, bad JSON or a missing field raises one line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"jsonl file not found: {path}")
    examples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object per line")
        answers = _field(record, ANSWER_FIELDS, where)
        answers = (answers,) if isinstance(answers, str) else tuple(str(a) for a in answers)
        if not answers:
            raise ValueError(f"{where}: empty answers")
        examples.append(JsonlExample(str(record.get("context", "")), str(_field(record, QUESTION_FIELDS, where)), answers))
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


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
        """The example's prompt, BOS first, middle-truncated to ``context`` tokens."""
        bos = tokenizer.encode("", bos=True)
        ids = tokenizer.encode(self.template.format(context=example.context, question=example.question))
        room = self.context - len(bos)
        if len(ids) > room:
            ids = ids[: room // 2] + ids[len(ids) - (room - room // 2) :]
        return bos + ids

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
