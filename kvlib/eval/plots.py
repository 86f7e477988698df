"""One PNG per task: quality against KV bytes, every policy as a line over its budgets.

x: the configuration's KV bytes as a fraction of the full cache's, the table's "KV bytes vs full"
figure (:attr:`~kvlib.eval.compare.CompareRun.kv_fraction`, measured in the speed run), so a point
and its table row always agree; y: the task's score. Each point is labelled with its budget (a
policy that keeps every token, a codec alone, is labelled "all"). Policies that land on the same
spot stay visible: each has its own hollow marker shape, drawn smaller for each later policy, so
coinciding points nest. The Pareto front over all compressed points (no other point has fewer
bytes and a score at least as good) is a dashed step line; the full cache is a star with a dotted
reference line at its score. The title names the task, the model, the context and the sample
count. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvlib.eval.compare import FULL, CompareRun
from kvlib.eval.report import task_columns

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
LARGEST_MARKER, SMALLEST_MARKER = 13.0, 5.0
"""Marker sizes (points) of the first and the last policy; those between shrink evenly."""


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
    return sorted(
        (r.kv_fraction, r.results[task].score, "all" if r.budget is None else f"{r.budget:g}")
        for r in runs
        if r.policy == policy and task in r.results and r.kv_fraction is not None
    )


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
        points = task_points(runs, task, policy)
        if not points:
            continue
        xs, ys, labels = zip(*points)
        size = LARGEST_MARKER - (LARGEST_MARKER - SMALLEST_MARKER) * index / max(len(policies) - 1, 1)
        line = axes.plot(
            xs,
            ys,
            marker=MARKERS[index % len(MARKERS)],
            markersize=size,
            markerfacecolor="none",
            markeredgewidth=1.5,
            linewidth=1,
            alpha=0.85,
            label=policy,
        )[0]
        for x, y, label in points:
            axes.annotate(label, (x, y), textcoords="offset points", xytext=(4, 3 + 7 * (index % 3)), fontsize=7, color=line.get_color())
        compressed += [(x, y) for x, y, _ in points]
    front = pareto_front(compressed, higher_is_better)
    if front:
        axes.step(*zip(*front), where="post", linestyle="--", color="grey", linewidth=1, label="Pareto front")
    for run in runs:
        if run.policy == FULL and task in run.results and run.kv_fraction is not None:
            score = run.results[task].score
            axes.axhline(score, linestyle=":", color="black", linewidth=1)
            axes.plot([run.kv_fraction], [score], marker="*", markersize=14, color="black", linestyle="", label="full cache")
    axes.set_xlabel('KV bytes / full cache (the table\'s "KV bytes vs full")')
    axes.set_ylabel(f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")
    axes.set_title(heading, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def write_plots(runs: Sequence[CompareRun], out: Path, model_name: str) -> list[Path]:
    """One ``<task>.png`` per task in ``out`` (``:`` in a task name becomes ``_``)."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_task(runs, task, metric, up, out / f"{task.replace(':', '_')}.png", title(task, model_name, runs))
        for task, metric, up in task_columns(runs)
    ]
