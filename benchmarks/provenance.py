"""What the benchmarks share: the options every one takes, how a report is written, what it
records about where it ran (library revision, command line without machine paths), and the
models they load: the ~100M random-weight Llama the speed benchmarks use, and every model
``kvlib.eval.load_model`` names (the embedded default model first)."""

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
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.devices import set_cpu_threads
from kvlib.eval import load_model
from kvlib.eval.output_files import replace_file

REPO = Path(__file__).resolve().parents[1]
LIBRARY_DIRS = ("kvlib", "adapters", "policies", "storage")
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
RANDOM_LLAMA = "llama100m"
"""The name :func:`load_bench_model` gives the ~100M random Llama."""


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


def load_bench_model(name: str) -> torch.nn.Module:
    """The model a benchmark runs on, fp32, in eval mode: ``llama100m`` (:data:`RANDOM_LLAMA`), a
    seeded random-weight ``LlamaForCausalLM`` of :data:`LLAMA100M`'s sizes (4096 positions, ~100M
    parameters); any other name goes to ``kvlib.eval.load_model`` (``default``: the embedded model
    that ships in the package; ``smollm2``, ``gemma3-270m``, a local folder)."""
    if name == RANDOM_LLAMA:
        torch.manual_seed(0)
        config = LlamaConfig(**LLAMA100M, max_position_embeddings=4096, tie_word_embeddings=True, dtype=torch.float32)
        return LlamaForCausalLM(config).to(torch.float32).eval()
    return load_model(name).model


def add_run_arguments(parser: argparse.ArgumentParser, quick: dict) -> None:
    """The options every benchmark takes: ``--threads``, ``--quick`` (the sizes in ``quick``) and ``--out``."""
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch and numba CPU threads (kvlib.devices.set_cpu_threads)"
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
        "config": {k: v for k, v in vars(args).items() if k != "out"},
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
