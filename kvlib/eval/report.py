"""Writing a comparison: the terminal's markdown table, JSON and CSV.

Table: one row per configuration (the full cache first), one column per task score with its 95%
interval and significance marks (:mod:`kvlib.eval.significance`), then KV bytes as a fraction of
the full cache's (from the speed run), decode tokens/s (the median over the timed rounds with their
range), its ratio to the full cache's (taken per round: median and range) and the first call's
extra seconds (:class:`~kvlib.eval.compare_units.DecodeSpeed`); under it, the legend, what the speed
columns measure, and whether every configuration scored the same cases. JSON: everything, per task metrics, per-case scores,
intervals and paired tests included (:func:`runs_from_json` reads it back, files recorded before
per-case scores were kept included). CSV: one row per (policy, budget, task), with the interval
and the paired tests' p-values.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from kvlib.eval.case_scores import CaseScores
from kvlib.eval.compare_units import CompareRun, DecodeSpeed
from kvlib.eval.decode_timing import Spread
from kvlib.eval.output_files import replace_file
from kvlib.eval.significance import Baseline, cases_note, full_run, interval, legend, marks, paired, same_cases
from kvlib.eval.task import TaskResult

CSV_FIELDS = (
    "policy",
    "budget",
    "task",
    "metric",
    "score",
    "score_low",
    "score_high",
    "interval",
    "higher_is_better",
    "cases",
    "p_vs_full",
    "baseline",
    "p_vs_baseline",
    "paired_test",
    "task_kv_bytes",
    "task_full_bytes",
    "task_kv_fraction",
    "decode_tokens_per_s",
    "decode_tokens_per_s_low",
    "decode_tokens_per_s_high",
    "decode_rounds",
    "decode_vs_full",
    "decode_vs_full_low",
    "decode_vs_full_high",
    "first_call_s",
    "kv_fraction",
    "error",
)


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def score_cell(result: TaskResult, mark: str = "", number: Callable[[float], str] = _number) -> str:
    """A score with its interval and marks, each figure written by ``number``: ``0.7 [0.48, 0.85] *``
    (``(no interval)`` when the result has none)."""
    bounds = interval(result)
    shown = "(no interval)" if bounds is None else f"[{number(bounds[0])}, {number(bounds[1])}]"
    return f"{number(result.score)} {shown}" + (f" {mark}" if mark else "")


def spread_cell(values: Sequence[float], number: Callable[[float], str] = _number) -> str:
    """The median of ``values`` with their range, each figure written by ``number``: ``382 [371, 390]``
    (``-`` for none, ``382 (1 run)`` for one, ``1`` when all are equal)."""
    if not values:
        return "-"
    spread = Spread.of(values)
    if len(values) == 1:
        return f"{number(spread.median)} (1 run)"
    if spread.low == spread.high:
        return number(spread.median)
    return spread.text(number)


def speed_cells(speed: DecodeSpeed | None, number: Callable[[float], str] = _number) -> list[str]:
    """A run's decode tokens/s, its ratio to the full cache's, and its first call's extra seconds."""
    if speed is None:
        return ["-", "-", "-"]
    first = "-" if speed.first_call_s is None else f"{speed.first_call_s:.2f}".replace("-0.00", "0.00")
    return [spread_cell(speed.tokens_per_s, number), spread_cell(speed.vs_full, "{:.2f}".format), first]


SPEED_HEADER = ["decode tok/s", "vs full", "first call s"]
"""The speed columns' headers (:func:`speed_cells`)."""


def speed_note(runs: Sequence[CompareRun]) -> str:
    """What the speed columns measure, with the number of rounds the runs were timed in."""
    older = "one speed run per configuration, recorded before speeds were warmed up and repeated"
    timed = [run.speed for run in runs if run.speed is not None]
    rounds = sorted({len(speed.tokens_per_s) for speed in timed if speed.first_call_s is not None})
    if not rounds:
        return f"Decode tok/s: {older}."
    counts = " or ".join(str(count) for count in rounds)
    return (
        f"Decode tok/s: median [min, max] over {counts} timed rounds, interleaved (every configuration once per round,"
        " the full cache first), after a warm-up run of every configuration; vs full: each round's ratio to the full"
        " cache's tokens/s in the same round, median [min, max]; first call s: what the warm-up run took beyond a timed"
        " one (compiling the kernels it was the first to reach, first allocations), paid once per process, by a"
        " user's first call too" + (f"; (1 run): {older}." if any(speed.first_call_s is None for speed in timed) else ".")
    )


def task_columns(runs: Sequence[CompareRun]) -> list[tuple[str, str, bool]]:
    """``(task, metric, higher_is_better)`` of every task, in the order they ran."""
    seen: dict[str, tuple[str, str, bool]] = {}
    for run in runs:
        for name, result in run.results.items():
            seen.setdefault(name, (name, result.metric, result.higher_is_better))
    return list(seen.values())


def markdown_table(runs: Sequence[CompareRun], baseline: Baseline | None = None) -> str:
    """The comparison as a markdown table (arrows give each metric's better direction), each score
    with its interval and marks, then the legend and the cases check."""
    columns = task_columns(runs)
    header = ["policy", "budget"] + [f"{t if t == m else f'{t} {m}'} {'↑' if up else '↓'}" for t, m, up in columns]
    header += ["KV bytes vs full", *SPEED_HEADER]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [run.policy, "-" if run.budget is None else f"{run.budget:g}"]
        cells += [score_cell(run.results[t], marks(run, runs, t, baseline)) if t in run.results else "error" for t, _, _ in columns]
        cells += [_number(run.kv_fraction), *speed_cells(run.speed)]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {run.label}: {run.error}" for run in runs if run.error]
    notes = ["", legend(baseline), speed_note(runs), cases_note(runs, [t for t, _, _ in columns]), prefill_note(runs)]
    return "\n".join(lines + notes + ([""] + errors if errors else []))


def prefill_note(runs: Sequence[CompareRun]) -> str:
    """One line: how many (configuration, task) pairs (a speed run counts as a task) shared each
    batch's prompt call, and for those computed apart, why (each reason with up to three of its pairs)."""
    shared = sum(path == "shared" for run in runs for path in run.prefill.values())
    apart: dict[str, list[str]] = {}
    for run in runs:
        for task, path in run.prefill.items():
            if path != "shared":
                apart.setdefault(path.removeprefix("separate: "), []).append(f"{run.label} on {task}")
    if not shared and not apart:
        return "Prefill: each configuration computed its own prompts."
    reasons = [f"{len(pairs)} ({', '.join(pairs[:3])}{', ...' if len(pairs) > 3 else ''}): {why}" for why, pairs in apart.items()]
    return f"Prefill: {shared} (configuration, task) pairs shared each batch's prompt call" + (
        f"; computed apart: {'; '.join(reasons)}." if reasons else "."
    )


def statistics(run: CompareRun, runs: Sequence[CompareRun], name: str, baseline: Baseline | None) -> dict:
    """A task result's interval, per-case scores and paired tests, as JSON."""
    result = run.results[name]
    bounds = interval(result)
    against_full = paired(run, full_run(runs), name)
    against = None if baseline is None else paired(run, baseline.reference(run, runs), name)
    return {
        "interval": None if bounds is None else list(bounds),
        "interval_method": None if bounds is None else result.cases.aggregate.interval_method,
        "cases": None if result.cases is None else result.cases.to_json(),
        "vs_full": None if against_full is None else against_full.to_json(),
        "vs_baseline": None if against is None else against.to_json(),
    }


def to_json(runs: Sequence[CompareRun], meta: dict, baseline: Baseline | None = None) -> dict:
    """A JSON-ready record of the comparison and how it was run (``meta``), with each score's
    interval and paired tests and, under ``"statistics"``, the baseline and the cases check."""
    tasks = [t for t, _, _ in task_columns(runs)]
    return {
        **meta,
        "statistics": {
            "confidence": 0.95,
            "alpha": 0.05,
            "baseline": None if baseline is None else baseline.label,
            "same_cases": {task: same_cases(runs, task) for task in tasks},
        },
        "runs": [
            {
                "policy": run.policy,
                "budget": run.budget,
                "decode_tokens_per_s": run.decode_tokens_per_s,
                "decode_speed": None if run.speed is None else run.speed.to_json(),
                "kv_bytes": run.kv_bytes,
                "full_bytes": run.full_bytes,
                "kv_fraction": run.kv_fraction,
                "error": run.error,
                "prefill": run.prefill,
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
                        **statistics(run, runs, name, baseline),
                    }
                    for name, r in run.results.items()
                },
            }
            for run in runs
        ],
    }


def runs_from_json(record: dict) -> list[CompareRun]:
    """The runs of a record :func:`to_json` wrote; a result recorded before per-case scores were
    kept (no ``"cases"``) loads with ``cases=None`` (its reports say "no interval"), a speed recorded
    before rounds were kept as its one figure (:meth:`DecodeSpeed.from_record`)."""
    runs = []
    for entry in record["runs"]:
        run = CompareRun(entry["policy"], entry["budget"], speed=DecodeSpeed.from_record(entry), error=entry["error"])
        run.kv_bytes, run.full_bytes = entry["kv_bytes"], entry["full_bytes"]
        run.prefill = entry.get("prefill", {})
        for name, r in entry["tasks"].items():
            cases = CaseScores.from_json(r["cases"]) if r.get("cases") else None
            run.results[name] = TaskResult(
                name, r["metric"], r["score"], r["higher_is_better"], r["kv_bytes"], r["full_bytes"], r["metrics"], r["samples"], cases
            )
        runs.append(run)
    return runs


def csv_rows(runs: Sequence[CompareRun], baseline: Baseline | None = None) -> list[dict]:
    """One row per (policy, budget, task); a failed configuration gets one row with its error."""
    rows = []
    for run in runs:
        common = {
            "policy": run.policy,
            "budget": "" if run.budget is None else run.budget,
            **speed_fields(run.speed),
            "kv_fraction": run.kv_fraction or "",
            "error": run.error or "",
        }
        for name, r in run.results.items():
            stats = statistics(run, runs, name, baseline)
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
                    "score_low": "" if stats["interval"] is None else stats["interval"][0],
                    "score_high": "" if stats["interval"] is None else stats["interval"][1],
                    "interval": stats["interval_method"] or "no interval",
                    "cases": "" if r.cases is None else len(r.cases.values),
                    "p_vs_full": "" if stats["vs_full"] is None else stats["vs_full"]["p"],
                    "baseline": "" if stats["vs_baseline"] is None else stats["vs_baseline"]["against"],
                    "p_vs_baseline": "" if stats["vs_baseline"] is None else stats["vs_baseline"]["p"],
                    "paired_test": "" if r.cases is None else r.cases.aggregate.test,
                }
            )
        if not run.results:
            rows.append(common)
    return rows


def speed_fields(speed: DecodeSpeed | None) -> dict:
    """A run's speed as CSV fields (empty without one): the median and range of tokens/s, the
    rounds (``;``-separated tokens/s), the per-round ratio to the full cache's, the first call."""
    if speed is None:
        return {}
    spread, ratio = speed.spread, speed.ratio
    return {
        "decode_tokens_per_s": spread.median,
        "decode_tokens_per_s_low": spread.low,
        "decode_tokens_per_s_high": spread.high,
        "decode_rounds": ";".join(f"{value:.6g}" for value in speed.tokens_per_s),
        **({} if ratio is None else {"decode_vs_full": ratio.median, "decode_vs_full_low": ratio.low, "decode_vs_full_high": ratio.high}),
        "first_call_s": "" if speed.first_call_s is None else speed.first_call_s,
    }


def csv_text(runs: Sequence[CompareRun], baseline: Baseline | None = None) -> str:
    """:func:`csv_rows` as CSV text, with a header."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, restval="")
    writer.writeheader()
    writer.writerows(csv_rows(runs, baseline))
    return buffer.getvalue()


def write_results(runs: Sequence[CompareRun], out: Path, meta: dict, baseline: Baseline | None = None) -> dict[str, Path]:
    """Write ``compare.md``, ``compare.json`` and ``compare.csv`` to ``out``; returns their paths.
    Each file is replaced whole (written beside it, then renamed over it): called again as more
    runs finish, a reader, or an interruption, sees the previous version or the new one."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "compare.md", "json": out / "compare.json", "csv": out / "compare.csv"}
    _replace(paths["markdown"], markdown_table(runs, baseline) + "\n")
    _replace(paths["json"], json.dumps(to_json(runs, meta, baseline), indent=1) + "\n")
    _replace(paths["csv"], csv_text(runs, baseline))
    return paths


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new file renamed over it (atomic on POSIX; safe in a
    shared folder: :mod:`~kvlib.eval.output_files`)."""
    replace_file(path, text)
