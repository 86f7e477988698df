"""The needle task (kvlib.eval.needle): case construction and scoring through generate."""

import pytest

import kvlib
from kvlib.eval.needle import NeedleTask
from kvlib.eval.needle_format import QUESTION, needle_line


def test_cases_have_the_context_length_bos_needle_at_a_line_start_and_question_last(tokenizer):
    task = NeedleTask(context=300, depths=(0.0, 0.5, 1.0), samples=3)
    cases = task.cases(tokenizer)
    assert len(cases) == 9 and [c.depth for c in cases] == [0.0] * 3 + [0.5] * 3 + [1.0] * 3
    for case in cases:
        assert len(case.ids) == 300 - task.answer_room and case.ids[0] == tokenizer.bos_token_id
        text = tokenizer.decode(list(case.ids))
        needle = needle_line(case.key)
        assert text.endswith(QUESTION) and text.count(needle) == 1
        start = text.index(needle)
        assert start == 0 or text[start - 1] == "\n"  # a line of its own
        assert len(case.key) == 5 and case.key.isdigit()
        filler = len(text) - len(needle) - len(QUESTION)
        if case.depth == 0.0:
            assert start == 0
        elif case.depth == 1.0:
            assert text.index(QUESTION, start) == start + len(needle)  # right before the question
        else:
            assert abs(start - 0.5 * filler) < 120  # the first line start after the middle
        assert text[: -len(QUESTION)].endswith("\n")  # the question starts its own line


def test_cases_are_deterministic_and_depend_on_the_seed(tokenizer):
    one, again = NeedleTask(context=200, samples=2).cases(tokenizer), NeedleTask(context=200, samples=2).cases(tokenizer)
    other = NeedleTask(context=200, samples=2, seed=1).cases(tokenizer)
    assert one == again and [c.key for c in one] != [c.key for c in other]


@pytest.mark.parametrize("kwargs", [{"depths": (1.5,)}, {"depths": ()}, {"samples": 0}, {"key_digits": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="needle"):
        NeedleTask(**kwargs)


def test_too_long_for_the_model_or_too_short_for_the_needle_is_refused(byte_model, tokenizer):
    with pytest.raises(ValueError, match="needs 1024 tokens but the model's context is 256"):
        NeedleTask(context=1024).check(byte_model, tokenizer, 256)
    with pytest.raises(ValueError, match="needle context 100 leaves no room for filler"):
        NeedleTask(context=100).check(byte_model, tokenizer, 256)


def test_scores_count_exact_keys_per_depth(byte_model, tokenizer, monkeypatch):
    task = NeedleTask(context=128, depths=(0.0, 1.0), samples=2, batch_size=3)
    cases = task.cases(tokenizer)
    answers = {c.ids: c.key for c in cases}
    answers[cases[0].ids] = "99999"  # one wrong at depth 0
    answers[cases[3].ids] = cases[3].key + "1"  # too long at depth 1
    calls = []

    def fake_generate(ids, **kwargs):
        import torch

        calls.append(ids.shape[0])
        rows = [list(row) + tokenizer.encode(answers[tuple(row)] + ".")[: kwargs["max_new_tokens"]] for row in ids.tolist()]
        width = max(map(len, rows))
        return torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])

    monkeypatch.setattr(byte_model, "generate", fake_generate)
    result = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model))
    assert calls == [3, 1]
    assert result.score == 0.5 and result.metrics["by_depth"] == {"0.0": 0.5, "1.0": 0.5}
    assert result.higher_is_better and result.metric == "accuracy"


def test_runs_through_generate_with_a_compressed_cache(byte_model, tokenizer):
    task = NeedleTask(context=128, depths=(0.5,), samples=2)
    full = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model))
    small = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model, "streaming_llm", budget=tokens // 4))
    assert 0.0 <= small.score <= 1.0 and 0.0 <= full.score <= 1.0
    assert full.kv_bytes >= full.full_bytes > 0  # whole pages: at least the tokens' bytes
    assert small.kv_fraction < 0.4
