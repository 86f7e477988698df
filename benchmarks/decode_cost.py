"""What one decode step costs beyond the math, counted (not timed): the same on any machine.

For each cache, one prompt is run, then a few warm-up decode steps, then one decode step is
counted three ways against ``DynamicCache`` on the same model and prompt:

- ``aten ops``: top-level ``aten::`` operators the torch profiler records in the step (an
  operator called inside another operator, or inside one of kvlib's custom ops, does not count:
  each top-level call is one trip through torch's dispatcher, and on CUDA a kernel launch or more);
  ``with kvlib's inner ops`` adds the ``aten::`` operators kvlib's own operators (``kvlib::*``,
  :mod:`kvlib.kernels.paged_ops`) call inside (their CPU implementations' tensor conversions);
- ``python calls``: Python function calls under ``cProfile`` in the step;
- ``files entered`` and ``moves`` per layer (on the small embedded ``default`` model, ``--trace-model``):
  while one middle layer's attention module runs (from its forward pre-hook to the next layer's),
  the project files (``kvlib/``, ``adapters/``, ``storage/``, ``policies/``) in which a function
  was called, and the calls that crossed from one project file into another. Fewer
  rooms visited per layer is a step that does its bookkeeping once, not per layer.

Caches (``--caches``): ``exact`` (``make_cache(model)``), ``streaming_llm_held`` (a cap of a
quarter of the prompt held while decoding), ``snapkv_held``, ``h2o_held`` and ``tova_held`` (the
same), ``snapkv_0.25`` (the prompt compressed once), ``kivi4`` (``kivi(bits=4)``). A held cap
runs with ``make_cache``'s default options (what a user who writes ``budget=256`` gets). The
counted step is an ordinary one; ``--steps N`` counts N consecutive steps and reports the mean,
so that work amortised over several steps (an eviction every page of slack) is counted at its
average.

    python benchmarks/decode_cost.py [--model smollm2] [--prompt 1024] [--steps 16] [--caches ...]
    python benchmarks/decode_cost.py --quick --out /tmp/x

Writes ``decode_cost.md`` and ``decode_cost.json``. Targets (issue 34): exact <= 1.2x
DynamicCache's aten ops, a held 25% cap <= 1.5x, kivi(bits=4) <= 1.3x; per layer at most 6
files and 12 moves (exact), 8 and 16 (held cap). Issue 45 counts kvlib's inner operators too
(``with kvlib's inner ops``): exact <= 1.2x, a held cap <= 1.3x, kivi(bits=4) <= 1.3x.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

import kvlib

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import (  # noqa: E402
    LIBRARY_DIRS,
    REPO,
    add_run_arguments,
    command_line,
    load_bench_model,
    parse_run_arguments,
    run_metadata,
    write_report,
)

FULL = {
    "model": "smollm2",
    "prompt": 1024,
    "steps": 16,
    "caches": "exact,streaming_llm_held,snapkv_held,h2o_held,tova_held,snapkv_0.25,kivi4",
}
QUICK = {"model": "default", "prompt": 64, "steps": 4, "caches": "exact,streaming_llm_held,kivi4"}
WARMUP_STEPS = 3
PROJECT_DIRS = tuple(str(REPO / name) + "/" for name in LIBRARY_DIRS)


def cache_factories(prompt: int) -> dict[str, Callable[[torch.nn.Module], object]]:
    """Each cache name's constructor, budgets sized to a ``prompt``-token prompt."""
    quarter = max(1, prompt // 4)
    held = {f"{name}_held": name for name in ("streaming_llm", "snapkv", "h2o", "tova")}
    factories: dict[str, Callable[[torch.nn.Module], object]] = {
        "dynamic": lambda model: DynamicCache(config=model.config),
        "exact": lambda model: kvlib.make_cache(model),
        "snapkv_0.25": lambda model: kvlib.make_cache(model, "snapkv", budget=0.25),
        "kivi4": lambda model: kvlib.make_cache(model, "kivi(bits=4)"),
    }
    for label, name in held.items():
        factories[label] = lambda model, name=name: kvlib.make_cache(model, name, budget=quarter)
    return factories


def aten_ops(profile: torch.profiler.profile) -> tuple[int, int]:
    """``aten::`` events of ``profile``: those with no enclosing operator (aten or a custom op),
    and those plus the ones whose innermost enclosing operator is one of kvlib's own
    (``kvlib::``): what kvlib's operators still send through torch's dispatcher inside."""
    top = inside = 0
    for event in profile.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and "::" not in parent.name:
            parent = parent.cpu_parent
        top += parent is None
        inside += parent is not None and parent.name.startswith("kvlib::")
    return top, top + inside


class Decoder:
    """A model, a cache holding a prompt, and the next greedy token: one decode step at a time."""

    def __init__(self, model: torch.nn.Module, cache: object, prompt: torch.Tensor) -> None:
        self.model, self.cache = model, cache
        with torch.inference_mode():
            logits = model(prompt, **kvlib.transformers_compat.cache_argument(cache), use_cache=True).logits
        self.token = logits[:, -1:].argmax(-1)

    def step(self) -> None:
        with torch.inference_mode():
            logits = self.model(self.token, **kvlib.transformers_compat.cache_argument(self.cache), use_cache=True).logits
        self.token = logits[:, -1:].argmax(-1)


def count_steps(decoder: Decoder, steps: int) -> dict:
    """Mean aten ops and Python calls of ``steps`` decode steps."""
    for _ in range(WARMUP_STEPS):
        decoder.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            decoder.step()
    top, with_inner = aten_ops(profile)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        decoder.step()
    profiler.disable()
    return {
        "aten_ops": top / steps,
        "aten_ops_with_kvlib_inner": with_inner / steps,
        "python_calls": pstats.Stats(profiler).total_calls / steps,
    }


class FileTrace:
    """While on: the project files in which a function was called, and the calls that crossed
    from one project file into another (the caller's innermost project frame in another file)."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()
        self.moves = 0

    def __call__(self, frame, event: str, _arg) -> None:
        if not self.on or event != "call" or not frame.f_code.co_filename.startswith(PROJECT_DIRS):
            return
        here = frame.f_code.co_filename
        self.files.add(here)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PROJECT_DIRS):
            caller = caller.f_back
        self.moves += caller is not None and caller.f_code.co_filename != here


def trace_layer(decoder: Decoder) -> dict:
    """Files entered and moves while the middle attention layer of one decode step runs."""
    layers = [
        m for m in decoder.model.modules() if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")
    ]
    middle = len(layers) // 2
    trace = FileTrace()

    def start(*_):
        trace.on = True

    def stop(*_):
        trace.on = False

    hooks = [layers[middle].register_forward_pre_hook(start), layers[middle + 1].register_forward_pre_hook(stop)]
    for _ in range(WARMUP_STEPS):
        decoder.step()
    sys.setprofile(trace)
    try:
        decoder.step()
    finally:
        sys.setprofile(None)
        for hook in hooks:
            hook.remove()
    return {"files_entered": len(trace.files), "moves": trace.moves, "files": sorted(str(Path(f).relative_to(REPO)) for f in trace.files)}


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"smollm2, llama100m, default or any kvlib.eval.load_model name (default {FULL['model']})")
    parser.add_argument("--prompt", type=int, help=f"prompt tokens (default {FULL['prompt']})")
    parser.add_argument("--steps", type=int, help=f"decode steps counted (default {FULL['steps']})")
    parser.add_argument("--caches", help=f"comma-separated, from {','.join(list(cache_factories(4))[1:])}")
    parser.add_argument(
        "--trace-model", default="default", help="model whose layers are traced for files entered (default: the embedded model)"
    )
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    caches = args.caches.split(",")
    factories = cache_factories(args.prompt)
    unknown = [name for name in caches if name not in factories]
    if unknown:
        raise SystemExit(f"unknown caches {unknown}; choose from {', '.join(list(factories)[1:])}")
    report: dict = {
        "command": command_line("decode_cost.py", argv),
        "model": args.model,
        "prompt": args.prompt,
        "steps": args.steps,
        "caches": {},
    }

    model = load_bench_model(args.model)
    kvlib.attach(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    base = count_steps(Decoder(model, factories["dynamic"](model), prompt), args.steps)
    report["dynamic"] = base
    for name in caches:
        counted = count_steps(Decoder(model, factories[name](model), prompt), args.steps)
        counted["aten_ops_vs_dynamic"] = counted["aten_ops"] / base["aten_ops"]
        counted["python_calls_vs_dynamic"] = counted["python_calls"] / base["python_calls"]
        report["caches"][name] = counted
        print(f"{name}: {counted['aten_ops']:.0f} aten ops ({counted['aten_ops_vs_dynamic']:.2f}x)", flush=True)

    trace_model = load_bench_model(args.trace_model)
    kvlib.attach(trace_model)
    trace_prompt = torch.randint(0, trace_model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    trace_factories = cache_factories(64)
    report["trace_model"] = args.trace_model
    report["traced"] = {name: trace_layer(Decoder(trace_model, trace_factories[name](trace_model), trace_prompt)) for name in caches}
    report.update(run_metadata(args, load_before, started))
    write_report(args.out, "decode_cost", markdown(report), report)
    return report


def markdown(report: dict) -> str:
    base = report["dynamic"]
    lines = [
        f"# Decode step cost: {report['model']}, {report['prompt']}-token prompt, mean of {report['steps']} steps",
        "",
        f"DynamicCache: {base['aten_ops']:.0f} aten ops, {base['python_calls']:.0f} Python calls per step.",
        f"Files entered and moves: one middle layer of a decode step on {report['trace_model']} (64-token prompt).",
        "",
        "| cache | aten ops | vs DynamicCache | with kvlib's inner ops | Python calls | vs DynamicCache | files entered / layer | moves / layer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["caches"].items():
        traced = report["traced"][name]
        lines.append(
            f"| {name} | {row['aten_ops']:.0f} | {row['aten_ops_vs_dynamic']:.2f}x | {row['aten_ops_with_kvlib_inner']:.0f} | {row['python_calls']:.0f} |"
            f" {row['python_calls_vs_dynamic']:.2f}x | {traced['files_entered']} | {traced['moves']} |"
        )
    lines += ["", "Files entered per layer:", ""]
    lines += [f"- {name}: {', '.join(traced['files'])}" for name, traced in report["traced"].items()]
    return "\n".join([*lines, "", f"Command: `{report['command']}`, revision {report['git']}, {report['machine']}.", ""])


if __name__ == "__main__":
    run()
