"""One PNG per task: quality against KV bytes, every policy as a line over its budgets.

x: the configuration's KV bytes as a fraction of the full cache's, the table's "KV bytes vs full"
figure (:attr:`~kvlib.eval.compare_units.CompareRun.kv_fraction`, measured in the speed run), so a point
and its table row always agree; y: the task's score. Each point is labelled with its budget (a
policy that keeps every token, a codec alone, is labelled "all"). Each policy has its own colour
and marker pair (:func:`style`: no two policies of a plot share both), and its points carry their
95% intervals as error bars (:func:`kvlib.eval.significance.interval`; none for a result recorded
without per-case scores). Policies that land on the same spot stay visible: markers are hollow
and drawn smaller for each later policy, so coinciding points nest. When the bytes span more than
:data:`LOG_SPAN` times, the x axis is logarithmic. The Pareto front over all compressed points (no other point has fewer
bytes and a score at least as good) is a dashed step line; the full cache is a star with a dotted
reference line at its score. The title names the task, the model, the context and the sample
count. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from kvlib.eval.compare_units import FULL, CompareRun
from kvlib.eval.output_files import replace_file
from kvlib.eval.report import task_columns
from kvlib.eval.significance import interval

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""matplotlib's tab10 colours."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
LARGEST_MARKER, SMALLEST_MARKER = 13.0, 5.0
"""Marker sizes (points) of the first and the last policy; those between shrink evenly."""
LOG_SPAN = 10.0
"""Bytes spanning more than this ratio (largest / smallest) put the x axis on a log scale."""


def style(index: int) -> tuple[str, str]:
    """The ``(colour, marker)`` of the ``index``-th policy: colour ``index mod 10`` and marker
    ``(index + index // 10) mod 10``, so that the first 100 policies each get a different pair
    (two policies of one colour are ``10 q`` apart and their markers ``q`` apart)."""
    colour = COLOURS[index % len(COLOURS)]
    return colour, MARKERS[(index + index // len(COLOURS)) % len(MARKERS)]


def log_axis(fractions: Sequence[float]) -> bool:
    """Whether KV bytes spanning ``fractions`` (all > 0) need a log axis: more than :data:`LOG_SPAN` x."""
    positive = [f for f in fractions if f > 0]
    return bool(positive) and max(positive) / min(positive) > LOG_SPAN


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
    """The points no other point dominates (fewer or equal bytes and a score at least as good,
    one of them strictly), sorted by bytes."""
    sign = 1.0 if higher_is_better else -1.0
    front, best = [], None
    for x, y in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if best is None or sign * y > best:
            front.append((x, y))
            best = sign * y
    return front


def task_points(runs: Sequence[CompareRun], task: str, policy: str) -> list[tuple[float, float, str]]:
    """``(KV bytes vs full, score, budget label)`` of ``policy``'s runs that finished ``task``, by bytes."""
    return [(x, y, label) for x, y, label, _ in task_points_with_intervals(runs, task, policy)]


def task_points_with_intervals(
    runs: Sequence[CompareRun], task: str, policy: str
) -> list[tuple[float, float, str, tuple[float, float] | None]]:
    """:func:`task_points` with each point's 95% interval (None where it has none), by bytes."""
    return sorted(
        (
            (r.kv_fraction, r.results[task].score, "all" if r.budget is None else f"{r.budget:g}", interval(r.results[task]))
            for r in runs
            if r.policy == policy and task in r.results and r.kv_fraction is not None
        ),
        key=lambda point: point[:3],
    )


def error_bars(points: Sequence[tuple[float, float, str, tuple[float, float] | None]]) -> list[list[float]]:
    """``[below, above]`` distances from each score to its interval's ends (0 where it has none), for ``errorbar``'s ``yerr``."""
    return [
        [0.0 if bounds is None else max(0.0, y - bounds[0]) for _, y, _, bounds in points],
        [0.0 if bounds is None else max(0.0, bounds[1] - y) for _, y, _, bounds in points],
    ]


def title(task: str, model_name: str, runs: Sequence[CompareRun]) -> str:
    """``"<task> on <model>: <context> tokens, <n> samples"`` (from the full cache's result)."""
    result = next((r.results[task] for r in runs if task in r.results), None)
    context = result.metrics.get("context") if result is not None else None
    parts = ([f"{context} tokens"] if context else []) + ([f"{result.samples} samples"] if result and result.samples else [])
    return f"{task} on {model_name}" + (f": {', '.join(parts)}" if parts else "")


def plot_task(runs: Sequence[CompareRun], task: str, metric: str, higher_is_better: bool, path: Path, heading: str) -> Path:
    """Write the task's PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=110)
    policies = list(dict.fromkeys(r.policy for r in runs if r.policy != FULL))
    compressed = []
    for index, policy in enumerate(policies):
        points = task_points_with_intervals(runs, task, policy)
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        size = LARGEST_MARKER - (LARGEST_MARKER - SMALLEST_MARKER) * index / max(len(policies) - 1, 1)
        colour, marker = style(index)
        axes.errorbar(
            xs,
            ys,
            yerr=error_bars(points),
            color=colour,
            marker=marker,
            markersize=size,
            markerfacecolor="none",
            markeredgewidth=1.5,
            linewidth=1,
            elinewidth=0.8,
            capsize=2,
            alpha=0.85,
            label=policy,
        )
        for x, y, label, _ in points:
            axes.annotate(label, (x, y), textcoords="offset points", xytext=(4, 3 + 7 * (index % 3)), fontsize=7, color=colour)
        compressed += [(x, y) for x, y, _, _ in points]
    front = pareto_front(compressed, higher_is_better)
    if front:
        axes.step(*zip(*front), where="post", linestyle="--", color="grey", linewidth=1, label="Pareto front")
    for run in runs:
        if run.policy == FULL and task in run.results and run.kv_fraction is not None:
            score = run.results[task].score
            axes.axhline(score, linestyle=":", color="black", linewidth=1)
            full_points = [(run.kv_fraction, score, "", interval(run.results[task]))]
            axes.errorbar(
                [run.kv_fraction],
                [score],
                yerr=error_bars(full_points),
                marker="*",
                markersize=14,
                color="black",
                capsize=2,
                linestyle="",
                label="full cache",
            )
    fractions = [r.kv_fraction for r in runs if task in r.results and r.kv_fraction is not None]
    if log_axis(fractions):
        axes.set_xscale("log")
    axes.set_xlabel('KV bytes / full cache (the table\'s "KV bytes vs full"' + (", log scale)" if log_axis(fractions) else ")"))
    axes.set_ylabel(f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")
    axes.set_title(heading, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(figure)
    replace_file(path, image.getvalue())  # never through a link planted at path (:mod:`~kvlib.eval.output_files`)
    return path


def write_plots(runs: Sequence[CompareRun], out: Path, model_name: str) -> list[Path]:
    """One ``<task>.png`` per task in ``out`` (``:`` in a task name becomes ``_``)."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_task(runs, task, metric, up, out / f"{task.replace(':', '_')}.png", title(task, model_name, runs))
        for task, metric, up in task_columns(runs)
    ]
