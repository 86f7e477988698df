"""The ``kvpress:PATH`` task: a dataset in kvpress's evaluation format, scored as kvpress scores it.

kvpress's datasets on the Hub (``simonjegou/ruler``, ``Xnhyacinth/LongBench``, ...) have one row per
question with the columns ``context``, ``question``, ``answer_prefix`` (strings), ``answer`` (a
string or a list of strings; LongBench's ``answers`` is read too), ``max_new_tokens`` (an int) and
an optional ``task`` that picks the scorer (:mod:`kvlib.eval.kvpress_scorers`). The file is JSON
Lines (read in bounded lines: :mod:`kvlib.eval.task_lines`) or Parquet (needs ``pyarrow``:
``pip install 'kvlib[parquet]'``); export a Hub split with
``datasets.load_dataset(...).to_json("ruler.jsonl")`` or ``.to_parquet(...)``.

The prompt is kvpress's: ``tokenizer.instruct(context + question, answer_prefix)`` (the question
closes the user's turn, the answer prefix opens the reply; kvpress puts a newline between question
and prefix for a model with no chat template, kvlib's ``instruct`` does not). A context longer than
the task's ``context`` tokens, less the row's ``max_new_tokens`` and the question's tokens, keeps
its first and last halves (:func:`~kvlib.eval.jsonl.middle_cut_ids`). The model decodes
``max_new_tokens`` greedily, stopping at EOS. Score: the mean over rows; the result's ``cases``
are pass/fail when every row's scorer gives 0 or 1 (RULER's string matches on one answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlib.errors import cut
from kvlib.eval.case_scores import case_scores
from kvlib.eval.jsonl import middle_cut_ids
from kvlib.eval.kvpress_scorers import scorer_for
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes, pad_id
from kvlib.eval.task_lines import PARQUET_MAGIC, json_lines, open_task_file
from kvlib.transformers_compat import cache_argument

COLUMNS = ("context", "question", "answer_prefix", "answer", "max_new_tokens")
"""The columns every row has (``answers`` stands for ``answer``)."""
MAX_NEW_TOKENS = 65536
"""Most answer tokens a row may ask for (more is a broken row, not a task)."""
PREDICTION_CHARS = 200
"""Most characters of each prediction kept in a result's metrics."""


@dataclass(frozen=True)
class KvpressRow:
    """One row: the text parts of its prompt, accepted answers, answer length and task (None: default scorer)."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    task: str | None


def parse_row(record: dict, where: str) -> KvpressRow:
    """A row from one record (a JSON object or a Parquet row); ``ValueError`` naming ``where``."""
    names = set(record) | ({"answer"} if "answers" in record else set())
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        have = cut(", ".join(sorted(map(str, record)))) or "nothing"
        raise ValueError(
            f"{where}: missing column(s) {', '.join(missing)}; kvpress's format has {', '.join(COLUMNS)} (this row has {have})"
        )
    for column in ("context", "question", "answer_prefix"):
        if not isinstance(record[column], str):
            raise ValueError(f"{where}: {column} must be a string, got {type(record[column]).__name__}")
    answers = record["answer"] if "answer" in record else record["answers"]
    answers = [answers] if isinstance(answers, str) else answers
    if not isinstance(answers, (list, tuple)) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: answer must be a string or a non-empty list of strings")
    tokens = record["max_new_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"{where}: max_new_tokens must be a whole number in [1, {MAX_NEW_TOKENS}], got {cut(repr(tokens))}")
    task = record.get("task")
    if task is not None and not isinstance(task, str):
        raise ValueError(f"{where}: task must be a string, got {type(task).__name__}")
    try:
        scorer_for(task)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return KvpressRow(record["context"], record["question"], record["answer_prefix"], tuple(answers), tokens, task)


def parquet_records(path: Path) -> list[tuple[str, dict]]:
    """``(where, row)`` of every row of a Parquet file, through ``pyarrow``; ``ValueError`` naming
    the extra to install when it is missing, or the file when pyarrow cannot read it."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ValueError(
            f"{path} is Parquet, which needs pyarrow: pip install 'kvlib[parquet]' (or export the dataset to JSON Lines)"
        ) from None
    try:
        rows = parquet.read_table(path).to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for a broken file
        raise ValueError(f"{path}: not a readable Parquet file ({cut(str(error))})") from None
    return [(f"{path}: row {index}", row) for index, row in enumerate(rows, start=1)]


def load_kvpress(path: str | Path) -> list[KvpressRow]:
    """Every row of a kvpress-format file (JSON Lines, or Parquet by its suffix or first bytes),
    each checked (:func:`parse_row`); ``ValueError`` for a file with no rows."""
    path = Path(path)
    with open_task_file(path, "kvpress file") as handle:  # a regular file within the size bound
        is_parquet = path.suffix == ".parquet" or handle.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    records = parquet_records(path) if is_parquet else json_lines(path, "kvpress file")
    rows = [parse_row(record, where) for where, record in records]
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


@dataclass(frozen=True)
class KvpressTask:
    """The first ``samples`` rows of ``path`` (all when None), each prompt within ``context`` tokens with its answer."""

    path: str
    context: int = 1024
    samples: int | None = None
    metric: str = "score"
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        rows = load_kvpress(self.path)
        longest = max(row.max_new_tokens for row in rows[: self.samples])
        if longest >= self.context:
            raise ValueError(f"{self.name}: a row asks for {longest} new tokens, more than the context of {self.context} leaves a prompt")

    @property
    def name(self) -> str:
        return f"kvpress:{Path(self.path).stem}"

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        check_context(self.name, self.context, context)

    def prompt_ids(self, tokenizer, row: KvpressRow) -> list[int]:
        """The row's prompt, its context middle-cut so that prompt and answer fit ``context`` tokens
        (a long context is cut before it is tokenized whole: :func:`~kvlib.eval.jsonl.middle_cut_ids`)."""
        room = self.context - row.max_new_tokens
        context_room = room - len(tokenizer.instruct(row.question, row.answer_prefix))
        while context_room > 0:
            kept = middle_cut_ids(tokenizer.encode, row.context, context_room)
            text = tokenizer.decode(kept) if len(kept) >= context_room else row.context  # shorter: nothing was cut
            ids = tokenizer.instruct(text + row.question, row.answer_prefix)
            if len(ids) <= room:
                return ids
            context_room -= len(ids) - room  # tokens merged differently across a cut or a join: shrink until it fits
        raise ValueError(f"{self.name}: the question and answer prefix leave no room for the context in {room} tokens")

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult:
        rows = load_kvpress(self.path)[: self.samples]
        pad = pad_id(tokenizer)
        device = next(model.parameters()).device
        scores, predictions, held, full = [], [], 0, 0
        for row in rows:
            ids = torch.tensor([self.prompt_ids(tokenizer, row)], device=device)
            cache = make_cache(ids.shape[1] + row.max_new_tokens)
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    **cache_argument(cache),
                    max_new_tokens=row.max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            text = tokenizer.decode(out[0, ids.shape[1] :].tolist())
            predictions.append(text[:PREDICTION_CHARS])
            scores.append(scorer_for(row.task).score(text, row.answers))
            kv, whole = kv_bytes(cache)
            held, full = held + kv, full + whole
        kind = "pass_fail" if all(scorer_for(r.task).binary_for(r.answers) for r in rows) else "mean"
        by_task: dict[str, list[float]] = {}
        for row, score in zip(rows, scores):
            by_task.setdefault(row.task or "", []).append(score)
        metrics = {
            "rows": len(rows),
            "context": self.context,
            "scorers": sorted({scorer_for(r.task).name for r in rows}),
            "by_task": {task: float(np.mean(values)) for task, values in by_task.items()},
            "predictions": predictions,
        }
        cases = case_scores(scores, kind, [(r.context, r.question, r.answer_prefix, r.answers) for r in rows])
        return TaskResult(self.name, self.metric, float(np.mean(scores)), True, held, full, metrics, len(rows), cases)
