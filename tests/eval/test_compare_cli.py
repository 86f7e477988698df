"""``kvlib compare`` end to end on a tiny byte model, the report files, and the Pareto front."""

import csv
import importlib
import json

import pytest

from kvlib import cli
from kvlib.errors import quoted
from kvlib.eval.plots import pareto_front

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def compared(byte_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    argv = [
        "compare",
        "--model",
        str(byte_model_dir),
        "--context",
        "128",
        "--samples",
        "1",
        "--policies",
        "streaming_llm,snapkv(window=8)",
        "--budgets",
        "0.25,0.5",
        "--baseline",
        "streaming_llm",
        "--out",
        str(out),
        "--quiet",
    ]
    return out, argv


def test_writes_a_consistent_table_json_csv_and_one_png_per_task(compared, capsys):
    out, argv = compared
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "compare.json").read_text())
    runs = record["runs"]
    assert [(r["policy"], r["budget"]) for r in runs] == [
        ("full", None),
        ("streaming_llm", 0.25),
        ("streaming_llm", 0.5),
        ("snapkv(window=8)", 0.25),
        ("snapkv(window=8)", 0.5),
    ]
    assert record["tasks"] == ["needle", "perplexity", "agreement"] and record["context"] == 128 and record["complete"]
    assert all(r["error"] is None and set(r["tasks"]) == set(record["tasks"]) for r in runs)

    table = (out / "compare.md").read_text().splitlines()
    assert table[0] == (
        "| policy | budget | needle accuracy ↑ | perplexity ↓ | agreement ↑ | KV bytes vs full | decode tok/s | vs full | first call s |"
    )
    assert table == printed.splitlines()[: len(table)]
    for line, run in zip(table[2:], runs):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == run["policy"]
        assert float(cells[3].split()[0]) == pytest.approx(run["tasks"]["perplexity"]["score"], rel=1e-2)
        assert float(cells[5]) == pytest.approx(run["kv_fraction"], rel=1e-2)
        speed = run["decode_speed"]  # the default 3 rounds, each with the full cache's ratio; the median with its range
        assert speed["rounds"] == 3 and len(speed["tokens_per_s"]) == 3 and len(speed["vs_full"]) == 3
        assert speed["low"] <= speed["median"] == run["decode_tokens_per_s"] <= speed["high"]
        assert speed["vs_full_low"] <= speed["vs_full_median"] <= speed["vs_full_high"] and speed["first_call_s"] is not None
        assert cells[6] == f"{speed['median']:.3g} [{speed['low']:.3g}, {speed['high']:.3g}]"
        assert cells[7] == (
            "1.00"
            if run["policy"] == "full"
            else f"{speed['vs_full_median']:.2f} [{speed['vs_full_low']:.2f}, {speed['vs_full_high']:.2f}]"
        )
        assert float(cells[8]) == pytest.approx(speed["first_call_s"], abs=0.006)
    assert record["speed_rounds"] == 3 and record["speed_steps"] == 32
    assert "Decode tok/s: median [min, max] over 3 timed rounds, interleaved" in printed

    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert len(rows) == len(runs) * 3
    for row in rows:
        run = next(r for r in runs if r["policy"] == row["policy"] and str(r["budget"] or "") == row["budget"])
        assert float(row["score"]) == pytest.approx(run["tasks"][row["task"]]["score"])
        assert float(row["task_kv_fraction"]) == pytest.approx(run["tasks"][row["task"]]["kv_fraction"])
        assert float(row["decode_tokens_per_s"]) == run["decode_tokens_per_s"] and len(row["decode_rounds"].split(";")) == 3
        assert float(row["decode_vs_full_low"]) <= float(row["decode_vs_full"]) <= float(row["decode_vs_full_high"])

    statistics = record["statistics"]
    assert statistics["baseline"] == "streaming_llm" and statistics["same_cases"] == dict.fromkeys(record["tasks"], True)
    snapkv_quarter = runs[3]["tasks"]
    assert snapkv_quarter["needle"]["cases"]["kind"] == "pass_fail" and snapkv_quarter["needle"]["interval_method"] == "Wilson"
    assert snapkv_quarter["needle"]["vs_full"]["test"] == "exact McNemar"
    assert snapkv_quarter["needle"]["vs_baseline"]["against"] == "streaming_llm @ 0.25"
    assert snapkv_quarter["perplexity"]["interval"] is None  # one window: a bootstrap has no spread
    assert runs[1]["tasks"]["needle"]["vs_baseline"] is None and runs[0]["tasks"]["needle"]["vs_full"] is None
    assert "Cases (checked by digest): needle: the same 11 cases for every configuration" in printed
    assert {row["interval"] for row in rows} == {"Wilson", "no interval"}  # --samples 1: one window, one prompt

    full = runs[0]
    assert full["tasks"]["agreement"]["score"] == 1.0 and full["kv_fraction"] >= 1.0
    for run in runs[1:]:  # a token cap of budget x tokens, whole pages: bytes track the budget
        assert run["kv_fraction"] < run["budget"] + 0.3
        assert run["tasks"]["perplexity"]["kv_fraction"] < run["budget"] + 0.3
    for task in ("needle", "perplexity", "agreement"):
        png = (out / f"{task}.png").read_bytes()
        assert png.startswith(PNG_SIGNATURE) and len(png) > 5_000
    assert not list(out.glob("*.part")) and not list(out.glob(".kvlib-probe-*"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "needle,bogus"], "unknown task 'bogus'"),
        (["--policies", "snapkv(windw=3)"], "snapkv has no parameter 'windw'"),
        (["--policies", "nosuch"], "unknown policy"),
        (["--budgets", "0.5,2"], "budgets are fractions of the full cache in (0, 1], got [2.0]"),
        (["--budgets", "half"], "--budgets takes comma-separated fractions"),
        (["--context", "100000"], "needs"),
        (["--tasks", "jsonl:/no/such.jsonl"], "jsonl file not found"),
        (["--policies", "+".join(["h2o"] * 2000)], "a spec string has at most 4096 characters; got 7999: 'h2o+h2o"),
        (["--policies", "+".join(["a"] * 2000)], "a spec holds at most 64 policies"),
        (["--policies", "x" * 100_000], "a spec string has at most 4096 characters; got 100000: 'xxxx"),
        (["--tasks", "y" * 100_000], "unknown task 'yyyy"),
        (["--context-first"], "context_first needs tasks that ask a question apart from their context (niah_single"),
        (["--seed", str(2**80)], "--seed takes a whole number in [0, 2**63)"),
        (["--seed", "abc"], "--seed takes a whole number in [0, 2**63), got 'abc'"),
        (["--policies", "lru(device_mb=1e308)"], "device_mb=1e+308 MiB is more than the memory of this machine's largest device"),
        (["--policies", "rotated(seed=-1)"], "a seed is an int in [0, 2**63)"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(compared, capsys, extra, message):
    _, argv = compared
    assert cli.main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlib: error: ") and message in err and err.count("\n") == 1 and len(err) < 2_000


def never_load(name):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--baseline", "h2o"], "--baseline 'h2o' is not one of the policies run; choose from streaming_llm, snapkv(window=8)"),
        (["--baseline", "full"], "--baseline 'full' is not one of the policies run"),
        (["--baseline", "streaming_llm@0.3"], "budget 0.3 is not run; choose from 0.25, 0.5"),
        (["--baseline", "streaming_llm@x"], "'x' is not a budget such as 0.25"),
        (["--policies", "kivi(bits=4)", "--baseline", "kivi(bits=4)@0.25"], "keeps every token and runs once"),
    ],
)
def test_a_bad_baseline_is_refused_before_the_model_loads(compared, capsys, monkeypatch, extra, message):
    _, argv = compared
    monkeypatch.setattr("kvlib.eval.load_model", never_load)
    assert cli.main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlib: error: ") and message in err and err.count("\n") == 1


def refuse_probe(folder):
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("file", "exists and is not a folder"),
        ("file/sub", "cannot be written: Not a directory"),
        ("unwritable", "cannot be written: Permission denied"),
    ],
)
def test_an_unusable_out_folder_fails_before_the_model_loads(compared, capsys, monkeypatch, tmp_path, out, message):
    _, argv = compared
    (tmp_path / "file").write_text("keep me")
    if out == "unwritable":  # as root a read-only mode does not stop writes: refuse the probe instead
        monkeypatch.setattr("kvlib.eval.output_files.check_writable", refuse_probe)
    monkeypatch.setattr("kvlib.eval.load_model", never_load)
    assert cli.main(argv + ["--out", str(tmp_path / out)]) == 2
    assert capsys.readouterr().err == f"kvlib: error: --out {quoted(str(tmp_path / out))} {message}\n"
    assert (tmp_path / "file").read_text() == "keep me" and sorted(p.name for p in tmp_path.rglob("*")) == (
        ["file", "unwritable"] if out == "unwritable" else ["file"]
    )


def test_an_interrupted_comparison_keeps_every_finished_configuration(byte_model_dir, capsys, monkeypatch, tmp_path):
    """Ctrl-C during the second speed round: every configuration's tasks and the first round's
    speeds are in the table, JSON and CSV, marked incomplete; exit code 130 with one line on stderr."""
    module = importlib.import_module("kvlib.eval.compare_speed")
    speed_runs = []

    def interrupted_second_round(*args):
        speed_runs.append(1)
        if len(speed_runs) == 3 + 3 + 2:  # the warm-up and round 1 of the 3 configurations, then round 2's second
            raise KeyboardInterrupt
        return module_decode_once(*args)

    module_decode_once = module.decode_once
    monkeypatch.setattr(module, "decode_once", interrupted_second_round)
    argv = [
        "compare",
        "--model",
        str(byte_model_dir),
        "--context",
        "64",
        "--samples",
        "1",
        "--tasks",
        "perplexity",
        "--policies",
        "streaming_llm",
        "--budgets",
        "0.25,0.5",
        "--speed-steps",
        "4",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert cli.main(argv) == cli.INTERRUPTED == 130
    captured = capsys.readouterr()
    assert captured.err == f"\nkvlib compare: interrupted; the configurations that finished are in {tmp_path}\n"
    record = json.loads((tmp_path / "compare.json").read_text())
    assert record["complete"] is False
    assert [(r["policy"], r["budget"]) for r in record["runs"]] == [("full", None), ("streaming_llm", 0.25), ("streaming_llm", 0.5)]
    assert all(r["tasks"]["perplexity"]["score"] > 1 and r["decode_speed"]["rounds"] == 1 for r in record["runs"])
    rows = list(csv.DictReader((tmp_path / "compare.csv").open()))
    assert [(row["policy"], row["task"]) for row in rows] == [("full", "perplexity")] + [("streaming_llm", "perplexity")] * 2
    assert (tmp_path / "compare.md").read_text().splitlines()[2].startswith("| full | - |")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.csv", "compare.json", "compare.md"]


def test_speed_options_are_checked_before_the_model_loads(compared, capsys, monkeypatch):
    _, argv = compared
    monkeypatch.setattr("kvlib.eval.load_model", never_load)
    assert cli.main(argv + ["--speed-rounds", "0"]) == 2
    assert capsys.readouterr().err == "kvlib: error: --speed-rounds takes a whole number >= 1, got '0'\n"
    assert cli.main(argv + ["--speed-steps", "65"]) == 2  # --context 128
    assert capsys.readouterr().err == "kvlib: error: speed steps must be in [1, 64] (half of the 128-token context), got 65\n"


def test_a_model_that_cannot_be_loaded_is_one_line(capsys, tmp_path):
    assert cli.main(["compare", "--model", str(tmp_path / "missing"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"kvlib: error: cannot load model '{tmp_path / 'missing'}': no such folder\n"
    assert cli.main(["compare", "--model", str(tmp_path), "--quiet"]) == 2  # a folder with no model
    err = capsys.readouterr().err
    assert err.startswith(f"kvlib: error: cannot load model '{tmp_path}': ") and err.count("\n") == 1


def test_unknown_option_is_one_line(capsys):
    assert cli.main(["compare", "--bogus"]) == 2
    assert capsys.readouterr().err == "kvlib: error: unrecognized arguments: --bogus\n"


@pytest.mark.parametrize("higher", [True, False])
def test_pareto_front(higher):
    points = [(0.5, 0.9), (0.25, 0.5), (0.25, 0.7), (0.5, 0.6), (1.0, 0.95), (0.1, 0.1)]
    if higher:
        assert pareto_front(points, True) == [(0.1, 0.1), (0.25, 0.7), (0.5, 0.9), (1.0, 0.95)]
    else:  # lower is better: only ever-lower scores as bytes grow
        assert pareto_front(points, False) == [(0.1, 0.1)]


def test_codecs_run_alone_once_and_with_eviction_at_every_budget(byte_model_dir, tmp_path):
    argv = [
        "compare",
        "--model",
        str(byte_model_dir),
        "--context",
        "128",
        "--samples",
        "1",
        "--tasks",
        "perplexity",
        "--policies",
        "kivi(bits=4),streaming_llm+int8",
        "--budgets",
        "0.25,0.5",
        "--speed-steps",
        "4",
        "--speed-rounds",
        "1",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert cli.main(argv) == 0
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert [(r["policy"], r["budget"]) for r in runs] == [
        ("full", None),
        ("kivi(bits=4)", None),
        ("streaming_llm+int8", 0.25),
        ("streaming_llm+int8", 0.5),
    ]
    assert all(r["error"] is None for r in runs)
    kivi, int8_quarter = runs[1], runs[2]
    assert kivi["kv_fraction"] < 0.6  # 4-bit codes + scales, open pages in fp32
    assert int8_quarter["kv_fraction"] < 0.25


def test_ruler_tasks_are_offered_and_a_context_too_small_is_one_line(byte_model_dir, capsys, tmp_path):
    argv = [
        "compare",
        "--model",
        str(byte_model_dir),
        "--context",
        "192",
        "--tasks",
        "needle,niah_single",
        "--policies",
        "snapkv",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "niah_single: context 192 is too small" in error
    assert cli.main(["compare", "--tasks", "niah", "--out", str(tmp_path)]) == 2
    assert "niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, fwe" in capsys.readouterr().err
