"""The paged attention kernel alone: one decode step's attention over a layer's pages, against SDPA
over the same tokens in dense form and against a copy of the same bytes, in one run.

Shapes are one attention layer of the models the issue measures: ``smollm2`` (SmolLM2-135M: 9
query heads on 3 KV heads, head_dim 64) and ``llama100m`` (12 on 4, head_dim 64), fp32, pages of
16 tokens handed out in a shuffled order (as a store's pages end up). Cases, interleaved for
``--repeats`` rounds after a warm-up, medians compared:

- ``paged``: one query token per row over the pages, with the kernel the device uses
  (:func:`kvlib.devices.paged_kernel`: the numba kernel on the CPU, the torch path over blocks of
  pages on CUDA);
- ``sdpa_dense``: ``scaled_dot_product_attention`` over the dense ``[batch, heads, tokens, dim]``
  keys and values (what a dense mirror gives attention; the mirror's upkeep not counted);
- ``gather_sdpa``: gathering the pages into a dense copy, then SDPA (a read without a mirror);
- ``copy``: ``torch.clone`` of the dense keys and values: the bytes the kernel must read, moved once.

Reported: microseconds per call, and the kernel's effective bandwidth as a share of the copy's
(``copy_us / paged_us``: the issue's target is >= 50%).

Coded pages (``--codecs``, CPU): the same layer stored by a codec (sealed pages read in the kernel,
scales folded into the query or the weights) against the same layer in float32 pages, both
through a store's paged layer (``PagedStore.paged_layer(...).attend``: the kernel a decode step
runs), each call on the next of ``--layers`` layers, so that every call reads pages the caches
do not hold, as in a decode step over a model's layers. Ratios are fp32 pages' time over the
codec's, per round, interleaved (issue 45's target: kivi(bits=4) >= 2x at 8k x 3 KV heads x 64).

    python benchmarks/bench_paged_attention.py [--contexts 2048,8192] [--batch-sizes 1,4] [--repeats 20] [--threads N] [--device cuda]
        [--codecs "kivi(bits=4);int8"] [--layers 8]
    python benchmarks/bench_paged_attention.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvlib import devices
from kvlib.codec import layer_shapes
from kvlib.devices import PagedKernel
from kvlib.kernels.paged_attention import paged_attention
from kvlib.kernels.paged_attention_torch import attend_pages_torch
from kvlib.kernels.pages import PagedLayer
from kvlib.spec_text import parse_policy
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import add_run_arguments, command_line, parse_run_arguments, run_metadata, write_report  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama100m": (12, 4, 64)}
"""Per model: query heads, KV heads, head_dim."""
PAGE_SIZE = 16
FULL = {
    "contexts": "2048,8192",
    "batch_sizes": "1,4",
    "repeats": 20,
    "codecs": "kivi(bits=4);kivi(bits=2);int8;fp8;rotated(bits=4)",
    "layers": 8,
}
QUICK = {"contexts": "64", "batch_sizes": "1", "repeats": 2, "codecs": "kivi(bits=4)", "layers": 2}
CASES = ("paged", "sdpa_dense", "gather_sdpa", "copy")
FP32_PAGES = "fp32 pages"


def layer_pages(batch: int, kv_heads: int, dim: int, tokens: int, generator: torch.Generator):
    """A layer's pages for ``batch`` rows of ``tokens`` tokens per KV head, shuffled in the arena."""
    per_head = -(-tokens // PAGE_SIZE)
    capacity = batch * kv_heads * per_head
    order = torch.randperm(capacity, generator=generator)
    pages = order.view(batch, kv_heads, per_head)
    keys = torch.randn(capacity, PAGE_SIZE, dim, generator=generator)
    values = torch.randn(capacity, PAGE_SIZE, dim, generator=generator)
    positions = torch.arange(per_head * PAGE_SIZE).view(per_head, PAGE_SIZE).repeat(batch * kv_heads, 1)
    positions = positions[torch.argsort(order)].contiguous()  # page order[i] holds the i-th page's positions
    lengths = torch.full((batch, kv_heads), tokens, dtype=torch.int64)
    return keys, values, positions, pages, lengths


def micros(action: Callable[[], object], device: torch.device) -> float:
    """Wall-clock microseconds of ``action``, waiting for the device's queued work on both ends."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    action()
    synchronize()
    return (time.perf_counter() - start) * 1e6


def bench_case(model: str, batch: int, tokens: int, repeats: int, device: torch.device) -> dict:
    query_heads, kv_heads, dim = SHAPES[model]
    generator = torch.Generator().manual_seed(tokens + batch)
    keys, values, positions, pages, lengths = layer_pages(batch, kv_heads, dim, tokens, generator)
    query = torch.randn(batch, query_heads, 1, dim, generator=generator)
    keys, values, positions, query = (t.to(device) for t in (keys, values, positions, query))
    kernel = paged_attention if devices.paged_kernel(device) is PagedKernel.NUMBA else attend_pages_torch
    flat = pages.flatten().to(device)
    dense_keys = keys[flat].view(batch, kv_heads, -1, dim)[:, :, :tokens].contiguous()
    dense_values = values[flat].view(batch, kv_heads, -1, dim)[:, :, :tokens].contiguous()
    query_positions = torch.tensor([tokens])
    group = query_heads // kv_heads

    def paged():
        return kernel(query, keys, values, positions, pages, lengths, visible=None, query_positions=query_positions, scale=dim**-0.5)

    def sdpa_dense(k=dense_keys, v=dense_values):
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=group > 1)

    def gather_sdpa():
        k = keys.index_select(0, flat).view(batch, kv_heads, -1, dim)[:, :, :tokens]
        v = values.index_select(0, flat).view(batch, kv_heads, -1, dim)[:, :, :tokens]
        return sdpa_dense(k, v)

    def copy():
        return dense_keys.clone(), dense_values.clone()

    actions = {"paged": paged, "sdpa_dense": sdpa_dense, "gather_sdpa": gather_sdpa, "copy": copy}
    expected = sdpa_dense()
    torch.testing.assert_close(paged(), expected, atol=1e-5, rtol=1e-4)
    for action in actions.values():  # warm-up: numba compilation, allocator
        action()
    times: dict[str, list[float]] = {case: [] for case in CASES}
    with torch.inference_mode():
        for _ in range(repeats):
            for case in CASES:
                times[case].append(micros(actions[case], device))
    row = {"device": str(device), "model": model, "batch": batch, "tokens": tokens, "kv_bytes": dense_keys.nbytes + dense_values.nbytes}
    row.update({f"{case}_us": statistics.median(times[case]) for case in CASES})
    row["bandwidth_share_of_copy"] = row["copy_us"] / row["paged_us"]
    row["paged_vs_sdpa_dense"] = row["sdpa_dense_us"] / row["paged_us"]
    row["paged_vs_gather_sdpa"] = row["gather_sdpa_us"] / row["paged_us"]
    return row


def stored_layers(spec: str | None, batch: int, kv_heads: int, dim: int, tokens: int, layers: int, seed: int) -> list[PagedLayer]:
    """``layers`` layers of ``batch`` rows of ``tokens`` random tokens per KV head in a store, full
    pages sealed by ``spec``'s codec (None: float32 pages), as a decode step reads them."""
    codecs = (
        None
        if spec is None
        else parse_policy(spec).layer_codecs(layer_shapes(layers, kv_heads, dim, dim, PAGE_SIZE, torch.float32, devices.CPU))
    )
    store = PagedStore(StoreConfig(layers, kv_heads, dim, page_size=PAGE_SIZE, codecs=codecs, read_cache=False))
    rows = [store.new_sequence() for _ in range(batch)]
    generator = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        store.append(
            layer,
            rows,
            torch.randn(batch, kv_heads, tokens, dim, generator=generator),
            torch.randn(batch, kv_heads, tokens, dim, generator=generator),
        )
        if codecs is not None:
            store.seal(layer, rows)
    paged = [store.paged_layer(layer, rows) for layer in range(layers)]
    assert all(layer is not None for layer in paged), f"{spec}: no paged read of its pages"
    return paged


def bench_codecs(model: str, batch: int, tokens: int, specs: list[str], layers: int, repeats: int) -> dict:
    """Microseconds per call of the kernel over each codec's pages and over float32 pages, each
    call on the next of ``layers`` layers (pages the caches do not hold), rounds interleaved."""
    query_heads, kv_heads, dim = SHAPES[model]
    kinds = {FP32_PAGES: None} | {spec: spec for spec in specs}
    stores = {kind: stored_layers(spec, batch, kv_heads, dim, tokens, layers, tokens + batch) for kind, spec in kinds.items()}
    query = torch.randn(batch, query_heads, 1, dim, generator=torch.Generator().manual_seed(tokens))
    options = {"visible": None, "query_positions": torch.tensor([tokens]), "scale": dim**-0.5}
    for paged in stores.values():  # warm-up: numba compilation, allocator
        paged[0].attend(query, **options)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for _ in range(repeats):
            for kind, paged in stores.items():
                times[kind].append(
                    statistics.median(micros(lambda layer=layer: layer.attend(query, **options), devices.CPU) for layer in paged)
                )
    row = {
        "model": model,
        "batch": batch,
        "tokens": tokens,
        "layers": layers,
        "us": {kind: statistics.median(t) for kind, t in times.items()},
    }
    row["vs_fp32_pages"] = {
        kind: sorted(base / t for base, t in zip(times[FP32_PAGES], times[kind])) for kind in kinds if kind != FP32_PAGES
    }  # per round: the spread
    return row


def run(argv: Sequence[str] | None = None) -> dict:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, from {','.join(SHAPES)}")
    parser.add_argument("--contexts", help=f"tokens per (row, KV head), comma-separated (default {FULL['contexts']})")
    parser.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds (default {FULL['repeats']})")
    parser.add_argument("--device", default="cpu", help="where the pages and query live: cpu (numba kernel) or cuda (torch path)")
    parser.add_argument(
        "--codecs",
        help=f"';'-separated codec specs whose pages are read against fp32 pages on the CPU ('' for none; default {FULL['codecs']!r})",
    )
    parser.add_argument("--layers", type=int, help=f"layers cycled through in the coded-pages cases (default {FULL['layers']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(SHAPES))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(SHAPES)}")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"unknown device {args.device!r}; choose cpu (numba kernel) or cuda (torch path)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is available")
    device = devices.resolve_device(args.device)
    specs = [spec.strip() for spec in args.codecs.split(";") if spec.strip()] if device.type == "cpu" else []
    for spec in specs:
        parse_policy(spec)  # a bad spec is a ValueError before any work
    rows, coded = [], []
    for model in models:
        for tokens in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                rows.append(bench_case(model, batch, tokens, args.repeats, device))
                print(_row_line(rows[-1]), flush=True)
                if specs:
                    coded.append(bench_codecs(model, batch, tokens, specs, args.layers, args.repeats))
                    print(_coded_line(coded[-1]), flush=True)
    result = {
        **run_metadata(args, load_before, started),
        "command": command_line("bench_paged_attention.py", argv),
        "rows": rows,
        "coded": coded,
    }
    write_report(args.out, "bench_paged_attention", _markdown(result), result)
    return result


def _row_line(row: dict) -> str:
    return (
        f"{row['device']} {row['model']} batch {row['batch']} tokens {row['tokens']}: paged {row['paged_us']:.0f} us, SDPA dense "
        f"{row['sdpa_dense_us']:.0f} us, gather+SDPA {row['gather_sdpa_us']:.0f} us, copy {row['copy_us']:.0f} us, "
        f"bandwidth {row['bandwidth_share_of_copy']:.0%} of a copy"
    )


def _coded_line(row: dict) -> str:
    ratios = ", ".join(f"{kind} {statistics.median(r):.2f}x" for kind, r in row["vs_fp32_pages"].items())
    return f"{row['model']} batch {row['batch']} tokens {row['tokens']}: fp32 pages {row['us'][FP32_PAGES]:.0f} us; vs fp32 pages: {ratios}"


def _markdown(result: dict) -> str:
    lines = [
        "# bench_paged_attention: one decode step's attention over a layer's pages",
        "",
        f"Command: `{result['command']}`. Machine: {result['machine']}. Library revision: {result['git']}. "
        f"1-minute load before/after: {result['load_avg_1min']}.",
        "",
        f"Device: {result['rows'][0]['device'] if result['rows'] else '-'}. "
        "Microseconds per call (medians of interleaved rounds; on CUDA synchronized before and after each call), fp32, one query token per row, pages of 16 tokens "
        "in a shuffled arena order. `copy` clones the dense keys and values: the bytes the kernel reads, moved once; "
        "bandwidth = copy / paged (target >= 50%).",
        "",
        "| model | batch | tokens | KV MiB | paged us | SDPA dense us | gather+SDPA us | copy us | bandwidth vs copy | paged vs SDPA dense | paged vs gather+SDPA |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tokens']} | {r['kv_bytes'] / 2**20:.1f} | {r['paged_us']:.0f} | "
            f"{r['sdpa_dense_us']:.0f} | {r['gather_sdpa_us']:.0f} | {r['copy_us']:.0f} | {r['bandwidth_share_of_copy']:.0%} | "
            f"{r['paged_vs_sdpa_dense']:.2f}x | {r['paged_vs_gather_sdpa']:.2f}x |"
        )
    if result["coded"]:
        lines += [
            "",
            "## Coded pages against float32 pages",
            "",
            f"Microseconds per call through a store's paged layer (the decode kernel), each call on the next of "
            f"{result['coded'][0]['layers']} layers (pages the caches do not hold); ratio = fp32 pages' time / the codec's, "
            "median (min-max) over the interleaved rounds.",
            "",
            "| model | batch | tokens | pages | us | vs fp32 pages |",
            "|---|---:|---:|---|---:|---:|",
        ]
        for r in result["coded"]:
            for kind, us in r["us"].items():
                spread = r["vs_fp32_pages"].get(kind)
                ratio = "1" if spread is None else f"{statistics.median(spread):.2f}x ({spread[0]:.2f}-{spread[-1]:.2f})"
                lines.append(f"| {r['model']} | {r['batch']} | {r['tokens']} | `{kind}` | {us:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
