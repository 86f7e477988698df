"""Writing a comparison: the terminal's markdown table, JSON and CSV.

Table: one row per configuration (the full cache first), one column per task score, then KV
bytes as a fraction of the full cache's and decode tokens/s (both from the speed run). JSON:
everything, per task metrics included. CSV: one row per (policy, budget, task).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvlib.eval.compare import CompareRun

CSV_FIELDS = (
    "policy",
    "budget",
    "task",
    "metric",
    "score",
    "higher_is_better",
    "task_kv_bytes",
    "task_full_bytes",
    "task_kv_fraction",
    "decode_tokens_per_s",
    "kv_fraction",
    "error",
)


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def task_columns(runs: Sequence[CompareRun]) -> list[tuple[str, str, bool]]:
    """``(task, metric, higher_is_better)`` of every task, in the order they ran."""
    seen: dict[str, tuple[str, str, bool]] = {}
    for run in runs:
        for name, result in run.results.items():
            seen.setdefault(name, (name, result.metric, result.higher_is_better))
    return list(seen.values())


def markdown_table(runs: Sequence[CompareRun]) -> str:
    """The comparison as a markdown table (arrows give each metric's better direction)."""
    columns = task_columns(runs)
    header = ["policy", "budget"] + [f"{t if t == m else f'{t} {m}'} {'↑' if up else '↓'}" for t, m, up in columns]
    header += ["KV bytes vs full", "decode tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [run.policy, "-" if run.budget is None else f"{run.budget:g}"]
        cells += [_number(run.results[t].score) if t in run.results else "error" for t, _, _ in columns]
        cells += [_number(run.kv_fraction), _number(run.decode_tokens_per_s)]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {run.label}: {run.error}" for run in runs if run.error]
    return "\n".join(lines + ([""] + errors if errors else []))


def to_json(runs: Sequence[CompareRun], meta: dict) -> dict:
    """A JSON-ready record of the comparison and how it was run (``meta``)."""
    return {
        **meta,
        "runs": [
            {
                "policy": run.policy,
                "budget": run.budget,
                "decode_tokens_per_s": run.decode_tokens_per_s,
                "kv_bytes": run.kv_bytes,
                "full_bytes": run.full_bytes,
                "kv_fraction": run.kv_fraction,
                "error": run.error,
                "tasks": {
                    name: {
                        "metric": r.metric,
                        "score": r.score,
                        "higher_is_better": r.higher_is_better,
                        "kv_bytes": r.kv_bytes,
                        "full_bytes": r.full_bytes,
                        "kv_fraction": r.kv_fraction,
                        "samples": r.samples,
                        "metrics": r.metrics,
                    }
                    for name, r in run.results.items()
                },
            }
            for run in runs
        ],
    }


def csv_rows(runs: Sequence[CompareRun]) -> list[dict]:
    """One row per (policy, budget, task); a failed configuration gets one row with its error."""
    rows = []
    for run in runs:
        common = {
            "policy": run.policy,
            "budget": "" if run.budget is None else run.budget,
            "decode_tokens_per_s": run.decode_tokens_per_s or "",
            "kv_fraction": run.kv_fraction or "",
            "error": run.error or "",
        }
        for name, r in run.results.items():
            rows.append(
                {
                    **common,
                    "task": name,
                    "metric": r.metric,
                    "score": r.score,
                    "higher_is_better": r.higher_is_better,
                    "task_kv_bytes": r.kv_bytes,
                    "task_full_bytes": r.full_bytes,
                    "task_kv_fraction": r.kv_fraction,
                }
            )
        if not run.results:
            rows.append(common)
    return rows


def csv_text(runs: Sequence[CompareRun]) -> str:
    """:func:`csv_rows` as CSV text, with a header."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, restval="")
    writer.writeheader()
    writer.writerows(csv_rows(runs))
    return buffer.getvalue()


def write_results(runs: Sequence[CompareRun], out: Path, meta: dict) -> dict[str, Path]:
    """Write ``compare.md``, ``compare.json`` and ``compare.csv`` to ``out``; returns their paths.
    Each file is replaced whole (written beside it, then renamed over it): called again as more
    runs finish, a reader, or an interruption, sees the previous version or the new one."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "compare.md", "json": out / "compare.json", "csv": out / "compare.csv"}
    _replace(paths["markdown"], markdown_table(runs) + "\n")
    _replace(paths["json"], json.dumps(to_json(runs, meta), indent=1) + "\n")
    _replace(paths["csv"], csv_text(runs))
    return paths


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (atomic on POSIX)."""
    partial = path.with_name(path.name + ".part")
    with partial.open("w", newline="") as handle:
        handle.write(text)
    os.replace(partial, path)
