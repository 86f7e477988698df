"""retrieval_profile: RULER needle prompts as retrieval cases, calibrated once and cached per model."""

from __future__ import annotations

import pytest
import torch

from kvlib.default_model import ByteTokenizer
from kvlib.eval.models import LoadedModel
from kvlib.eval.retrieval_profile import CALIBRATION_TASKS, needle_case, needle_cases, retrieval_profile, token_span
from kvlib.eval.ruler import RULER_TASKS
from kvlib.policies.budget.head_importance import load_profile
from tests.eval.conftest import tiny_byte_model

CONTEXT = 1024


def test_each_case_appends_its_answer_and_points_at_the_needle():
    tokenizer = ByteTokenizer()
    cases = needle_cases(tokenizer, CONTEXT, samples=2, seed=1000)
    assert len(cases) == 2 * len(CALIBRATION_TASKS)
    prompts = [c for name in CALIBRATION_TASKS for c in RULER_TASKS[name](context=CONTEXT, samples=2, seed=1000).cases(tokenizer)]
    for case, prompt in zip(cases, prompts):
        (answer,) = prompt.answers
        reply = tokenizer.encode(" " + answer)
        assert case.ids == prompt.ids + tuple(reply[:-1])
        assert case.answer_queries == tuple(range(len(prompt.ids) - 1, len(case.ids)))
        # the query at p predicts token p + 1: the answer queries predict exactly the reply's tokens
        assert [case.ids[q + 1] for q in case.answer_queries[:-1]] == reply[:-1]
        assert answer in tokenizer.decode([case.ids[p] for p in case.needle])
        assert max(case.needle) < len(prompt.ids) - 1
        case.check()


def test_token_span_covers_the_characters_across_token_boundaries():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ab 1234 cd")
    assert token_span(tokenizer, ids, 3, 7) == [3, 4, 5, 6]  # one byte per token
    assert token_span(tokenizer, ids, 0, 0) == []


def test_bad_inputs_are_refused():
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match="does not occur in the prompt"):
        needle_case(tokenizer, tokenizer.encode("no number here"), "1234567")
    with pytest.raises(ValueError, match="must be RULER niah_\\* tasks.*valid: \\[.*niah_single"):
        needle_cases(tokenizer, CONTEXT, 1, tasks=("vt",))
    with pytest.raises(ValueError, match="calibration takes single-answer tasks"):
        needle_cases(tokenizer, CONTEXT, 1, tasks=("niah_multivalue",))


def test_the_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    loaded = LoadedModel(tiny_byte_model(CONTEXT), ByteTokenizer(), "tests/tiny byte", CONTEXT)
    path = retrieval_profile(loaded, context=CONTEXT, samples=1)
    assert path.parent == tmp_path / "profiles" and path.name == "tests_tiny_byte-retrieval-1024-1x2-seed1000.json"
    weights = load_profile(str(path))
    assert weights.shape == (2, 2) and bool((weights >= 1e-3).all())
    written = path.stat().st_mtime_ns
    assert retrieval_profile(loaded, context=CONTEXT, samples=1) == path and path.stat().st_mtime_ns == written
    assert not list(path.parent.glob("*.part"))
    assert torch.equal(load_profile(str(path)), weights)
