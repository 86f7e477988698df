"""The LongBench/RULER JSONL loader and task (kvlib.eval.jsonl)."""

import json
import time

import pytest

import kvlib
from kvlib import cli
from kvlib.eval.jsonl import JsonlTask, load_jsonl, middle_cut_ids


def write(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_longbench_and_ruler_fields(tmp_path):
    path = write(
        tmp_path / "d.jsonl",
        [
            {"context": "Paris is in France.", "input": "Where is Paris?", "answers": ["France"], "length": 4},
            {"input": "RULER puts the whole prompt here", "outputs": ["a", "b"]},
            {"question": "q", "answer": "single"},
            "",
        ],
    )
    examples = load_jsonl(path)
    assert [e.answers for e in examples] == [("France",), ("a", "b"), ("single",)]
    assert examples[0].context == "Paris is in France." and examples[1].context == ""
    assert examples[2].question == "q"


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{bad json"], r"d.jsonl:1: not JSON"),
        (["[1, 2]"], "expected a JSON object"),
        ([{"input": "q"}], "no answers / outputs / answer field"),
        ([{"answers": ["x"]}], "no input / question / query field"),
        ([{"input": "q", "answers": []}], "empty answers"),
        ([""], "holds no examples"),
        (['{"input": "q", "answers": 5}'], r"d.jsonl:1: answers must be a string or a list of strings"),
        (['{"input": "q", "answers": ["a", 5]}'], "answers must be a string or a list of strings"),
        (['{"input": 5, "answers": "a"}'], "d.jsonl:1: the question must be a string, got int"),
        (['{"input": "q", "context": ["c"], "answers": "a"}'], "context must be a string, got list"),
        (['{"input": "q", "answers": "a", "score": NaN}'], r"d.jsonl:1: not a task line \(NaN is not a number JSON allows\)"),
        (['{"input": "q", "answers": ' + "[" * 100_000 + "]" * 100_000 + "}"], r"d.jsonl:1: not a task line"),
    ],
)
def test_bad_files_are_refused_with_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        load_jsonl(write(tmp_path / "d.jsonl", lines))


def test_missing_file_and_unknown_scorer(tmp_path):
    with pytest.raises(ValueError, match="jsonl file not found"):
        JsonlTask(path=str(tmp_path / "nope.jsonl"))
    path = write(tmp_path / "d.jsonl", [{"input": "q", "answers": ["a"]}])
    with pytest.raises(ValueError, match="unknown jsonl scorer 'bleu'; choose from exact, contains, f1"):
        JsonlTask(path=str(path), scorer="bleu")


def test_prompts_are_middle_truncated_to_the_context(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", [{"context": "A" * 50 + "B" * 50, "input": "Q?", "answers": ["x"]}])
    task = JsonlTask(path=str(path), context=41, template="{context}|{question}")
    ids = task.prompt_ids(tokenizer, load_jsonl(path)[0])
    assert len(ids) == 41 and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == "A" * 20 + "B" * 17 + "|Q?"


def test_runs_and_scores_predictions(tmp_path, byte_model, tokenizer):
    path = write(tmp_path / "qa.jsonl", [{"context": "x " * 40, "input": "What?", "answers": ["y"]}] * 3)
    task = JsonlTask(path=str(path), context=128, samples=2, max_new_tokens=4, scorer="contains")
    result = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model, "snapkv", budget=max(1, tokens // 4)))
    assert task.name == "jsonl:qa" and result.metrics["examples"] == 2
    assert len(result.metrics["predictions"]) == 2 and 0.0 <= result.score <= 1.0
    assert result.kv_fraction < 0.5


def test_a_bad_task_file_is_one_line_and_exit_2(tmp_path, capsys):
    nested = write(tmp_path / "nested.jsonl", ['{"input": "q", "answers": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    wrong = write(tmp_path / "wrong.jsonl", [{"input": "q", "answers": 5}])
    for path, message in (
        (nested, "nested.jsonl:1: not a task line"),
        (wrong, "wrong.jsonl:1: answers must be"),
        ("/dev/zero", "not a regular file"),
    ):
        assert cli.main(["compare", "--tasks", f"jsonl:{path}", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvlib: error: ") and message in err and err.count("\n") == 1


def test_a_long_context_is_cut_before_it_is_tokenized_with_the_same_ids(tmp_path, tokenizer):
    words = " ".join(f"w{i % 997}" for i in range(20_000))
    for text in (words, "ab" * 3, "é" * 5000 + words):  # long, short, multi-byte characters
        whole = tokenizer.encode(text)
        expected = whole if len(whole) <= 120 else whole[:60] + whole[len(whole) - 60 :]
        assert middle_cut_ids(tokenizer.encode, text, 120) == expected
    path = write(tmp_path / "long.jsonl", [{"context": "x" * 30_000_000, "input": "Where?", "answers": ["here"]}])
    task = JsonlTask(path=str(path), context=64)
    started = time.perf_counter()
    ids = task.prompt_ids(tokenizer, load_jsonl(path)[0])
    assert len(ids) == 64 and tokenizer.decode(ids[-8:]).endswith("Answer:")
    assert time.perf_counter() - started < 10  # tokenized whole it takes seconds and about 20 bytes of memory per character
