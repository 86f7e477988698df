"""Compiled decode: kvlib caches under ``torch.compile`` against a compiled ``StaticCache``, in one run (issue 45).

The flow a user writes: ``model.forward = torch.compile(model.forward, backend=...)``, then a prompt
and greedy single-token steps (``bench_generate.generate_once``: one forward over the prompt with a
fresh cache, then ``--new-tokens`` steps). Every cache runs through the same compiled forward, so
each traces its own graphs (dynamo guards on the cache's type); the warm-up run of
:func:`kvlib.eval.decode_timing.measure` compiles them (its extra seconds are reported as the first
call's, compilation included), then ``--repeats`` interleaved rounds are timed.

Caches (``--caches``): ``static`` (transformers' ``StaticCache``, preallocated to the context plus
the steps: the cache ``torch.compile`` is usually paired with, the reference of every ratio),
``exact`` (``kvlib.make_cache(model)``) and ``snapkv_int25`` / ``streaming_llm_int25`` / ``h2o_int25``
(a cap of a quarter of the context held at every step), ``kivi4`` (``kivi(bits=4)``). A kvlib cache
traces its store's work as two opaque operators per layer call (``kvlib::cache_update``,
``kvlib::cache_attend``); the rest of the forward is the backend's.

Targets (issue 45): exact compiled (inductor) >= 1.0x the compiled StaticCache at 2k; the held 25%
cap compiled >= 1.3x at 8k. The exact cache's tokens must equal the StaticCache's (reported).

    python benchmarks/bench_compiled_decode.py [--models smollm2] [--contexts 2048,8192]
        [--caches static,exact,snapkv_int25] [--backend inductor] [--mode reduce-overhead] [--device cuda]
        [--new-tokens 32] [--repeats 3]
    python benchmarks/bench_compiled_decode.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import StaticCache

import kvlib
from kvlib.eval.decode_timing import Spread, measure

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_decode_caches import cache_factories  # noqa: E402
from bench_generate import decode_timer  # noqa: E402
from provenance import add_run_arguments, command_line, load_bench_model, parse_run_arguments, run_metadata, write_report  # noqa: E402

MODELS = ("llama100m", "smollm2", "default")
FULL = {"models": "smollm2", "contexts": "2048,8192", "caches": "exact,snapkv_int25,kivi4", "new_tokens": 32, "repeats": 3}
QUICK = {"models": "default", "contexts": "64", "caches": "exact,snapkv_int25", "new_tokens": 4, "repeats": 1}
REFERENCE = "static"
BACKENDS = ("inductor", "aot_eager", "eager")
MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
GRAPHS_PER_CACHE = 8
"""Room for each cache's graphs in dynamo's recompile limit (a prompt shape per context, the decode step)."""


def compiled_factories(context: int, steps: int) -> dict[str, Callable[[torch.nn.Module], object]]:
    """Each cache name's constructor, budgets sized to ``context``; ``static`` holds ``context + steps`` tokens."""
    kvlib_caches = {name: make for name, make in cache_factories(context).items() if name != "dynamic"}  # it recompiles every step
    return {REFERENCE: lambda model: StaticCache(config=model.config, max_cache_len=context + steps), **kvlib_caches}


def bench_context(model: torch.nn.Module, context: int, caches: list[str], args: argparse.Namespace) -> dict:
    factories = compiled_factories(context, args.new_tokens + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context)).to(model.device)
    kinds = [REFERENCE, *caches]
    timers = [decode_timer(model, lambda kind=kind: factories[kind](model), prompt, args.new_tokens) for kind in kinds]
    timings = dict(zip(kinds, measure(timers, args.repeats, errors=())))
    reference = timings[REFERENCE]
    row: dict = {
        "context": context,
        "static_decode_tok_s": reference.speed.median,
        "static_first_call_s": reference.first_call_s,
        "caches": {},
    }
    reference_tokens = reference.runs[0].detail["tokens"]
    for kind in caches:
        ratio = timings[kind].vs(reference)
        spread = Spread.of(ratio)
        row["caches"][kind] = {
            "decode_tok_s": timings[kind].speed.median,
            "decode_vs_static": spread.median,
            "decode_vs_static_low": spread.low,
            "decode_vs_static_high": spread.high,
            "all_decode_vs_static": ratio,
            "first_call_s": timings[kind].first_call_s,
            "tokens_match": all(torch.equal(run.detail["tokens"], reference_tokens) for run in timings[kind].runs),
        }
    return row


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} (default {FULL['models']})")
    parser.add_argument("--contexts", help=f"prompt tokens, comma-separated (default {FULL['contexts']})")
    parser.add_argument("--caches", help=f"comma-separated, from {','.join(list(compiled_factories(4, 1))[1:])} (default {FULL['caches']})")
    parser.add_argument("--backend", default="inductor", choices=BACKENDS, help="torch.compile's backend (default inductor)")
    parser.add_argument(
        "--mode", default="default", choices=MODES, help="torch.compile's mode (reduce-overhead: CUDA graphs; default default)"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model and caches live (default cpu)")
    parser.add_argument("--new-tokens", type=int, help=f"decode steps (default {FULL['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds (default {FULL['repeats']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    models = [m for m in args.models.split(",") if m]
    caches = [c for c in args.caches.split(",") if c]
    known = list(compiled_factories(4, 1))[1:]
    for given, allowed, what in ((models, MODELS, "models"), (caches, known, "caches")):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            parser.error(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is available")
    if args.mode != "default" and args.backend != "inductor":
        parser.error(f"--mode {args.mode} is inductor's; --backend {args.backend} takes only --mode default")
    contexts = [int(c) for c in args.contexts.split(",")]
    load_before, started = os.getloadavg()[0], time.perf_counter()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, GRAPHS_PER_CACHE * (len(caches) + 1))
    rows = []
    for name in models:
        model = load_bench_model(name).to(args.device)
        kvlib.attach(model)
        eager_forward = model.forward
        options = {"mode": args.mode} if args.mode != "default" else {}
        model.forward = torch.compile(eager_forward, backend=args.backend, **options)
        for context in contexts:
            load = os.getloadavg()[0]
            row = {"model": name, "device": args.device, **bench_context(model, context, caches, args)}
            row["load_avg_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            rows.append(row)
            for kind, figures in row["caches"].items():
                print(f"{name} {context}: {kind} decode {figures['decode_vs_static']:.2f}x compiled StaticCache", flush=True)
        model.forward = eager_forward
        torch._dynamo.reset()
        del model
    result = {
        **run_metadata(args, load_before, started),
        "command": command_line("bench_compiled_decode.py", argv),
        "backend": args.backend,
        "mode": args.mode,
        "rows": rows,
    }
    write_report(args.out, "bench_compiled_decode", _markdown(result), result)
    return result


def _markdown(result: dict) -> str:
    lines = [
        "# bench_compiled_decode: kvlib caches under torch.compile against a compiled StaticCache",
        "",
        f"Command: `{result['command']}`. Backend: {result['backend']}, mode {result['mode']}, device {', '.join(sorted({row['device'] for row in result['rows']})) or '-'}. Machine: {result['machine']}. "
        f"Library revision: {result['git']}. 1-minute load before/after: {result['load_avg_1min']}; {result['seconds']} s.",
        "",
        "`model.forward` compiled once; every cache through it (its own graphs). Ratios of decode tokens/s against the "
        "compiled StaticCache of the same round (a warm-up run of every cache, compilation included, then interleaved "
        "rounds; median [min, max] of the per-round ratios, all rounds listed; first call: the seconds the warm-up run "
        "took beyond a timed one).",
        "",
        "| model | context | cache | decode tok/s | vs StaticCache compiled | rounds | first call (s) | tokens = StaticCache | load |",
        "|---|---:|---|---:|---:|---|---:|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['model']} | {row['context']} | static | {row['static_decode_tok_s']:.1f} | 1.00x | - | "
            f"{row['static_first_call_s']:.1f} | - | {row['load_avg_1min'][0]:.1f}, {row['load_avg_1min'][1]:.1f} |"
        )
        for kind, f in row["caches"].items():
            spread = Spread(f["decode_vs_static"], f["decode_vs_static_low"], f["decode_vs_static_high"])
            rounds = ", ".join(f"{r:.2f}" for r in f["all_decode_vs_static"])
            lines.append(
                f"| {row['model']} | {row['context']} | {kind} | {f['decode_tok_s']:.1f} | {spread.text('{:.2f}x'.format)} | "
                f"{rounds} | {f['first_call_s']:.1f} | {'yes' if f['tokens_match'] else 'no'} | "
                f"{row['load_avg_1min'][0]:.1f}, {row['load_avg_1min'][1]:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
