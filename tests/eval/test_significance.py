"""Per-case scores, baselines, the same-cases check and old result files (kvlib.eval.case_scores,
kvlib.eval.significance, kvlib.eval.report.runs_from_json)."""

import json
import math

import pytest

from kvlib.eval.case_scores import CaseScores, case_scores, cases_digest
from kvlib.eval.compare_units import CompareRun, DecodeSpeed
from kvlib.eval.report import csv_rows, markdown_table, runs_from_json, to_json
from kvlib.eval.significance import Baseline, paired, parse_baseline, same_cases
from kvlib.eval.task import TaskResult


def run(policy, budget, values, kind="pass_fail", cases=range(10), task="t"):
    scores = case_scores(values, kind, cases)
    result = TaskResult(task, "m", scores.aggregate.score(scores.values), True, 1, 2, {}, len(values), scores)
    return CompareRun(policy, budget, {task: result}, DecodeSpeed((1.0,)), 1, 2)


def test_case_scores_kinds():
    accuracy = case_scores([1, 0, 1, 1], "pass_fail", "abcd")
    assert accuracy.interval() == pytest.approx((0.3006, 0.9544), abs=1e-4)  # Wilson 3/4
    nll = case_scores([1.0, 2.0, 3.0], "exp_mean", "abc")
    assert nll.aggregate.score(nll.values) == pytest.approx(math.e**2)
    low, high = nll.interval()
    assert math.exp(1) <= low < math.exp(2) < high <= math.exp(3) * (1 + 1e-12)
    assert case_scores([0.5], "mean", "a").interval() is None  # one case: no bootstrap spread
    assert cases_digest(["a", (1, 2)]) == cases_digest(["a", (1, 2)]) != cases_digest([(1, 2), "a"])
    with pytest.raises(ValueError, match="unknown case score kind"):
        CaseScores((1.0,), "median", "x")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        CaseScores((0.5,), "pass_fail", "x")
    with pytest.raises(ValueError, match="same cases"):
        accuracy.paired_p(case_scores([1, 0, 1, 1], "pass_fail", "abce"))


def test_baselines_pair_by_budget_or_a_fixed_run():
    runs = [
        run("full", None, [1] * 10),
        run("snapkv", 0.25, [1] * 10),
        run("snapkv", 0.5, [1] * 10),
        run("h2o", 0.25, [0] * 10),
        run("kivi", None, [1] * 10),
    ]
    full, snap_quarter, snap_half, h2o, kivi = runs
    by_budget = Baseline("snapkv")
    assert by_budget.reference(h2o, runs) is snap_quarter and by_budget.reference(snap_quarter, runs) is None
    assert by_budget.reference(kivi, runs) is None and by_budget.reference(full, runs) is None
    assert Baseline("snapkv", 0.5).reference(h2o, runs) is snap_half and Baseline("kivi").reference(h2o, runs) is kivi
    result = paired(h2o, snap_quarter, "t")
    assert result.p == pytest.approx(2 / 2**10) and result.difference == -1.0 and result.significant
    assert parse_baseline(None, ["snapkv"], [0.5]) is None and parse_baseline("snapkv@0.5", ["snapkv"], [0.5]) == Baseline("snapkv", 0.5)


def test_different_cases_are_not_paired_and_the_report_says_so():
    runs = [run("full", None, [1] * 10), run("snapkv", 0.25, [0] * 10, cases=range(1, 11))]
    assert same_cases(runs, "t") is False and paired(runs[1], runs[0], "t") is None
    assert "t: cases DIFFER between configurations, no paired test" in markdown_table(runs)


def test_old_result_files_load_and_say_no_interval(tmp_path):
    record = to_json([run("full", None, [1] * 10), run("snapkv", 0.25, [1] * 9 + [0])], {"model": "m"})
    for entry in record["runs"]:
        for task in entry["tasks"].values():
            for key in ("cases", "interval", "interval_method", "vs_full", "vs_baseline"):
                del task[key]
    runs = runs_from_json(json.loads(json.dumps(record)))
    assert runs[1].results["t"].cases is None and runs[1].results["t"].score == 0.9
    table = markdown_table(runs, Baseline("snapkv"))
    assert "| snapkv | 0.25 | 0.9 (no interval) |" in table and "t: not checked (results recorded without per-case scores)" in table
    assert csv_rows(runs)[1]["interval"] == "no interval" and same_cases(runs, "t") is None
