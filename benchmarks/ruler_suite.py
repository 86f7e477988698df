"""Every eviction policy on the RULER-style suite, at several budgets, on SmolLM2: one table.

The same configurations as ``kvlib compare`` (:mod:`kvlib.eval.compare`: a budget is a fraction of
the tokens each task sequence sees, held as an int token cap per layer and KV head at every
forward call; the full cache is the reference; decode speed is greedy steps on one
``--context``-token prompt of evaluation text after its prefill, every configuration warmed up
and then timed in ``--speed-rounds`` interleaved rounds with the full cache in each,
:mod:`kvlib.eval.compare_speed`), but resumable: the suite runs
task by task, every configuration still lacking a task together, and writes ``ruler_suite.json``
after each task; a rerun with the same options runs only the (configuration, task) pairs and speed
runs the file lacks, so ``--policies``, ``--budgets`` and ``--tasks`` choose what to add. By default
a task's configurations share each batch's prompt call (:mod:`kvlib.eval.shared_compare`: computed
once, each configuration's eviction replayed on it; the same results as separate runs);
``--separate-prefill`` runs each configuration alone, as before. A 4k-token prefill of SmolLM2
takes seconds per case on two cores, so the whole table takes hours; it can be run in parts and on
several days. Runs recorded under other options (model, dtype, context, samples, seed, speed
steps) are not mixed in: the file records its options and a different set is refused.

The means rank policies over the tasks the full cache scores at least :data:`RANKED_FROM` on;
a task the model itself fails is shown but left out of them.

Usage (defaults: every registered eviction policy with its default parameters, budgets
0.1,0.25,0.5, tasks niah_single,niah_multikey,niah_multivalue,vt at 4096 tokens, 1 sample each):

    python benchmarks/ruler_suite.py [--model smollm2] [--dtype float32|bfloat16] [--policies all|spec,spec]
        [--budgets 0.1,0.25,0.5] [--tasks niah_single,niah_multikey,niah_multivalue,vt] [--context 4096] [--samples 1]
        [--seed 0] [--speed-steps 16] [--speed-rounds 3] [--context-first] [--baseline NAME[@BUDGET]] [--threads N]
        [--separate-prefill] [--out benchmarks/results]
    python benchmarks/ruler_suite.py --report-only [--readme README.md]  # re-render the .md (and the README's table) from the JSON
    python benchmarks/ruler_suite.py --speed-only --policies chunkkv   # measure recorded rows' speed again

Writes ``ruler_suite.md`` (one row per policy and budget: each task's score, their mean, KV bytes
vs full, decode tokens/s as the median and range of the rounds, its per-round ratio to the full
cache's, the first call's extra seconds) and ``ruler_suite.json`` to ``--out``. ``--speed-only``
measures the chosen recorded configurations' speed again, with the full cache's (its speed is
replaced too: each ratio is taken against the full cache of the same rounds). Every score carries its 95% interval
and is compared with the full cache's, and with ``--baseline``'s (:mod:`kvlib.eval.significance`),
on the same cases by a paired test; the table marks differences significant at 0.05 and says
whether every configuration scored the same cases. Runs recorded before per-case scores were kept
load and show "no interval". ``--context-first`` runs kvpress's
protocol (each case's context read into the cache before its question:
:attr:`kvlib.eval.ruler.task.RulerTask.context_first`; KVzip then reconstructs the context) into
``ruler_suite_context_first.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import command_line, git_revision  # noqa: E402

import kvlib  # noqa: E402
from kvlib.devices import set_cpu_threads  # noqa: E402
from kvlib.eval import load_model  # noqa: E402
from kvlib.eval.compare_speed import measure_speeds  # noqa: E402
from kvlib.eval.compare_units import FULL, CompareRun, SpeedRun, Unit, check_inputs, configurations, run_unit, speed_run  # noqa: E402
from kvlib.eval.output_files import replace_file  # noqa: E402
from kvlib.eval.report import SPEED_HEADER, prefill_note, runs_from_json, score_cell, speed_cells, speed_note, spread_cell, to_json  # noqa: E402
from kvlib.eval.ruler import RULER_TASKS  # noqa: E402
from kvlib.eval.shared_compare import run_tasks_shared  # noqa: E402
from kvlib.eval.significance import Baseline, cases_note, legend, marks, mean_interval, mean_marks, parse_baseline  # noqa: E402
from kvlib.eval.smollm2 import cache_root  # noqa: E402
from kvlib.eval.task_table import parse_tasks  # noqa: E402
from kvlib.spec_text import split_specs  # noqa: E402

NAME = "ruler_suite"
OPTIONS = ("model", "dtype", "context", "samples", "seed", "speed_steps", "context_first")
"""The options a recorded run must share with this one to count as done (budgets, policies and
tasks only choose what runs: a rerun adds what the file lacks)."""
LATER_OPTIONS = {"context_first": False, "dtype": "float32"}
"""Options added after runs were recorded: a file that lacks one was run with this value."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``--dtype`` choices: the model's weights and its caches' element type."""
RANKED_FROM = 0.5
"""A task enters the ranking (the mean columns) when the full cache scores at least this on it:
below, the model itself fails the task and a policy's score there says nothing of the policy."""


def file_name(context_first: bool) -> str:
    """The results' file name (without suffix): context-first runs have their own files."""
    return f"{NAME}_context_first" if context_first else NAME


def all_evictions() -> list[str]:
    """Every registered eviction policy, by name (its default parameters)."""
    return sorted(kvlib.available_policies()["eviction"])


def load_runs(path: Path, options: dict) -> list[CompareRun]:
    """The runs recorded in ``path`` (none if it does not exist); ``ValueError`` if they were run
    with other options."""
    if not path.exists():
        return []
    recorded = json.loads(path.read_text())
    had = {**LATER_OPTIONS, **recorded["options"]}
    mismatched = {k: (had.get(k), options[k]) for k in OPTIONS if had.get(k) != options[k]}
    if mismatched:
        raise ValueError(f"{path} holds runs made with other options {mismatched} (recorded, now): use another --out")
    return runs_from_json(recorded)


def shown(policy: str) -> str:
    """A policy as the tables show it: a path in kvlib's cache named by its place there."""
    return policy.replace(str(cache_root()), "<kvlib cache>")


def mean_score(run: CompareRun, tasks: Sequence[str]) -> float | None:
    """The mean of ``run``'s scores on ``tasks`` (None until it has all of them)."""
    if not tasks or any(t not in run.results for t in tasks):
        return None
    return sum(run.results[t].score for t in tasks) / len(tasks)


def ranked_tasks(runs: Sequence[CompareRun], tasks: Sequence[str]) -> list[str]:
    """The ``tasks`` the full cache scores at least :data:`RANKED_FROM` on, or has not run yet: the
    ones the means rank policies by."""
    full = next((run for run in runs if run.policy == FULL and not run.error), None)
    if full is None:
        return list(tasks)
    return [t for t in tasks if t not in full.results or full.results[t].score >= RANKED_FROM]


def pending_tasks(runs: Sequence[CompareRun], ranked: Sequence[str]) -> list[str]:
    """The ``ranked`` tasks some configuration (that did not fail) has not run yet: a mean over
    them would compare configurations on different tasks, so they wait outside the means."""
    return [t for t in ranked if any(t not in run.results for run in runs if not run.error)]


def pending_text(pending: Sequence[str]) -> str:
    """The note on :func:`pending_tasks` (empty when none)."""
    return f"; not yet run by every configuration, so out of the means for now: {', '.join(pending)}" if pending else ""


def mean_cell(run: CompareRun, runs: Sequence[CompareRun], tasks: Sequence[str], baseline: Baseline | None) -> str:
    """The mean over ``tasks`` with its interval (each task's cases resampled apart) and marks."""
    mean = mean_score(run, tasks)
    if mean is None:
        return "-"
    bounds = mean_interval(run, tasks)
    mark = mean_marks(run, runs, tasks, baseline)
    return f"{mean:.2f} " + ("(no interval)" if bounds is None else f"[{bounds[0]:.2f}, {bounds[1]:.2f}]") + (f" {mark}" if mark else "")


def summary(runs: Sequence[CompareRun], tasks: Sequence[str], baseline: Baseline | None = None, *, speed: bool = True) -> list[str]:
    """One row per policy: its mean score over ``tasks`` at each budget (the full cache's in
    every column) with its interval and marks, then its KV bytes vs full and (with ``speed``)
    decode tokens/s at each budget."""
    budgets = sorted({run.budget for run in runs if run.budget is not None})
    by_policy: dict[str, dict[float | None, CompareRun]] = {}
    for run in runs:
        if not run.error:
            by_policy.setdefault(run.policy, {})[run.budget] = run
    header = ["policy", *[f"mean @ {b:g}" for b in budgets], *[f"bytes @ {b:g}" for b in budgets]]
    header += [f"tok/s @ {b:g}" for b in budgets] if speed else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for policy, configs in by_policy.items():
        picked = [configs.get(None) or configs.get(b) for b in budgets]
        cells = [shown(policy), *["-" if r is None else mean_cell(r, runs, tasks, baseline) for r in picked]]
        cells += ["-" if r is None or not r.kv_fraction else f"{r.kv_fraction:.3f}" for r in picked]
        if speed:
            cells += ["-" if r is None or r.speed is None else spread_cell(r.speed.tokens_per_s, "{:.2f}".format) for r in picked]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(runs: Sequence[CompareRun], meta: dict, baseline: Baseline | None = None) -> str:
    """The summary (:func:`summary`), then one row per configuration: tasks' scores, their mean
    over the ranked tasks (:func:`ranked_tasks`), bytes and speed."""
    tasks = meta["options"]["tasks"].split(",")
    passed = ranked_tasks(runs, tasks)
    left_out = [t for t in tasks if t not in passed]
    pending = pending_tasks(runs, passed)
    ranked = [t for t in passed if t not in pending]
    header = ["policy", "budget", *tasks, "mean", "KV bytes vs full", *SPEED_HEADER, "s", "load"]
    protocol = (
        [
            "Context first (kvpress's protocol): each case's context is read into the cache first (KVzip reconstructs it;"
            " the others read it as a prompt under their cap), then the question and the answer; one case per generate call.",
            "",
        ]
        if meta["options"].get("context_first")
        else []
    )
    lines = [
        f"# Eviction policies on the RULER-style suite ({meta['options']['model']}, {meta['options']['context']} tokens)",
        "",
        *protocol,
        f"{commands_text(meta)}; {meta['options'].get('dtype', 'float32')} weights and caches;"
        f" {meta['options']['samples']} sample(s) per task, scored with RULER's"
        " string_match_all; budget = fraction of each sequence's tokens, an int cap per layer and KV head held at every call;"
        " KV bytes and decode speed from the speed run (greedy steps after a prefill of the same length);"
        " s: seconds the configuration took; load: the 1-minute load average when its speed was measured (the range over"
        " the rounds; decode tok/s at a high load measures the machine, not the policy)" + speed_commands_text(meta) + ".",
        "",
        f"Mean score over {', '.join(ranked) or 'no task'} at each budget (the full cache's in every column), KV bytes vs full"
        " and decode tokens/s"
        + (
            f"; left out of the means: {', '.join(left_out)}, where the full cache itself scores under {RANKED_FROM:g}"
            " (the model fails the task, so a policy's score there ranks nothing)"
            if left_out
            else ""
        )
        + pending_text(pending)
        + ":",
        "",
        *summary(runs, ranked, baseline),
        "",
        legend(baseline) + " The mean's interval and tests resample each task's cases apart.",
        "",
        speed_note(runs),
        "",
        cases_note(runs, tasks),
        "",
        prefill_note(runs) + seconds_note(meta),
        "",
        "Each configuration:",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for run in runs:
        cells = [shown(run.policy), "-" if run.budget is None else f"{run.budget:g}"]
        cells += [score_cell(run.results[t], marks(run, runs, t, baseline), "{:.2f}".format) if t in run.results else "-" for t in tasks]
        cells += [mean_cell(run, runs, ranked, baseline)]
        cells += [f"{run.kv_fraction:.3f}" if run.kv_fraction else "-", *speed_cells(run.speed, "{:.2f}".format)]
        cells += [str(meta["seconds"].get(run.label, "-")), load_cell(meta["load"].get(run.label))]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {run.label}: {run.error}" for run in runs if run.error]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def load_cell(load: float | list[float] | None) -> str:
    """A row's load: the 1-minute load average (a record's one reading, or the range over its speed rounds)."""
    if load is None:
        return "-"
    if isinstance(load, list):
        return f"{load[0]:g}-{load[1]:g}"
    return str(load)


def speed_commands_text(meta: dict) -> str:
    """The ``--speed-only`` commands that measured speeds again, each with its revision (empty if none)."""
    again = meta.get("speed_runs", [])
    if not again:
        return ""
    return "; decode speeds measured again by " + "; then ".join(f"`{run['command']}` (library {run['git']})" for run in again)


def readme_markers(results: str) -> tuple[str, str]:
    """The lines around the README's table of the record in folder ``results`` (one table per
    record, so a file can hold several models' tables)."""
    begin = f"<!-- ruler_suite table {results}: begin (benchmarks/ruler_suite.py --report-only --out {results} --readme FILE writes it) -->"
    return begin, f"<!-- ruler_suite table {results}: end -->"


def readme_block(runs: Sequence[CompareRun], meta: dict, results: str, baseline: Baseline | None = None) -> str:
    """The README's table (between :func:`readme_markers`): what was run, the ranked tasks and those
    left out, then :func:`summary` without speeds; ``results``: the folder of the result files, as
    the README names it."""
    begin, end = readme_markers(results)
    options = meta["options"]
    tasks = options["tasks"].split(",")
    passed = ranked_tasks(runs, tasks)
    left_out = [t for t in tasks if t not in passed]
    pending = pending_tasks(runs, passed)
    ranked = [t for t in passed if t not in pending]
    full = next((run for run in runs if run.policy == FULL and not run.error), None)
    scores = ", ".join(f"{t} {full.results[t].score:.2f}" for t in left_out if full is not None and t in full.results)
    lines = [
        begin,
        "",
        f"{options['model']} at {options['context']} tokens ({options.get('dtype', 'float32')}), {options['samples']} cases per task,"
        f" the same cases for every configuration: mean score over {', '.join(ranked)} at each budget, then KV bytes against"
        " the full cache"
        + (
            f"; left out of the means: {', '.join(left_out)}, where the full cache itself scores under {RANKED_FROM:g} ({scores})"
            if left_out
            else ""
        )
        + pending_text(pending)
        + f". Every configuration, each task's score, the decode speeds and the commands that ran them: `{results}/ruler_suite.md`.",
        "",
        legend(baseline),
        "",
        *summary(runs, ranked, baseline, speed=False),
        "",
        end,
    ]
    return "\n".join(lines)


def replace_readme_block(text: str, block: str, results: str) -> str:
    """``text`` with the block of the record in ``results`` replaced by ``block``; ``ValueError``
    when it has no such block (both :func:`readme_markers`, in order)."""
    begin_line, end_line = readme_markers(results)
    begin, end = text.find(begin_line), text.find(end_line)
    if begin < 0 or end < begin:
        raise ValueError(f"no ruler_suite block for {results}: the file needs the lines {begin_line!r} and {end_line!r}, in that order")
    return text[:begin] + block + text[end + len(end_line) :]


def recorded_commands(recorded: dict) -> list[dict]:
    """Every earlier command that added to a record (oldest first, each with its revision): the
    record's ``runs_before`` and its last ``command``."""
    earlier = list(recorded.get("runs_before", []))
    if recorded.get("command"):
        earlier.append({"command": recorded["command"], "git": recorded.get("git", "")})
    return earlier


def commands_text(meta: dict) -> str:
    """The commands that made the table, oldest first, each with its library revision."""
    runs = [*meta.get("runs_before", []), {"command": meta["command"], "git": meta["git"]}]
    return "; then ".join(f"`{run['command']}` (library {run['git']})" for run in runs)


def seconds_note(meta: dict) -> str:
    """What the ``s`` column measures, and the shared tasks' wall time per task."""
    per_task = meta.get("task_seconds", {})
    if per_task:
        each = ", ".join(f"{task} {seconds} s" for task, seconds in per_task.items())
        return f" Tasks' wall time, every configuration together: {each} ({sum(per_task.values())} s); s is then each row's speed run."
    if "shared_seconds" in meta:
        return f" The shared tasks took {meta['shared_seconds']} s in all; s is then each row's speed run."
    return ""


def task_order(names: Sequence[str]) -> list[str]:
    """``names`` once each, RULER's tasks in their registry's order first, then any other in the
    order given: the table's columns stay put whatever order the runs added them in."""
    known = list(RULER_TASKS)
    unique = [name for name in dict.fromkeys(names) if name]
    return sorted(unique, key=lambda name: (known.index(name), 0) if name in known else (len(known), unique.index(name)))


def sorted_runs(runs: Sequence[CompareRun]) -> list[CompareRun]:
    """The full cache first, then by policy and budget."""
    return sorted(runs, key=lambda run: (run.policy != FULL, run.policy, run.budget or 0.0))


def write(out: Path, runs: Sequence[CompareRun], meta: dict, baseline: Baseline | None = None) -> None:
    """Both files, each replaced whole; rows sorted (:func:`sorted_runs`)."""
    runs = sorted_runs(runs)
    out.mkdir(parents=True, exist_ok=True)
    stem = file_name(meta["options"]["context_first"])
    texts = ((f"{stem}.json", json.dumps(to_json(runs, meta, baseline), indent=1) + "\n"), (f"{stem}.md", markdown(runs, meta, baseline)))
    for name, text in texts:
        replace_file(out / name, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's weights and its caches' element type")
    parser.add_argument("--policies", default="all", help="'all' (every eviction policy) or comma-separated specs")
    parser.add_argument("--budgets", default="0.1,0.25,0.5")
    parser.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue,vt")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed-steps", type=int, default=16, help="greedy decode steps timed per speed run")
    parser.add_argument(
        "--speed-rounds", type=int, default=3, help="timed rounds, interleaved across the configurations after a warm-up run of each"
    )
    parser.add_argument(
        "--context-first",
        action="store_true",
        help="kvpress's protocol: read each context into the cache first (KVzip reconstructs it), then the question",
    )
    parser.add_argument(
        "--baseline", metavar="NAME[@BUDGET]", help="a policy run (recorded, with --report-only) that every configuration is compared with"
    )
    parser.add_argument(
        "--separate-prefill",
        action="store_true",
        help="each configuration computes its own prompts (default: each batch's prompt once for all that can share it)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--report-only", action="store_true", help="re-render the .md from the JSON")
    parser.add_argument("--readme", type=Path, help="with --report-only: also rewrite this file's ruler_suite table (README.md)")
    parser.add_argument(
        "--speed-only", action="store_true", help="measure again the decode speed and bytes of the recorded configurations chosen"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    path = args.out / f"{file_name(args.context_first)}.json"
    recorded = json.loads(path.read_text()) if path.exists() else {}
    options = {k: getattr(args, k) for k in OPTIONS}
    if args.report_only:  # the record's own options: nothing runs
        options = {k: {**LATER_OPTIONS, **recorded.get("options", {})}.get(k, options[k]) for k in OPTIONS}
    runs = load_runs(path, options)
    recorded_tasks = [t for t in recorded.get("options", {}).get("tasks", "").split(",") if t]
    keeps_record = args.report_only or args.speed_only  # the table's command and revision stay the run's
    meta = {
        "options": {
            **options,
            "tasks": ",".join(task_order(recorded_tasks if keeps_record else [*recorded_tasks, *args.tasks.split(",")])),
        },
        "command": recorded.get("command", "") if keeps_record else command_line("ruler_suite.py", argv),
        "git": recorded.get("git", "") if keeps_record else git_revision(),
        "runs_before": recorded_commands(recorded) if not keeps_record else recorded.get("runs_before", []),
        "seconds": recorded.get("seconds", {}),
        "load": recorded.get("load", {}),
        "task_seconds": recorded.get("task_seconds", {}),
        **({"shared_seconds": recorded["shared_seconds"]} if "shared_seconds" in recorded else {}),
        **({"speed_runs": recorded["speed_runs"]} if "speed_runs" in recorded else {}),
    }
    if args.report_only:
        recorded_policies = list(dict.fromkeys(run.policy for run in runs if run.policy != FULL))
        recorded_budgets = sorted({run.budget for run in runs if run.budget is not None})
        baseline = parse_baseline(args.baseline, recorded_policies, recorded_budgets)
        write(args.out, runs, meta, baseline)
        if args.readme:
            block = readme_block(sorted_runs(runs), meta, args.out.as_posix(), baseline)
            args.readme.write_text(replace_readme_block(args.readme.read_text(), block, args.out.as_posix()))
        return 0
    set_cpu_threads(args.threads)
    policies = all_evictions() if args.policies == "all" else split_specs(args.policies)
    budgets = [float(b) for b in args.budgets.split(",")]
    baseline = parse_baseline(args.baseline, policies, budgets)  # before the model loads
    loaded = load_model(args.model, dtype=DTYPES[args.dtype])
    tasks = parse_tasks(args.tasks, context=args.context, samples=args.samples, seed=args.seed, context_first=args.context_first)
    check_inputs(loaded, policies, budgets, tasks)
    speed = speed_run(loaded, args.context, args.speed_steps, args.speed_rounds)
    kept = {(run.policy, run.budget): run for run in runs if not run.error}  # a failed configuration runs again, whole
    runs = list(kept.values())
    chosen = [kept.get(config) or CompareRun(*config) for config in configurations(policies, budgets)]
    recorded_runs = {id(run) for run in runs}  # the chosen configurations already in the record (by identity)
    if args.speed_only:
        meta.setdefault("speed_runs", []).append(
            {"command": command_line("ruler_suite.py", argv), "git": git_revision(), "rounds": args.speed_rounds}
        )
        again = [run for run in chosen if id(run) in recorded_runs]
        run_speeds(loaded, runs, again, speed, args, meta, lambda: write(args.out, runs, meta, baseline), count_seconds=False)
        return 0
    runs += [run for run in chosen if id(run) not in recorded_runs]
    for task in tasks:
        run_task(loaded, task, [run for run in chosen if run.error is None and task.name not in run.results], args, meta)
        write(args.out, runs, meta, baseline)
    lacking = [run for run in chosen if run.error is None and run.speed is None]
    run_speeds(loaded, runs, lacking, speed, args, meta, lambda: write(args.out, runs, meta, baseline))
    write(args.out, runs, meta, baseline)
    return 0


def run_task(loaded, task, missing: list[CompareRun], args, meta: dict) -> None:
    """``task`` for the configurations ``missing`` it: together, each batch's prompt run once for
    every configuration that can share it (:func:`kvlib.eval.shared_compare.run_tasks_shared`; the
    same results), or with ``--separate-prefill`` one configuration after another. The task's wall
    time is added to ``meta["task_seconds"]``; each configuration's score is printed."""
    if not missing:
        return
    started = time.perf_counter()
    if args.separate_prefill:
        for run in missing:
            unit_started = time.perf_counter()
            run_unit(loaded, Unit(run.policy, run.budget, task)).record(run)
            meta["seconds"][run.label] = meta["seconds"].get(run.label, 0) + round(time.perf_counter() - unit_started)
    else:
        run_tasks_shared(loaded, missing, [task])
    seconds = round(time.perf_counter() - started)
    meta["task_seconds"][task.name] = meta["task_seconds"].get(task.name, 0) + seconds
    print(f"{task.name}: {len(missing)} configurations in {seconds} s (load {os.getloadavg()[0]:.1f})", flush=True)
    for run in missing:
        result = run.results.get(task.name)
        print(f"  {run.label}: {run.error or round(result.score, 2)}", flush=True)


def run_speeds(
    loaded,
    runs: Sequence[CompareRun],
    timed: Sequence[CompareRun],
    speed: SpeedRun,
    args,
    meta: dict,
    save,
    *,
    count_seconds: bool = True,
) -> None:
    """The decode speed and bytes of ``timed`` (configurations of ``runs``), measured together with
    the full cache of ``runs`` (:func:`kvlib.eval.compare_speed.measure_speeds`: warmed up, then
    interleaved rounds, the full cache first in each; its speed is replaced too). One prefill of the
    speed prompt is shared, unless ``--separate-prefill``. ``save()`` runs after each round. A row's
    load is the range of the 1-minute load average over the rounds; with ``count_seconds`` its
    seconds grow by its speed calls' (the warm-up's included)."""
    if not timed:
        return
    full = next(run for run in runs if run.policy == FULL)
    chosen = [full, *(run for run in timed if run is not full)]
    loads: list[float] = []

    def after(round_: int) -> None:
        load = round(os.getloadavg()[0], 1)
        print(f"decode speed, {'warm-up' if round_ == 0 else f'round {round_} of {speed.rounds}'} done (load {load})", flush=True)
        if round_ > 0:
            loads.append(load)
            for run in chosen:
                meta["load"][run.label] = [min(loads), max(loads)]
            save()

    def called(round_: int, index: int) -> None:
        print(f"  {'warm-up' if round_ == 0 else f'round {round_}'}: {chosen[index].label} done", flush=True)

    measured = measure_speeds(loaded, chosen, speed, shared=not args.separate_prefill, on_call=called, on_round=after)
    for run, timing in measured:
        if count_seconds:
            meta["seconds"][run.label] = meta["seconds"].get(run.label, 0) + round(timing.seconds)
        cells = speed_cells(run.speed, "{:.2f}".format)
        print(f"{run.label}: decode {cells[0]} tok/s, vs full {cells[1]}, first call {cells[2]} s {run.error or ''}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
