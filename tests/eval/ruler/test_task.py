"""What every RULER-style task guarantees: prompts that fill the context without passing it, the
answers in the prompt, the same cases for the same seed, and a run scored as RULER scores it."""

from __future__ import annotations

import dataclasses

import pytest

import kvlib
from kvlib.default_model import ByteTokenizer
from kvlib.eval import parse_tasks
from kvlib.eval.ruler import RULER_TASKS
from kvlib.eval.task_table import RULER_NAMES
from tests.eval.conftest import tiny_byte_model


def test_every_ruler_name_is_a_task():
    assert tuple(RULER_TASKS) == RULER_NAMES
    tasks = parse_tasks(",".join(RULER_NAMES), context=2048, samples=3, seed=5)
    assert [t.name for t in tasks] == list(RULER_NAMES)
    assert all(t.context == 2048 and t.samples == 3 and t.seed == 5 for t in tasks)


@pytest.mark.parametrize("name", RULER_NAMES)
@pytest.mark.parametrize("context", [1024, 4096])
def test_prompts_fill_the_context_and_hold_the_answers(words, name, context):
    task = RULER_TASKS[name](context=context, samples=3)
    room = context - task.tokens_to_generate
    for index, case in enumerate(task.cases(words)):
        assert len(case.ids) <= room
        bigger = task.prompt(case.size + 1, task.rng(index), words)
        assert len(words.instruct(bigger.message, bigger.reply_start)) > room  # the largest haystack that fits
        text = words.decode(list(case.ids))
        assert case.answers and all(answer in text for answer in case.answers)
        assert text.startswith("<user>") and "<assistant>" in text  # the chat template wraps the message


@pytest.mark.parametrize("name", RULER_NAMES)
def test_cases_are_deterministic_by_seed(words, name):
    first = RULER_TASKS[name](context=1024, samples=2, seed=1).cases(words)
    again = RULER_TASKS[name](context=1024, samples=2, seed=1).cases(words)
    other = RULER_TASKS[name](context=1024, samples=2, seed=2).cases(words)
    assert first == again
    assert [c.answers for c in first] != [c.answers for c in other]
    assert first[0].answers != first[1].answers


def test_a_context_too_small_is_a_value_error_at_check(words):
    task = RULER_TASKS["niah_single"](context=150, samples=1)
    with pytest.raises(ValueError, match="niah_single: context 150 is too small"):
        task.check(None, words, context=8192)
    with pytest.raises(ValueError, match="needs 1024 tokens but the model's context is 512"):
        RULER_TASKS["niah_single"](context=1024).check(None, words, context=512)
    with pytest.raises(ValueError, match="samples"):
        RULER_TASKS["vt"](samples=0)


def test_run_generates_scores_and_counts_bytes():
    """A random byte model: the run goes through generate with left padding, scores every case in
    [0, 1] and reports the cache's bytes; a budget holds fewer bytes than the full cache."""
    model, tokenizer = tiny_byte_model(context=1024), ByteTokenizer()
    task = RULER_TASKS["niah_single"](context=1024, samples=3, batch_size=2)
    full = task.run(model, tokenizer, lambda tokens: kvlib.make_cache(model))
    assert full.task == "niah_single" and full.metric == "string_match_all" and full.higher_is_better
    assert len(full.metrics["scores"]) == 3 and all(0.0 <= s <= 1.0 for s in full.metrics["scores"])
    assert full.score == pytest.approx(sum(full.metrics["scores"]) / 3)
    assert full.metrics["prompt_tokens"] == [len(c.ids) for c in task.cases(tokenizer)]
    assert full.kv_bytes >= full.full_bytes > 0  # whole pages
    kept = task.run(model, tokenizer, lambda tokens: kvlib.make_cache(model, "streaming_llm", budget=tokens // 4))
    assert kept.kv_bytes < full.kv_bytes / 2


def test_a_right_answer_scores_one():
    task = RULER_TASKS["niah_multivalue"]()
    assert task.score(" 1234567, 2345678,\x003456789 and 4567890.", ("1234567", "2345678", "3456789", "4567890")) == 1.0
    assert task.score(" 1234567 only", ("1234567", "2345678")) == 0.5


def test_byte_tokenizer_prompts_start_with_bos(words):
    case = RULER_TASKS["niah_single"](context=1024, samples=1).cases(ByteTokenizer())[0]
    assert case.ids[0] == ByteTokenizer().bos_token_id
    assert ByteTokenizer().decode(list(case.ids)).endswith("mentioned in the provided text is")
    assert all(i < 256 for i in case.ids[1:])  # no other special token


@pytest.mark.parametrize("name", ["niah_single", "niah_multiquery", "vt"])
def test_a_case_knows_where_its_question_starts(words, name):
    """The ids before ``context_tokens`` are the message up to its question; the rest asks it."""
    task = RULER_TASKS[name](context=1024, samples=2)
    for index, case in enumerate(task.cases(words)):
        prompt = task.prompt(case.size, task.rng(index), words)
        assert prompt.question and prompt.message.endswith(prompt.question)
        assert 0 < case.context_tokens < len(case.ids)
        assert list(case.ids[: case.context_tokens]) == words.instruct(prompt.message[: -len(prompt.question)])[: case.context_tokens]
        assert words.decode(list(case.ids[case.context_tokens :])).startswith(prompt.question.split()[0])


def test_context_first_reads_the_context_then_the_question():
    """On the full cache, reading the context first and the question after gives the answers of
    one prompt (the same KV either way); under a budget the question is read after the context
    was compressed, so the answers may differ, and bytes stay under the budget's share."""
    model, tokenizer = tiny_byte_model(context=1024), ByteTokenizer()
    task = RULER_TASKS["niah_single"](context=1024, samples=2, batch_size=2)
    apart = dataclasses.replace(task, context_first=True)
    assert all(0 < c.context_tokens < len(c.ids) for c in apart.cases(tokenizer))
    one = task.run(model, tokenizer, lambda tokens: kvlib.make_cache(model))
    two = apart.run(model, tokenizer, lambda tokens: kvlib.make_cache(model))
    assert two.metrics["predictions"] == one.metrics["predictions"]
    kept = apart.run(model, tokenizer, lambda tokens: kvlib.make_cache(model, "snapkv", budget=tokens // 4))
    assert kept.kv_bytes < two.kv_bytes / 2


def test_context_first_configurations_reuse_kvzip_s_scores_and_equal_fresh_runs():
    """KVzip at two budgets on one context-first task: the second reuses the reconstruction scores
    the first kept per case, and each equals its run on a task of its own."""
    model, tokenizer = tiny_byte_model(context=1024), ByteTokenizer()
    task = RULER_TASKS["niah_single"](context=1024, samples=2, context_first=True)
    for budget in (0.25, 0.5):
        make = lambda tokens: kvlib.make_cache(model, "kvzip", budget=budget)  # noqa: E731
        shared = task.run(model, tokenizer, make)
        alone = dataclasses.replace(task).run(model, tokenizer, make)
        assert shared.metrics["predictions"] == alone.metrics["predictions"] and shared.kv_bytes == alone.kv_bytes
        assert len(task.context_memos) == 2 and all(len(memo) == 1 for memo in task.context_memos.values())


def test_context_first_needs_a_question_apart():
    with pytest.raises(ValueError, match="cwe has no question apart from its context"):
        RULER_TASKS["cwe"](context_first=True)
    assert RULER_TASKS["vt"](context_first=True).context_first
    tasks = parse_tasks("niah_single,vt", context=1024, context_first=True)
    assert [t.context_first for t in tasks] == [True, True]
    with pytest.raises(ValueError, match="a question apart from their context .* got needle, jsonl:x.jsonl"):
        parse_tasks("niah_single,needle,jsonl:x.jsonl", context=1024, context_first=True)


def test_run_shared_gives_each_configuration_what_run_gives_it():
    """One prompt call per batch for every configuration: scores, predictions and bytes equal
    separate runs'; a context-first task refuses (its configurations run apart)."""
    from kvlib.eval.shared_generation import shares

    model, tokenizer = tiny_byte_model(context=1024), ByteTokenizer()
    task = RULER_TASKS["niah_single"](context=512, samples=2, batch_size=2, tokens_to_generate=8)
    factories = [lambda tokens: kvlib.make_cache(model), lambda tokens: kvlib.make_cache(model, "snapkv", budget=tokens // 4)]
    needs = shares(model, factories[1]).needs
    shared = task.run_shared(model, tokenizer, factories, needs)
    assert shared == [task.run(model, tokenizer, make) for make in factories]
    with pytest.raises(ValueError, match="run apart"):
        dataclasses.replace(task, context_first=True).run_shared(model, tokenizer, factories, needs)
