"""What the benchmarks share: the options every one takes, how a report is written, what it
records about where it ran (library revision, command line without machine paths), and the
~100M random-weight Llama the speed benchmarks use."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvlib.devices import set_cpu_threads
from kvlib.eval.output_files import replace_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LIBRARY_DIRS = ("kvlib", "adapters", "strategies", "storage")
"""What the revision in a report describes (benchmark and test edits do not count)."""

LLAMA100M = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 32000,
}
"""``LlamaConfig`` sizes of the ~100M-parameter random Llama (tied embeddings, fp32)."""


def git_revision() -> str:
    """HEAD, flagged when the library's code differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *LIBRARY_DIRS], cwd=REPO, capture_output=True, text=True)
        return head.stdout.strip() + (" (with uncommitted library changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def no_machine_path(arg: str) -> str:
    """An absolute path (e.g. a tmp ``--out``) becomes ``<path>``, so reports name no machine path."""
    flag, eq, value = arg.partition("=")
    if eq and Path(value).is_absolute():
        return f"{flag}=<path>"
    return "<path>" if Path(arg).is_absolute() else arg


def add_run_arguments(parser: argparse.ArgumentParser, quick: dict, *, stories: bool = False) -> None:
    """The options every benchmark takes: ``--threads``, ``--quick`` (the sizes in ``quick``),
    ``--out`` and, for those that load it, ``--stories-path``."""
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch and numba CPU threads (kvlib.devices.set_cpu_threads)"
    )
    if stories:
        parser.add_argument(
            "--stories-path",
            type=Path,
            default=Path("../shared/models/stories260K"),
            help="stories260K checkpoint; a relative path is resolved against the repository root",
        )
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test: " + str(quick))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")


def parse_run_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: dict, full: dict) -> argparse.Namespace:
    """Parse ``argv``; options left unset take their ``quick`` or ``full`` default; threads are applied."""
    args = parser.parse_args(argv)
    for name, default in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    set_cpu_threads(args.threads)
    return args


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``action``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_metadata(args: argparse.Namespace, load_before: float, started: float) -> dict:
    """What a report records about its run: the options (no machine paths), the machine, the
    library revision, the 1-minute load before and after, and the seconds taken."""
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "stories_path")},
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "git": git_revision(),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "seconds": round(time.perf_counter() - started, 1),
    }


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces a run of ``benchmarks/<script>``, without machine paths."""
    given = [no_machine_path(a) for a in (sys.argv[1:] if argv is None else argv)]
    return shlex.join(["python", f"benchmarks/{script}", *given])


def write_report(out: Path, name: str, report: str, result: dict) -> None:
    """Print ``report`` and write it as ``out/name.md`` beside ``result`` as ``out/name.json``."""
    print(report)
    out.mkdir(parents=True, exist_ok=True)
    replace_file(out / f"{name}.md", report + "\n")
    replace_file(out / f"{name}.json", json.dumps(result, indent=2) + "\n")
