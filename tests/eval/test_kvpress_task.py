"""kvpress's evaluation format (kvlib.eval.kvpress_task): rows read and checked before the model
loads, bad files refused in one line, kvpress's scorers by task, and a run on the tiny model."""

import json
import os
import re

import pytest

import kvlib
from kvlib import cli
from kvlib.eval.kvpress_scorers import count_score, kvpress_clean, retrieval_score, scorer_for
from kvlib.eval.kvpress_task import KvpressTask, load_kvpress
from kvlib.eval.task_lines import json_lines
from kvlib.eval.task_table import parse_tasks

ROW = {
    "context": "The key is 4211. " * 3,
    "question": "What is the key?",
    "answer_prefix": " Answer:",
    "answer": ["4211"],
    "max_new_tokens": 4,
}


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_rows_are_read_with_their_task_and_longbench_answers(tmp_path):
    path = write(
        tmp_path / "d.jsonl",
        [
            ROW,
            {**ROW, "answer": "one", "task": "qa_1"},
            {**{k: v for k, v in ROW.items() if k != "answer"}, "answers": ["x", "y"], "task": "hotpotqa"},
        ],
    )
    rows = load_kvpress(path)
    assert [r.answers for r in rows] == [("4211",), ("one",), ("x", "y")]
    assert [r.task for r in rows] == [None, "qa_1", "hotpotqa"] and rows[0].max_new_tokens == 4
    tasks = parse_tasks(f"needle,kvpress:{path}", context=128)
    assert tasks[1].name == "kvpress:d"


def _without(column):
    return {k: v for k, v in ROW.items() if k != column}


@pytest.mark.parametrize(
    "lines, message",
    [
        ([_without("answer_prefix")], "d.jsonl:1: missing column(s) answer_prefix; kvpress's format has context, question"),
        ([{"text": "x"}], "missing column(s) context, question, answer_prefix, answer, max_new_tokens"),
        ([{**ROW, "context": 5}], "d.jsonl:1: context must be a string, got int"),
        ([{**ROW, "answer": []}], "answer must be a string or a non-empty list of strings"),
        ([{**ROW, "answer": [1]}], "answer must be a string or a non-empty list of strings"),
        ([{**ROW, "max_new_tokens": "4"}], "max_new_tokens must be a whole number in [1, 65536], got '4'"),
        ([{**ROW, "max_new_tokens": True}], "max_new_tokens must be a whole number"),
        ([{**ROW, "max_new_tokens": 0}], "max_new_tokens must be a whole number"),
        ([{**ROW, "task": 3}], "task must be a string, got int"),
        ([{**ROW, "task": "gov_report"}], "task 'gov_report' is scored by ROUGE in kvpress, which kvlib does not implement"),
        ([{**ROW, "task": "mystery"}], "unknown kvpress task 'mystery'"),
        ([ROW, "[1]"], "d.jsonl:2: expected a JSON object per line"),
        (["{bad"], "d.jsonl:1: not JSON"),
        (['{"context": NaN}'], "not a task line"),
        ([""], "holds no rows"),
    ],
)
def test_bad_rows_are_one_clear_error(tmp_path, lines, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_kvpress(write(tmp_path / "d.jsonl", lines))


def test_binary_garbage_empty_files_and_parquet_are_refused(tmp_path):
    garbage = tmp_path / "g.jsonl"
    garbage.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ValueError, match=r"g.jsonl:1: not UTF-8 text"):
        load_kvpress(garbage)
    garbage.write_bytes(bytes(range(256)) * 4)  # control bytes, then a newline: the first line is not JSON
    with pytest.raises(ValueError, match=r"g.jsonl:1: not JSON"):
        load_kvpress(garbage)
    empty = tmp_path / "e.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="e.jsonl holds no rows"):
        load_kvpress(empty)
    fake = tmp_path / "f.parquet"
    fake.write_bytes(b"PAR1 not really")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        message = r"is Parquet, which needs pyarrow: pip install 'kvlib\[parquet\]'"
    else:
        message = "not a readable Parquet file"
    with pytest.raises(ValueError, match=message):
        load_kvpress(fake)
    disguised = tmp_path / "p.jsonl"  # Parquet bytes under a .jsonl name
    disguised.write_bytes(b"PAR1 more")
    with pytest.raises(ValueError, match="Parquet"):
        load_kvpress(disguised)
    with pytest.raises(ValueError, match="not a regular file"):
        load_kvpress("/dev/zero")
    with pytest.raises(ValueError, match="kvpress file not found"):
        load_kvpress(tmp_path / "missing.jsonl")


def test_a_200_mb_line_is_refused_after_reading_at_most_the_cap(tmp_path):
    path = tmp_path / "long.jsonl"
    with path.open("wb") as handle:
        handle.write(b'{"context": "')
        handle.truncate(200 * 2**20)  # a sparse file: one 200 MB line, written in no time
    with pytest.raises(ValueError, match=r"long.jsonl:1: a line longer than 1024 bytes"):
        list(json_lines(path, max_line_bytes=1024))
    with pytest.raises(ValueError, match=r"long.jsonl:1: a line longer than 67108864 bytes"):
        load_kvpress(path)
    assert os.path.getsize(path) == 200 * 2**20


def test_kvpress_scorers():
    assert scorer_for(None).name == scorer_for("niah_multikey_2").name == scorer_for("vt").name == "string_match_all"
    assert scorer_for("qa_2").name == "string_match_part" and scorer_for("narrativeqa").name == "qa_f1"
    assert scorer_for("vt").score(" x1\x00, X2\n", ["X1", "x2", "x3"]) == pytest.approx(2 / 3)  # case-insensitive, control chars dropped
    assert scorer_for("qa_1").score("it is Paris", ["London", "paris"]) == 1.0
    assert kvpress_clean(" a\x01b\n") == "ab"
    assert scorer_for("hotpotqa").score("  the Eiffel tower", ["Eiffel Tower"]) == 1.0
    assert scorer_for("triviaqa").score("Paris\nand more words", ["Paris"]) == 1.0
    assert retrieval_score("Paragraph 3, not 5", ["Paragraph 3"]) == 0.5  # LongBench: right numbers over all numbers
    assert count_score("7", ["7"]) == 1.0 and count_score("none", ["7"]) == 0.0
    assert scorer_for("niah_single_1").binary_for(["1"]) and not scorer_for("niah_multivalue").binary_for(["1", "2"])
    assert not scorer_for("hotpotqa").binary_for(["a"])


def test_runs_on_the_tiny_model_with_pass_fail_cases(tmp_path, byte_model, tokenizer):
    path = write(tmp_path / "ruler.jsonl", [ROW, {**ROW, "context": "filler " * 60, "task": "niah_single_1"}, {**ROW, "task": "qa_1"}])
    task = KvpressTask(path=str(path), context=96)
    ids = task.prompt_ids(tokenizer, load_kvpress(path)[1])
    assert len(ids) <= 96 - 4 and tokenizer.decode(ids).endswith("What is the key? Answer:")
    result = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model, "snapkv", budget=max(1, tokens // 2)))
    assert result.samples == 3 and result.cases.kind == "pass_fail" and len(result.cases.values) == 3
    assert set(result.metrics["by_task"]) == {"", "niah_single_1", "qa_1"} and result.metrics["scorers"] == [
        "string_match_all",
        "string_match_part",
    ]
    again = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model))
    assert again.cases.pairs_with(result.cases)


def test_a_bad_file_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def never_load(name):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvlib.eval.load_model", never_load)
    path = write(tmp_path / "bad.jsonl", [_without("max_new_tokens")])
    assert cli.main(["compare", "--tasks", f"kvpress:{path}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlib: error: ") and "bad.jsonl:1: missing column(s) max_new_tokens" in err and err.count("\n") == 1
    big = write(tmp_path / "big.jsonl", [{**ROW, "max_new_tokens": 5000}])
    assert cli.main(["compare", "--tasks", f"kvpress:{big}", "--out", str(tmp_path / "out")]) == 2
    assert "a row asks for 5000 new tokens" in capsys.readouterr().err
