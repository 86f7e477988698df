"""One PNG per task: quality against KV bytes, every policy as a line over its budgets.

x: the task's KV bytes as a fraction of the full cache's (measured at the end of the task);
y: the task's score. The Pareto front over all compressed points (no other point has fewer bytes
and a score at least as good) is drawn as a dashed step line; the full cache is a star at its own
bytes with a dotted reference line at its score. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvlib.eval.compare import FULL, CompareRun
from kvlib.eval.report import task_columns


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


def plot_task(runs: Sequence[CompareRun], task: str, metric: str, higher_is_better: bool, path: Path, title: str) -> Path:
    """Write the task's PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=110)
    compressed = []
    for policy in dict.fromkeys(r.policy for r in runs if r.policy != FULL):
        points = sorted(
            (r.results[task].kv_fraction, r.results[task].score) for r in runs if r.policy == policy and task in r.results
        )
        if points:
            axes.plot(*zip(*points), marker="o", label=policy)
            compressed += points
    front = pareto_front(compressed, higher_is_better)
    if front:
        axes.step(*zip(*front), where="post", linestyle="--", color="grey", linewidth=1, label="Pareto front")
    for run in runs:
        if run.policy == FULL and task in run.results:
            full = run.results[task]
            axes.axhline(full.score, linestyle=":", color="black", linewidth=1)
            axes.plot([full.kv_fraction], [full.score], marker="*", markersize=14, color="black", linestyle="", label="full cache")
    axes.set_xlabel("KV bytes / full cache")
    axes.set_ylabel(f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def write_plots(runs: Sequence[CompareRun], out: Path, model_name: str) -> list[Path]:
    """One ``<task>.png`` per task in ``out`` (``:`` in a task name becomes ``_``)."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_task(runs, task, metric, up, out / f"{task.replace(':', '_')}.png", f"{task} on {model_name}")
        for task, metric, up in task_columns(runs)
    ]
