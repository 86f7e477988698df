"""Retrieval-head profiles measured on RULER needle prompts, cached per model and setting.

:func:`needle_cases` turns RULER ``niah_*`` cases into
:class:`~kvlib.policies.budget.retrieval_calibration.RetrievalCase` (the answer appended
teacher-forced, the needle's value tokens located in the prompt); :func:`retrieval_profile` runs
:func:`~kvlib.policies.budget.retrieval_calibration.calibrate_retrieval` on them once and keeps
the profile under ``<kvlib cache>/profiles/``, for ``duo_attention(profile=...)`` and
``head_importance(profile=...)``. The calibration seeds default to 1000 and up, away from the
evaluation's seed 0, so a profile is never measured on the prompts it is judged on.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from kvlib.eval.models import LoadedModel, TextTokenizer
from kvlib.eval.output_files import private_folder
from kvlib.eval.ruler import RULER_TASKS
from kvlib.policies.budget.retrieval_calibration import RetrievalCase, calibrate_retrieval

CALIBRATION_TASKS = ("niah_single", "niah_multikey")
"""Needle tasks a profile is measured on by default (one asked value each: the answer is one number)."""


def token_span(tokenizer: TextTokenizer, ids: Sequence[int], start: int, end: int) -> list[int]:
    """Positions of the tokens of ``ids`` that overlap the characters ``[start, end)`` of their
    decoded text (tokens decoded one by one and concatenated)."""
    spans, at = [], 0
    for position, token in enumerate(ids):
        size = len(tokenizer.decode([token]))
        if at < end and at + size > start:
            spans.append(position)
        at += size
    return spans


def needle_case(tokenizer: TextTokenizer, ids: Sequence[int], answer: str) -> RetrievalCase:
    """A :class:`RetrievalCase` from a prompt and its one answer: the answer (after a space) is
    appended but for its last token, the needle is every occurrence of the answer in the prompt,
    and the answer queries are the positions that predict the answer's tokens. ``ValueError`` when
    the answer does not occur in the prompt."""
    text = "".join(tokenizer.decode([token]) for token in ids)
    needle = [p for found in re.finditer(re.escape(answer), text) for p in token_span(tokenizer, ids, found.start(), found.end())]
    if not needle:
        raise ValueError(f"answer {answer!r} does not occur in the prompt's text: not a needle case")
    reply = tokenizer.encode(" " + answer)
    full = list(ids) + reply[:-1]
    return RetrievalCase(tuple(full), tuple(sorted(set(needle))), tuple(range(len(ids) - 1, len(full))))


def needle_cases(
    tokenizer: TextTokenizer, context: int, samples: int, seed: int = 1000, tasks: Sequence[str] = CALIBRATION_TASKS
) -> list[RetrievalCase]:
    """``samples`` cases of each single-answer needle task in ``tasks`` at ``context`` tokens."""
    unknown = [t for t in tasks if t not in RULER_TASKS or not t.startswith("niah")]
    if unknown or not tasks:
        raise ValueError(
            f"needle calibration tasks must be RULER niah_* tasks, got {list(tasks)}; valid: {sorted(t for t in RULER_TASKS if t.startswith('niah'))}"
        )
    cases = []
    for name in tasks:
        for case in RULER_TASKS[name](context=context, samples=samples, seed=seed).cases(tokenizer):
            if len(case.answers) != 1:
                raise ValueError(f"{name} asks for {len(case.answers)} values; calibration takes single-answer tasks")
            cases.append(needle_case(tokenizer, case.ids, case.answers[0]))
    return cases


def retrieval_profile(loaded: LoadedModel, context: int = 4096, samples: int = 2, seed: int = 1000) -> Path:
    """The path of ``loaded``'s retrieval profile on :data:`CALIBRATION_TASKS` (``samples`` cases
    each at ``context`` tokens, seeds from ``seed``), measured on the first call and cached."""
    from kvlib.eval.smollm2 import cache_root

    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", loaded.name)
    path = cache_root() / "profiles" / f"{name}-retrieval-{context}-{samples}x{len(CALIBRATION_TASKS)}-seed{seed}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        cases = needle_cases(loaded.tokenizer, context, samples, seed)
        scratch = private_folder(path)  # written where no one else can plant a file, then renamed into place
        try:
            calibrate_retrieval(loaded.model, cases, scratch / path.name)
            (scratch / path.name).replace(path)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return path
