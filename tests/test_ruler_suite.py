"""benchmarks/ruler_suite.py: what it records is read back whole, a rerun skips what is done, and
runs made with other options are never mixed in (no model is run: the runs are made by hand)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvlib.eval.case_scores import case_scores
from kvlib.eval.compare_units import CompareRun, DecodeSpeed
from kvlib.eval.report import runs_from_json
from kvlib.eval.significance import parse_baseline
from kvlib.eval.task import TaskResult

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("ruler_suite", BENCHMARKS / "ruler_suite.py")
ruler_suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ruler_suite)

OPTIONS = {
    "model": "smollm2",
    "dtype": "float32",
    "context": 4096,
    "samples": 1,
    "seed": 0,
    "speed_steps": 16,
    "context_first": False,
}


def made_run(policy: str, budget: float | None, score: float, error: str | None = None) -> CompareRun:
    run = CompareRun(policy, budget, speed=DecodeSpeed((12.5,)), error=error)
    run.kv_bytes, run.full_bytes = 250, 1000
    if error is None:
        run.results["niah_single"] = TaskResult("niah_single", "string_match_all", score, True, 25, 100, {"per_sample": [score]}, 1)
        run.results["vt"] = TaskResult("vt", "string_match_all", 0.5, True, 25, 100, {}, 1)
    return run


def test_recorded_runs_read_back_whole_and_render(tmp_path: Path) -> None:
    runs = [made_run("snapkv", 0.25, 1.0), made_run("full", None, 1.0), made_run("h2o", 0.1, 0.0, error="ValueError: bad")]
    meta = {
        "options": {**OPTIONS, "tasks": "niah_single,vt"},
        "command": "python benchmarks/ruler_suite.py",
        "git": "abc",
        "seconds": {"snapkv @ 0.25": 40},
        "load": {"snapkv @ 0.25": 1.5},
    }
    ruler_suite.write(tmp_path, runs, meta)
    back = ruler_suite.load_runs(tmp_path / "ruler_suite.json", OPTIONS)
    assert [(r.policy, r.budget) for r in back] == [("full", None), ("h2o", 0.1), ("snapkv", 0.25)]  # full first, then sorted
    snap = back[2]
    assert snap.results["niah_single"] == runs[0].results["niah_single"] and snap.kv_fraction == 0.25
    assert back[1].error == "ValueError: bad" and not back[1].results
    table = (tmp_path / "ruler_suite.md").read_text()
    # recorded without per-case scores: no interval, no test
    # and its speed before rounds were kept: one figure, no ratio, no first call
    assert (
        "| snapkv | 0.25 | 1.00 (no interval) | 0.50 (no interval) | 0.75 (no interval) | 0.250 | 12.50 (1 run) | - | - | 40 | 1.5 |"
        in table
    )
    assert "- h2o @ 0.1: ValueError: bad" in table
    assert "| policy | mean @ 0.1 | mean @ 0.25 | bytes @ 0.1 | bytes @ 0.25 | tok/s @ 0.1 | tok/s @ 0.25 |" in table
    assert "| full | 0.75 (no interval) | 0.75 (no interval) | 0.250 | 0.250 | 12.50 (1 run) | 12.50 (1 run) |" in table  # in every column
    assert (
        "| snapkv | - | 0.75 (no interval) | - | 0.250 | - | 12.50 (1 run) |" in table
        and "| h2o |" not in table.split("Each configuration")[0]
    )


def test_runs_made_with_other_options_are_refused(tmp_path: Path) -> None:
    meta = {"options": {**OPTIONS, "tasks": "niah_single,vt"}, "command": "", "git": "", "seconds": {}, "load": {}}
    ruler_suite.write(tmp_path, [made_run("full", None, 1.0)], meta)
    with pytest.raises(ValueError, match="other options.*context"):
        ruler_suite.load_runs(tmp_path / "ruler_suite.json", {**OPTIONS, "context": 2048})
    assert json.loads((tmp_path / "ruler_suite.json").read_text())["runs"][0]["policy"] == "full"  # nothing lost


def test_context_first_runs_have_their_own_files_and_older_files_read_as_not_context_first(tmp_path: Path) -> None:
    apart = {**OPTIONS, "context_first": True}
    meta = {"options": {**apart, "tasks": "niah_single,vt"}, "command": "", "git": "", "seconds": {}, "load": {}}
    ruler_suite.write(tmp_path, [made_run("kvzip", 0.25, 1.0)], meta)
    assert not (tmp_path / "ruler_suite.json").exists()
    assert "Context first (kvpress's protocol)" in (tmp_path / "ruler_suite_context_first.md").read_text()
    assert ruler_suite.load_runs(tmp_path / "ruler_suite_context_first.json", apart)[0].policy == "kvzip"
    with pytest.raises(ValueError, match="other options.*context_first"):
        ruler_suite.load_runs(tmp_path / "ruler_suite_context_first.json", OPTIONS)
    older = {k: v for k, v in OPTIONS.items() if k != "context_first"}  # recorded before the option existed
    ruler_suite.write(tmp_path, [made_run("snapkv", 0.25, 1.0)], {**meta, "options": {**OPTIONS, "tasks": "niah_single,vt"}})
    recorded = json.loads((tmp_path / "ruler_suite.json").read_text())
    (tmp_path / "ruler_suite.json").write_text(json.dumps({**recorded, "options": older}))
    assert ruler_suite.load_runs(tmp_path / "ruler_suite.json", OPTIONS)[0].policy == "snapkv"


def test_a_profile_in_kvlib_s_cache_is_named_by_its_place_there(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path / "cache"))
    spec = f"duo_attention(profile={str(tmp_path / 'cache' / 'profiles' / 'p.json')!r})"
    meta = {"options": {**OPTIONS, "tasks": "niah_single,vt"}, "command": "", "git": "", "seconds": {}, "load": {}}
    ruler_suite.write(tmp_path, [made_run(spec, 0.25, 1.0)], meta)
    table = (tmp_path / "ruler_suite.md").read_text()
    assert "| duo_attention(profile='<kvlib cache>/profiles/p.json') | 0.25 |" in table and str(tmp_path / "cache") not in table
    assert ruler_suite.load_runs(tmp_path / "ruler_suite.json", OPTIONS)[0].policy == spec  # the record keeps the real path


def test_recorded_configurations_speeds_are_measured_again_with_the_full_cache_s(tmp_path: Path) -> None:
    """--speed-only: the chosen configurations and the full cache, warmed up and timed in interleaved
    rounds; their speeds, ratios, bytes and loads replaced, their scores and the others' speeds kept."""
    common = ["--model", "default", "--budgets", "0.5", "--context", "768", "--samples", "1", "--speed-steps", "4", "--threads", "1"]
    runs = [made_run("full", None, 1.0), made_run("streaming_llm", 0.5, 1.0), made_run("snapkv", 0.5, 1.0)]
    meta = {"options": {**OPTIONS, "model": "default", "context": 768, "speed_steps": 4, "tasks": "niah_single,vt"}}
    ruler_suite.write(tmp_path, runs, {**meta, "command": "python x.py", "git": "abc", "seconds": {}, "load": {"full": 25.0}})
    argv = [*common, "--policies", "streaming_llm", "--tasks", "niah_single", "--speed-only", "--speed-rounds", "2", "--out", str(tmp_path)]
    assert ruler_suite.main(argv) == 0
    back = {run.policy: run for run in ruler_suite.load_runs(tmp_path / "ruler_suite.json", meta["options"])}
    for policy in ("full", "streaming_llm"):
        speed = back[policy].speed
        assert len(speed.tokens_per_s) == 2 and len(speed.vs_full) == 2 and speed.first_call_s is not None
        assert back[policy].results["niah_single"].score == 1.0 and back[policy].full_bytes > 0
    assert back["full"].speed.vs_full == (1.0, 1.0) and 0.4 <= back["streaming_llm"].kv_fraction <= 0.6  # half, up to page rounding
    assert back["snapkv"].speed == DecodeSpeed((12.5,)) and back["snapkv"].kv_fraction == 0.25  # not chosen: kept
    record = json.loads((tmp_path / "ruler_suite.json").read_text())
    assert record["command"] == "python x.py" and record["load"]["full"] != 25.0 and "snapkv @ 0.5" not in record["load"]
    assert record["speed_runs"][0]["command"].startswith("python benchmarks/ruler_suite.py") and record["speed_runs"][0]["rounds"] == 2
    assert "decode speeds measured again by `python benchmarks/ruler_suite.py" in (tmp_path / "ruler_suite.md").read_text()


def scored_run(policy: str, budget: float | None, passed: list[int]) -> CompareRun:
    run = CompareRun(policy, budget, speed=DecodeSpeed((12.5,)))
    run.kv_bytes, run.full_bytes = 250, 1000
    for task in ("niah_single", "vt"):
        cases = case_scores(passed, "pass_fail", [(task, i) for i in range(len(passed))])
        run.results[task] = TaskResult(task, "string_match_all", sum(passed) / len(passed), True, 25, 100, {}, len(passed), cases)
    return run


def test_scores_carry_intervals_and_paired_tests_against_full_and_the_baseline(tmp_path: Path) -> None:
    runs = [
        scored_run("full", None, [1] * 20),
        scored_run("snapkv", 0.25, [1] * 19 + [0]),
        scored_run("h2o", 0.25, [0] * 20),
    ]
    meta = {"options": {**OPTIONS, "tasks": "niah_single,vt", "samples": 20}, "command": "", "git": "", "seconds": {}, "load": {}}
    ruler_suite.write(tmp_path, runs, meta, parse_baseline("snapkv", ["snapkv", "h2o"], [0.25]))
    table = (tmp_path / "ruler_suite.md").read_text()
    # Wilson 19/20 = [0.7639, 0.9911]; h2o fails all 20: McNemar p = 2 / 2**20 against full (20 discordant), 2 / 2**19 against snapkv (19)
    assert "| snapkv | 0.25 | 0.95 [0.76, 0.99] | 0.95 [0.76, 0.99] |" in table
    assert "| h2o | 0.25 | 0.00 [0.00, 0.16] *▼ | 0.00 [0.00, 0.16] *▼ | 0.00 [0.00, 0.00] *▼ |" in table
    assert "Cases (checked by digest): niah_single: the same 20 cases for every configuration" in table
    assert "▲ / ▼: better / worse than the baseline snapkv at the same budget" in table
    record = json.loads((tmp_path / "ruler_suite.json").read_text())
    h2o = next(r for r in record["runs"] if r["policy"] == "h2o")["tasks"]["vt"]
    assert h2o["vs_full"]["p"] == 2 / 2**20 and h2o["vs_baseline"]["p"] == 2 / 2**19
    assert record["statistics"]["baseline"] == "snapkv" and record["statistics"]["same_cases"] == {"niah_single": True, "vt": True}
    assert (
        ruler_suite.load_runs(tmp_path / "ruler_suite.json", {**OPTIONS, "samples": 20})[1].results["vt"].cases
        == runs[2].results["vt"].cases
    )


def test_a_task_the_full_cache_fails_is_left_out_of_the_means(tmp_path: Path) -> None:
    full, snap = scored_run("full", None, [1] * 10), scored_run("snapkv", 0.25, [1] * 5 + [0] * 5)
    full.results["vt"] = scored_run("full", None, [1] * 4 + [0] * 6).results["vt"]  # 0.4: under RANKED_FROM
    meta = {"options": {**OPTIONS, "tasks": "niah_single,vt", "samples": 10}, "command": "", "git": "", "seconds": {}, "load": {}}
    ruler_suite.write(tmp_path, [full, snap], meta)
    table = (tmp_path / "ruler_suite.md").read_text()
    assert (
        "Mean score over niah_single at each budget" in table
        and "left out of the means: vt, where the full cache itself scores under 0.5" in table
    )
    assert "| full | - | 1.00 [0.72, 1.00] | 0.40 [0.17, 0.69] | 1.00 [1.00, 1.00] |" in table  # the mean is niah_single's alone
    assert ruler_suite.ranked_tasks([snap], ["niah_single", "vt"]) == ["niah_single", "vt"]  # before the full cache ran: every task
    del full.results["vt"]
    assert ruler_suite.ranked_tasks([full, snap], ["niah_single", "vt"]) == ["niah_single", "vt"]  # a task it has not run yet stays


@pytest.mark.slow  # two runs of the suite's script (the tests above check its parts); .ci/run runs it after the suite
def test_a_rerun_adds_the_tasks_and_configurations_the_file_lacks(tmp_path: Path) -> None:
    common = ["--model", "default", "--budgets", "0.5", "--context", "768", "--samples", "2", "--speed-steps", "2", "--threads", "1"]
    assert ruler_suite.main([*common, "--policies", "streaming_llm", "--tasks", "niah_single", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "ruler_suite.json").read_text())
    assert [(r["policy"], sorted(r["tasks"])) for r in record["runs"]] == [("full", ["niah_single"]), ("streaming_llm", ["niah_single"])]
    assert all(r["prefill"] == {"niah_single": "shared", "decode speed": "shared"} for r in record["runs"])
    before = record["runs"][1]["tasks"]["niah_single"]
    assert (
        ruler_suite.main([*common, "--policies", "streaming_llm,snapkv", "--tasks", "niah_single,niah_multikey", "--out", str(tmp_path)])
        == 0
    )
    record = json.loads((tmp_path / "ruler_suite.json").read_text())
    assert record["options"]["tasks"] == "niah_single,niah_multikey" and set(record["task_seconds"]) == {"niah_single", "niah_multikey"}
    assert [run["command"].split("--policies ")[1].split()[0] for run in record["runs_before"]] == [
        "streaming_llm"
    ]  # the first command kept
    assert record["command"].split("--policies ")[1].startswith("streaming_llm,snapkv")
    table = (tmp_path / "ruler_suite.md").read_text()
    assert "--policies streaming_llm --tasks niah_single" in table and "; then `" in table
    by_policy = {r["policy"]: r for r in record["runs"]}
    assert {p: sorted(r["tasks"]) for p, r in by_policy.items()} == dict.fromkeys(
        ["full", "snapkv", "streaming_llm"], ["niah_multikey", "niah_single"]
    )
    assert by_policy["streaming_llm"]["tasks"]["niah_single"] == before  # kept, not run again
    assert all(r["decode_tokens_per_s"] > 0 for r in record["runs"])
    with pytest.raises(ValueError, match="other options.*dtype"):
        ruler_suite.main([*common, "--dtype", "bfloat16", "--tasks", "niah_multikey", "--out", str(tmp_path)])


def test_the_readme_table_is_rendered_from_the_record_between_its_markers(tmp_path: Path) -> None:
    runs = [scored_run("full", None, [1] * 20), scored_run("snapkv", 0.25, [1] * 19 + [0]), scored_run("kivi(bits=4)", None, [1] * 20)]
    meta = {
        "options": {**OPTIONS, "tasks": "niah_single,vt", "samples": 20},
        "command": "python x.py",
        "git": "abc",
        "seconds": {},
        "load": {},
    }
    block = ruler_suite.readme_block(ruler_suite.sorted_runs(runs), meta, "benchmarks/results/r")
    begin, end = ruler_suite.readme_markers("benchmarks/results/r")
    assert block.startswith(begin) and block.endswith(end)
    assert "smollm2 at 4096 tokens (float32), 20 cases per task" in block and "`benchmarks/results/r/ruler_suite.md`" in block
    assert "| policy | mean @ 0.25 | bytes @ 0.25 |" in block and "tok/s" not in block
    assert "| kivi(bits=4) | 1.00 [1.00, 1.00] | 0.250 |" in block  # a codec: no budget; the mean bootstraps over each task's cases
    other_begin, other_end = ruler_suite.readme_markers("benchmarks/results/other")  # another model's table stays
    other = f"{other_begin}\nits table\n{other_end}"
    text = f"# kvlib\n\nbefore\n{begin}\nold table\n{end}\n{other}\nafter\n"
    assert ruler_suite.replace_readme_block(text, block, "benchmarks/results/r") == f"# kvlib\n\nbefore\n{block}\n{other}\nafter\n"
    with pytest.raises(ValueError, match="no ruler_suite block for benchmarks/results/r"):
        ruler_suite.replace_readme_block(f"# kvlib\n{other}\n", block, "benchmarks/results/r")


def test_the_table_s_task_columns_keep_ruler_s_order_whatever_order_runs_added_them_in() -> None:
    assert ruler_suite.task_order(["vt", "niah_multivalue", "niah_single", "vt", "mine", "niah_multiquery"]) == [
        "niah_single",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "mine",
    ]


@pytest.mark.parametrize("results", ["benchmarks/results/ruler_smollm2", "benchmarks/results/ruler_gemma3"])
def test_the_readme_s_table_is_the_one_the_committed_record_renders(results: str) -> None:
    record = json.loads((BENCHMARKS.parent / results / "ruler_suite.json").read_text())
    runs = ruler_suite.sorted_runs(runs_from_json(record))
    baseline = parse_baseline(record["statistics"]["baseline"], [r.policy for r in runs if r.policy != "full"], [0.1, 0.25, 0.5])
    block = ruler_suite.readme_block(runs, record, results, baseline)
    for page in ("README.md", "docs/results.md"):
        assert block in (BENCHMARKS.parent / page).read_text(), (
            f"{page}'s table is stale: python benchmarks/ruler_suite.py --report-only --readme {page} --out {results} --baseline snapkv"
        )


def test_a_passed_task_some_configuration_lacks_waits_outside_the_means(tmp_path: Path) -> None:
    full, snap = scored_run("full", None, [1] * 10), scored_run("snapkv", 0.25, [1] * 5 + [0] * 5)
    del snap.results["vt"]  # not run yet
    meta = {"options": {**OPTIONS, "tasks": "niah_single,vt", "samples": 10}, "command": "", "git": "", "seconds": {}, "load": {}}
    ruler_suite.write(tmp_path, [full, snap], meta)
    table = (tmp_path / "ruler_suite.md").read_text()
    assert (
        "Mean score over niah_single at each budget" in table
        and "not yet run by every configuration, so out of the means for now: vt" in table
    )
    assert "| snapkv | 0.50 [0.20, 0.80] * | 0.250 | 12.50 (1 run) |" in table  # the mean: niah_single alone, bootstrapped
