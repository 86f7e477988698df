"""Decode-step cost of the paged store against DynamicCache-style ``torch.cat``, in one run.

One decode step = for every layer, append one token's keys and values and read the whole layer
back in dense form (what attention consumes). The baseline does the same work the way
``transformers.DynamicCache`` does: ``torch.cat`` of the growing per-layer tensors.

Rows:
- ``torch.cat``: the baseline;
- ``paged store``: append to pages, read through the incrementally maintained dense mirror;
- ``paged store, no read cache``: append to pages, gather every page on every read (the
  memory-lean mode: no dense mirror is kept); timed over at most 8 steps, as it is slow.

Usage (defaults are the issue's target: 4096 tokens x 32 layers x 8 KV heads x head_dim 128, fp32):

    python benchmarks/bench_store.py [--tokens 4096] [--layers 32] [--heads 8] [--head-dim 128]
        [--batch 1] [--steps 32] [--out benchmarks/results]

Writes ``bench_store.md`` and ``bench_store.json`` to ``--out``. Target: paged / torch.cat <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvlib import PagedStore, StoreConfig
from kvlib.eval.output_files import replace_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import add_run_arguments, parse_run_arguments  # noqa: E402


def _time_steps(step: Callable[[int], None], steps: int, device: torch.device) -> list[float]:
    """Seconds per call of ``step(i)`` for ``i < steps`` (one warm-up call first)."""
    step(-1)
    times = []
    for i in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def bench_cat(prefill: list[torch.Tensor], new: torch.Tensor, steps: int) -> tuple[list[float], int]:
    keys = [p.clone() for p in prefill]
    values = [p.clone() for p in prefill]

    def step(_: int) -> None:
        for layer in range(len(keys)):
            keys[layer] = torch.cat([keys[layer], new], dim=2)
            values[layer] = torch.cat([values[layer], new], dim=2)

    times = _time_steps(step, steps, new.device)
    held = sum(t.numel() * t.element_size() for t in keys + values)
    return times, held


def bench_paged(
    prefill: list[torch.Tensor], new: torch.Tensor, steps: int, read_cache: bool, page_size: int
) -> tuple[list[float], dict[str, int]]:
    batch, heads, tokens, dim = prefill[0].shape
    store = PagedStore(
        StoreConfig(
            len(prefill),
            heads,
            dim,
            page_size=page_size,
            dtype=new.dtype,
            device=new.device,
            pages_per_layer=batch * heads * ((tokens + steps + 1) // page_size + 1),
            read_cache=read_cache,
        )
    )
    seqs = [store.new_sequence() for _ in range(batch)]
    for layer, tensor in enumerate(prefill):
        store.append(layer, seqs, tensor, tensor)
        store.read(layer, seqs)

    def step(_: int) -> None:
        for layer in range(len(prefill)):
            store.append(layer, seqs, new, new)
            store.read(layer, seqs)

    times = _time_steps(step, steps, new.device)
    return times, store.memory_bytes()


FULL = {"tokens": 4096, "layers": 32, "heads": 8, "head_dim": 128, "batch": 1, "steps": 32, "page_size": 16}
QUICK = {"tokens": 64, "layers": 2, "heads": 2, "head_dim": 16, "batch": 1, "steps": 4, "page_size": 16}


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in FULL:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {FULL[name]}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)

    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    prefill = [torch.randn(shape, generator=generator).to(device) for _ in range(args.layers)]
    new = torch.randn(args.batch, args.heads, 1, args.head_dim, generator=generator).to(device)

    cat_times, cat_bytes = bench_cat(prefill, new, args.steps)
    paged_times, paged_memory = bench_paged(prefill, new, args.steps, True, args.page_size)
    lean_times, lean_memory = bench_paged(prefill, new, min(args.steps, 8), False, args.page_size)
    baseline = statistics.median(cat_times)
    rows = [
        ("torch.cat (DynamicCache-style)", cat_times, cat_bytes, 0),
        ("paged store", paged_times, paged_memory["pages"] + paged_memory["positions"], paged_memory["read_cache"]),
        ("paged store, no read cache", lean_times, lean_memory["pages"] + lean_memory["positions"], 0),
    ]
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "quick")},
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "rows": [
            {
                "name": name,
                "median_step_ms": 1e3 * statistics.median(times),
                "ratio_vs_cat": statistics.median(times) / baseline,
                "stored_bytes": stored,
                "read_cache_bytes": mirror,
            }
            for name, times, stored, mirror in rows
        ],
    }
    report = _markdown(result)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    replace_file(args.out / "bench_store.md", report + "\n")
    replace_file(args.out / "bench_store.json", json.dumps(result, indent=2) + "\n")
    return result


def _markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        "# bench_store: one decode step (append 1 token + read, every layer)",
        "",
        f"{c['tokens']} tokens x {c['layers']} layers x {c['heads']} KV heads x head_dim {c['head_dim']}, "
        f"batch {c['batch']}, page {c['page_size']}, fp32 on {c['device']}; median of {c['steps']} steps. "
        f"Machine: {result['machine']}.",
        "",
        "| store | median step (ms) | ratio vs torch.cat | KV + positions held (MiB) | dense mirror (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['name']} | {row['median_step_ms']:.2f} | {row['ratio_vs_cat']:.3f} | "
            f"{row['stored_bytes'] / 2**20:.1f} | {row['read_cache_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    run()
