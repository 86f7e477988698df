"""The LongBench/RULER JSONL loader and task (kvlib.eval.jsonl)."""

import json

import pytest

import kvlib
from kvlib.eval.jsonl import JsonlTask, load_jsonl


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
