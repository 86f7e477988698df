"""Plots a reader can use: x is the table's "KV bytes vs full", every point names its budget, the
title names task, model, context and samples, and coinciding points stay visible."""

from __future__ import annotations

from kvlib.eval.compare import CompareRun
from kvlib.eval.plots import plot_task, task_points, title
from kvlib.eval.report import markdown_table
from kvlib.eval.task import TaskResult


def _run(policy: str, budget: float | None, score: float, kv_bytes: int, task_bytes: int) -> CompareRun:
    result = TaskResult("niah_single", "string_match_all", score, True, task_bytes, 1000, {"context": 4096}, 20)
    return CompareRun(policy, budget, {"niah_single": result}, 10.0, kv_bytes, 1000)


RUNS = [
    _run("full", None, 1.0, 1000, 1000),
    _run("h2o+kivi(bits=4)", 0.5, 0.9, 86, 102),  # the speed run's bytes differ from the task's
    _run("h2o+kivi(bits=4)", 0.25, 0.7, 50, 60),
    _run("kivi(bits=4)", None, 0.95, 180, 190),
    _run("snapkv", 0.25, 0.7, 250, 250),
    _run("tova", 0.25, 0.7, 250, 250),  # on top of snapkv's point
]


def test_x_is_the_tables_kv_bytes_and_each_point_names_its_budget():
    assert task_points(RUNS, "niah_single", "h2o+kivi(bits=4)") == [(0.05, 0.7, "0.25"), (0.086, 0.9, "0.5")]
    assert task_points(RUNS, "niah_single", "kivi(bits=4)") == [(0.18, 0.95, "all")]
    table = markdown_table(RUNS)
    assert "| h2o+kivi(bits=4) | 0.5 | 0.9 | 0.086 |" in table


def test_the_title_names_task_model_context_and_samples():
    assert title("niah_single", "smollm2", RUNS) == "niah_single on smollm2: 4096 tokens, 20 samples"


def test_a_plot_with_coinciding_points_is_written(tmp_path):
    path = plot_task(RUNS, "niah_single", "string_match_all", True, tmp_path / "niah_single.png", "t")
    assert path.stat().st_size > 10_000


def test_failed_runs_are_left_out():
    failed = CompareRun("snapkv", 0.5, {}, None, 0, 0, error="RuntimeError: boom")
    assert task_points([*RUNS, failed], "niah_single", "snapkv") == [(0.25, 0.7, "0.25")]
