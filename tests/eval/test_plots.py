"""Plots a reader can use: x is the table's "KV bytes vs full", every point names its budget, the
title names task, model, context and samples, coinciding points stay visible, every policy has its
own colour and marker, scores carry their intervals as error bars, and wide byte ranges are on a
log axis."""

from __future__ import annotations

import matplotlib

from kvlib.eval.case_scores import case_scores
from kvlib.eval.compare_units import CompareRun, DecodeSpeed
from kvlib.eval.plots import error_bars, log_axis, plot_task, style, task_points, task_points_with_intervals, title
from kvlib.eval.report import markdown_table
from kvlib.eval.task import TaskResult


def _run(policy: str, budget: float | None, score: float, kv_bytes: int, task_bytes: int) -> CompareRun:
    result = TaskResult("niah_single", "string_match_all", score, True, task_bytes, 1000, {"context": 4096}, 20)
    return CompareRun(policy, budget, {"niah_single": result}, DecodeSpeed((10.0,)), kv_bytes, 1000)


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
    assert "| h2o+kivi(bits=4) | 0.5 | 0.9 (no interval) | 0.086 |" in table  # recorded without per-case scores


def test_the_title_names_task_model_context_and_samples():
    assert title("niah_single", "smollm2", RUNS) == "niah_single on smollm2: 4096 tokens, 20 samples"


def test_a_plot_with_coinciding_points_is_written(tmp_path):
    path = plot_task(RUNS, "niah_single", "string_match_all", True, tmp_path / "niah_single.png", "t")
    assert path.stat().st_size > 10_000


def test_failed_runs_are_left_out():
    failed = CompareRun("snapkv", 0.5, {}, None, 0, 0, error="RuntimeError: boom")
    assert task_points([*RUNS, failed], "niah_single", "snapkv") == [(0.25, 0.7, "0.25")]


def test_every_policy_has_its_own_colour_and_marker_pair():
    pairs = [style(index) for index in range(100)]
    assert len(set(pairs)) == 100
    # the README's clash: policies 1 and 11 (h2o and snapkv+kivi(bits=4)) were both orange squares
    assert style(1)[0] == style(11)[0] and style(1)[1] != style(11)[1]


def _scored(policy: str, budget: float | None, passed: list[int], kv_bytes: int) -> CompareRun:
    cases = case_scores(passed, "pass_fail", range(len(passed)))
    result = TaskResult("niah_single", "string_match_all", sum(passed) / len(passed), True, kv_bytes, 1000, {}, len(passed), cases)
    return CompareRun(policy, budget, {"niah_single": result}, DecodeSpeed((10.0,)), kv_bytes, 1000)


def test_intervals_become_error_bars_and_wide_bytes_a_log_axis(tmp_path, monkeypatch):
    runs = [
        _scored("full", None, [1] * 10, 1000),
        _scored("snapkv", 0.01, [1] * 5 + [0] * 5, 10),
        _scored("snapkv", 0.5, [1] * 9 + [0], 500),
    ]
    points = task_points_with_intervals(runs, "niah_single", "snapkv")
    assert [p[:3] for p in points] == [(0.01, 0.5, "0.01"), (0.5, 0.9, "0.5")]
    below, above = error_bars(points)
    assert below[0] == above[0] and round(below[0], 4) == round(0.5 - 0.2366, 4)  # Wilson 5/10: [0.2366, 0.7634]
    assert error_bars([(0.2, 0.7, "x", None)]) == [[0.0], [0.0]]  # no interval: no bar
    assert log_axis([0.01, 0.5, 1.0]) and not log_axis([0.2, 0.5, 1.0])

    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def keep(figure, *args, **kwargs):
        captured["figure"] = figure
        return real_savefig(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    plot_task(runs, "niah_single", "string_match_all", True, tmp_path / "n.png", "t")
    axes = captured["figure"].axes[0]
    assert axes.get_xscale() == "log" and "log scale" in axes.get_xlabel()
    assert len(axes.containers) == 2  # snapkv's error bars and the full cache's
