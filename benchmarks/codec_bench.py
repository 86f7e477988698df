"""Page codecs in one run: bytes held, encode/decode throughput against a plain copy, decode speed
on the ~100M random Llama, and quality on a trained model (``--quality-model``, default the embedded
``default`` model; alone, and beside eviction at equal bytes).

Sections (``--sections``, all by default):

- ``bytes``: bytes one sealed page holds (codes plus scales, zero points and fitted state shared
  per page) over the same tokens' keys and values in fp16, for head_dim 128, value group 32, at
  page sizes ``--page-sizes``. KIVI's per-channel key scales are shared by a page's tokens, so
  their cost per token falls as pages grow. Targets (at ``--target-page-size``): int4 <= 0.30,
  int2 <= 0.18, int8 <= 0.55.
- ``throughput``: ``--throughput-mib`` MiB of keys and values in the compute dtype (head_dim 128,
  16-token pages, random normal data with per-channel offsets) encoded in batches of 1024 pages
  (as sealing does) and decoded back into a dense buffer with ``decode_into`` (as a read does);
  GB/s of uncompressed bytes, beside ``torch.Tensor.copy_`` of the same bytes in the same run (the
  memory bandwidth limit). Medians of ``--repeats``. Targets: encode >= 10%, decode >= 20% of copy.
- ``decode``: greedy decode tokens/s of the ~100M random Llama (``--decode-model``) after a
  ``--prompt-len`` prompt, batch 1, ``--new-tokens`` steps, with ``kvlib.make_cache(model)`` (no
  codec: exact, with its read mirror) and with each of ``--decode-specs`` (no mirror: every read
  decodes the pages), through :func:`kvlib.eval.decode_timing.measure`: a warm-up run of each (the
  same run, untimed: the numba kernels compile there; its extra seconds are the first call's),
  then ``--repeats`` interleaved rounds; tokens/s medians, the ratio to the exact cache the median
  [min, max] of each round's. Target: ``kivi(bits=4)`` >= 0.7x the exact cache.
- ``quality``: ``--quality-model``, as ``eviction_quality.py`` measures it (model-sampled texts; greedy
  agreement and KL(full || compressed) over ``--new-tokens-quality`` teacher-forced steps;
  perplexity of a held-out continuation), for each codec of ``--codecs`` alone, then at equal
  bytes: for each target fraction in ``--byte-budgets`` of the full cache's KV bytes and each
  eviction policy of ``--evictions``, the policy alone at that fraction of the tokens, and
  with each codec keeping ``fraction / (codec's bytes ratio)`` of the tokens (when that is <= 1).
  KV bytes are pages + codec metadata + positions at the end of the perplexity pass (what each
  stored token costs; block tables and read mirrors excluded).
- ``smollm2``: SmolLM2-135M-Instruct at ``--smollm2-contexts`` prompt tokens of natural text, mean
  KL(full || codec) over ``--smollm2-steps`` teacher-forced steps and KV bytes, for each of
  ``--smollm2-specs`` (:mod:`codec_quality_smollm2`). Targets: ``rotated(bits=2)`` at most half
  the KL of ``kivi(bits=2)`` at no more bytes, ``rotated(bits=4)`` KL <= 0.01, ``gear(bits=4)``
  below ``kivi(bits=4)``'s KL at no more than 1.25x its bytes. Not in ``--quick``.

Usage:

    python benchmarks/codec_bench.py [--sections bytes,throughput,decode,quality] [--threads N]
        [--throughput-mib 512] [--repeats 3] [--prompt-len 2048] [--new-tokens 64]
        [--quality-model default] [--out benchmarks/results]
    python benchmarks/codec_bench.py --quick --out /tmp/x   # tiny sizes, the default model only

Writes ``codec_bench.md`` and ``codec_bench.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

import kvlib
from kvlib.codec import FitSample, PageCodec, layer_shapes
from kvlib.eval import load_model
from kvlib.eval.decode_timing import Decoded, Spread, measure
from kvlib.spec import parse_spec
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from codec_quality_smollm2 import SMOLLM2_HEADER, smollm2_kl, smollm2_line  # noqa: E402
from eviction_quality import evaluate, sample_texts  # noqa: E402
from provenance import (  # noqa: E402
    add_run_arguments,
    command_line,
    load_bench_model,
    median_seconds,
    parse_run_arguments,
    run_metadata,
    write_report,
)

SECTIONS = ("bytes", "throughput", "decode", "quality", "smollm2")
BYTE_CODECS = (
    "int8",
    "fp8",
    "kivi(bits=8)",
    "kivi(bits=4)",
    "kivi(bits=2)",
    "kv_bits(key_bits=4, value_bits=2)",
    "gear",
    "rotated(bits=2)",
    "rotated(bits=4)",
    "svd(rank=32)",
    "think(keep=0.5)",
)
THROUGHPUT_CODECS = (
    "int8",
    "fp8",
    "kivi(bits=8)",
    "kivi(bits=4)",
    "kivi(bits=2)",
    "kv_bits(key_bits=4, value_bits=2)",
    "rotated(bits=4)",
    "rotated(bits=2)",
    "gear",
)
QUALITY_CODECS = (
    "int8",
    "fp8",
    "kivi(bits=8)",
    "kivi(bits=4)",
    "kivi(bits=2)",
    "kv_bits(key_bits=4, value_bits=2)",
    "kv_bits(key_bits=2, value_bits=4)",
    "gear",
    "svd",
    "svd(rank=4)",
    "xkv(rank=4)",
    "think(keep=0.5)",
    "minicache",
    "minicache(start=0.0)",
)
PAIR_CODECS = ("int8", "kivi(bits=4)", "kivi(bits=2)", "kv_bits(key_bits=4, value_bits=2)")
TARGETS = {"int8": 0.55, "kivi(bits=4)": 0.30, "kivi(bits=2)": 0.18}
FULL = {
    "sections": ",".join(SECTIONS),
    "page_sizes": "16,32,64,128",
    "target_page_size": 64,
    "throughput_mib": 512,
    "repeats": 3,
    "decode_model": "llama100m",
    "prompt_len": 2048,
    "new_tokens": 64,
    "decode_specs": "kivi(bits=4);kivi(bits=2);int8;fp8",
    "contexts": 8,
    "context_len": 400,
    "new_tokens_quality": 100,
    "continuation_len": 100,
    "codecs": ";".join(QUALITY_CODECS),
    "pair_codecs": ";".join(PAIR_CODECS),
    "evictions": "snapkv,streaming_llm",
    "byte_budgets": "0.25,0.125",
    "smollm2_specs": "kivi(bits=2);rotated(bits=2);kivi(bits=4);rotated(bits=4);gear",
    "smollm2_contexts": "2048,4096",
    "smollm2_steps": 32,
}
QUICK = {
    "sections": ",".join(SECTIONS[:-1]),
    "page_sizes": "16,64",
    "target_page_size": 64,
    "throughput_mib": 4,
    "repeats": 1,
    "decode_model": "default",
    "prompt_len": 64,
    "new_tokens": 4,
    "decode_specs": "kivi(bits=4)",
    "contexts": 2,
    "context_len": 48,
    "new_tokens_quality": 8,
    "continuation_len": 8,
    "codecs": "int8;kivi(bits=4);svd(rank=4)",
    "pair_codecs": "kivi(bits=4)",
    "evictions": "streaming_llm",
    "byte_budgets": "0.25",
    "smollm2_specs": "kivi(bits=4);gear",
    "smollm2_contexts": "2048",
    "smollm2_steps": 8,
}
HEAD_DIM = 128
VALUE_GROUP = 32
BATCH_PAGES = 1024


def layer_codec(spec: str, page_size: int, dtype: torch.dtype, heads: int = 1) -> PageCodec:
    """The codec ``spec`` builds for one layer (head_dim 128), fitted on random data if it fits."""
    policy = parse_spec(spec).quantization or parse_spec(spec).lowrank
    shapes = layer_shapes(1, heads, HEAD_DIM, HEAD_DIM, page_size, dtype, torch.device("cpu"))
    codec = policy.layer_codecs(shapes)[0]
    if not codec.ready:
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(1, heads, 256, HEAD_DIM, generator=generator).to(dtype)
        valid = torch.ones(1, heads, 256, dtype=torch.bool)
        codec.observe(FitSample(0, keys, keys, valid, keys, torch.ones(1, 256, dtype=torch.bool)))
    return codec


def bytes_section(page_sizes: list[int]) -> list[dict]:
    rows = []
    for spec in BYTE_CODECS:
        row = {"codec": spec, "ratio": {}}
        for size in page_sizes:
            codec = layer_codec(spec, size, torch.float16)
            fp16 = 2 * size * HEAD_DIM * 2
            row["ratio"][size] = (codec.page_bytes() + codec.state_bytes() / 1e9) / fp16  # state: per layer, ~0 per page
            row.setdefault("metadata_share", {})[size] = codec.page_bytes(metadata=True) / codec.page_bytes()
        rows.append(row)
    return rows


def throughput_section(mib: int, repeats: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.float16):
        element = torch.empty((), dtype=dtype).element_size()
        pages = max(1, mib * 2**20 // (2 * 16 * HEAD_DIM * element))  # keys + values
        generator = torch.Generator().manual_seed(1)
        offsets = torch.randn(HEAD_DIM, generator=generator) * 4
        keys = (torch.randn(pages, 16, HEAD_DIM, generator=generator) + offsets).to(dtype)
        values = torch.randn(pages, 16, HEAD_DIM, generator=generator).to(dtype)
        uncompressed = 2 * keys.numel() * element
        out_keys, out_values = torch.empty_like(keys), torch.empty_like(values)
        out_keys.copy_(keys), out_values.copy_(values)  # touch the pages once
        copy = median_seconds(lambda: (out_keys.copy_(keys), out_values.copy_(values)), repeats)
        for spec in THROUGHPUT_CODECS:
            codec = layer_codec(spec, 16, dtype)
            heads = torch.zeros(pages, dtype=torch.int64)
            arenas = {name: torch.empty(pages, *field.shape, dtype=field.dtype) for name, field in codec.fields.items()}

            def encode() -> None:
                for first in range(0, pages, BATCH_PAGES):
                    chunk = slice(first, min(first + BATCH_PAGES, pages))
                    for name, t in codec.encode(keys[chunk], values[chunk], heads[chunk]).items():
                        arenas[name][chunk] = t

            def decode() -> None:
                for first in range(0, pages, BATCH_PAGES):
                    ids = torch.arange(first, min(first + BATCH_PAGES, pages))
                    codec.decode_into(arenas, ids, heads[ids], out_keys, out_values, ids)

            encode(), decode()  # warm-up: compiles the kernels
            encode_s, decode_s = median_seconds(encode, repeats), median_seconds(decode, repeats)
            error = max(float((out_keys.float() - keys.float()).abs().max()), float((out_values.float() - values.float()).abs().max()))
            rows.append(
                {
                    "codec": spec,
                    "dtype": str(dtype).removeprefix("torch."),
                    "uncompressed_bytes": uncompressed,
                    "copy_gb_s": uncompressed / copy / 1e9,
                    "encode_gb_s": uncompressed / encode_s / 1e9,
                    "decode_gb_s": uncompressed / decode_s / 1e9,
                    "encode_vs_copy": copy / encode_s,
                    "decode_vs_copy": copy / decode_s,
                    "max_abs_error": error,
                }
            )
            print(
                f"throughput {spec} {dtype}: encode {rows[-1]['encode_vs_copy']:.0%} decode {rows[-1]['decode_vs_copy']:.0%} of copy",
                flush=True,
            )
        gc.collect()
    return rows


def decode_once(model: torch.nn.Module, spec: str | None, prompt: torch.Tensor, new_tokens: int) -> Decoded:
    """One run: a fresh cache, the prompt's prefill, then ``new_tokens`` greedy steps, timed; the detail
    is the cache's bytes at the end."""
    gc.collect()
    cache = kvlib.make_cache(model) if spec is None else kvlib.make_cache(model, spec)
    with torch.inference_mode():
        out = model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(new_tokens):
            token = model(input_ids=token, **cache_argument(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        seconds = time.perf_counter() - start
    report = cache.memory_report()
    return Decoded(new_tokens, seconds, {"total_bytes": report["total_bytes"], "by_component": report["by_component"]})


def decode_section(args: argparse.Namespace) -> list[dict]:
    model = load_bench_model(args.decode_model)
    kvlib.attach(model)
    specs: list[str | None] = [None, *[s.strip() for s in args.decode_specs.split(";") if s.strip()]]
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(2))
    timers = [lambda spec=spec: decode_once(model, spec, prompt, args.new_tokens) for spec in specs]
    timings = measure(timers, args.repeats, errors=())
    rows = []
    for spec, timing in zip(specs, timings):
        ratio = Spread.of(timing.vs(timings[0]))
        rows.append(
            {
                "spec": spec or "exact",
                "tok_s": timing.speed.median,
                "all_tok_s": timing.tokens_per_s,
                "first_call_s": timing.first_call_s,
                "vs_exact": ratio.median,
                "vs_exact_low": ratio.low,
                "vs_exact_high": ratio.high,
                "total_bytes": timing.runs[-1].detail["total_bytes"],
                "by_component": timing.runs[-1].detail["by_component"],
            }
        )
        print(f"decode {spec or 'exact'}: {timing.speed.text('{:.1f}'.format)} tok/s", flush=True)
    return rows


def kv_bytes(row: dict) -> int:
    return row["pages_bytes"] + row["codec_metadata_bytes"] + row["positions_bytes"]


def quality_section(args: argparse.Namespace) -> dict:
    loaded = load_model(args.quality_model)
    model, tokenizer = loaded.model, loaded.tokenizer
    texts = sample_texts(model, tokenizer, args.contexts, args.context_len + args.continuation_len, 0, 0.8)
    context, continuation = texts[:, : args.context_len], texts[:, args.context_len :]
    kvlib.attach(model)
    from kvlib.eval.agreement import greedy_reference

    tokens, logits = greedy_reference(model, kvlib.make_cache(model), context, args.new_tokens_quality)

    def measure(label: str, spec: str | None, budget: int | None, **extra) -> dict:
        make = (lambda: kvlib.make_cache(model)) if spec is None else (lambda: kvlib.make_cache(model, spec, budget=budget))
        row = {"label": label, "spec": spec or "full", "budget": budget, **extra}
        try:
            row.update(evaluate(model, make, context, tokens, logits, continuation))
            row["kv_bytes"] = kv_bytes(row)
        except Exception as error:  # one failing configuration must not stop the others
            row["error"] = f"{type(error).__name__}: {error}"
        print(
            f"quality {label}: " + (row.get("error") or f"agreement {row['agreement']:.3f} KL {row['kl']:.4f} ppl {row['ppl']:.3f}"),
            flush=True,
        )
        return row

    full = measure("full", None, None)
    adjacent = adjacent_cosines(model, context)
    codecs = [measure(spec, spec, None) for spec in args.codecs.split(";") if spec.strip()]
    for row in codecs:
        if "error" not in row:
            row["bytes_vs_full"] = row["kv_bytes"] / full["kv_bytes"]
    ratio = {row["spec"]: row["bytes_vs_full"] for row in codecs if "error" not in row}

    def at_bytes(spec: str, fraction: float, share: float) -> dict:
        """``spec`` keeping ``share`` of the context's tokens, corrected once toward ``fraction`` of
        the full cache's bytes (open pages and per-page scales make bytes per token depend on it)."""
        for attempt in range(2):
            tokens_kept = max(1, min(args.context_len, int(share * args.context_len)))
            row = measure(f"{spec} @ {fraction:g}", spec, tokens_kept, target=fraction, token_fraction=tokens_kept / args.context_len)
            if "error" in row:
                return row
            row["bytes_vs_full"] = row["kv_bytes"] / full["kv_bytes"]
            if attempt or abs(row["bytes_vs_full"] / fraction - 1) <= 0.05:
                return row
            share *= fraction / row["bytes_vs_full"]
        return row

    pairs = []
    for fraction in [float(f) for f in args.byte_budgets.split(",") if f.strip()]:
        for eviction in [e.strip() for e in args.evictions.split(",") if e.strip()]:
            pairs.append(at_bytes(eviction, fraction, fraction))
            for codec in [c.strip() for c in args.pair_codecs.split(";") if c.strip()]:
                if codec not in ratio:
                    ratio[codec] = measure(codec, codec, None)["kv_bytes"] / full["kv_bytes"]
                if fraction / ratio[codec] <= 1:
                    pairs.append(at_bytes(f"{eviction}+{codec}", fraction, fraction / ratio[codec]))
    return {"full": full, "codecs": codecs, "pairs": pairs, "adjacent_cosine": adjacent}


def adjacent_cosines(model: torch.nn.Module, context: torch.Tensor) -> list[dict]:
    """Mean cosine between each token's keys (and values) in adjacent layers, per KV head: how
    much MiniCache's merge has to work with (it assumes deep layers point alike)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=context, **cache_argument(cache), use_cache=True)
    rows = []
    for layer in range(len(cache.layers) - 1):
        a, b = cache.layers[layer], cache.layers[layer + 1]
        rows.append(
            {
                "layers": [layer, layer + 1],
                "keys": torch.nn.functional.cosine_similarity(a.keys, b.keys, dim=-1).mean().item(),
                "values": torch.nn.functional.cosine_similarity(a.values, b.values, dim=-1).mean().item(),
            }
        )
    return rows


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", help=f"comma-separated, from {','.join(SECTIONS)} (default all)")
    parser.add_argument("--page-sizes", help=f"bytes section (default {FULL['page_sizes']})")
    parser.add_argument("--target-page-size", type=int, help="page size the byte targets are checked at (default 64)")
    parser.add_argument("--throughput-mib", type=int, help=f"MiB of keys + values (default {FULL['throughput_mib']})")
    parser.add_argument("--repeats", type=int, help=f"timed repeats (default {FULL['repeats']})")
    parser.add_argument("--decode-model", choices=["llama100m", "default"], help="decode section model (default llama100m)")
    parser.add_argument("--prompt-len", type=int, help=f"decode section prompt (default {FULL['prompt_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"decode steps timed (default {FULL['new_tokens']})")
    parser.add_argument("--decode-specs", help=f"';'-separated codecs timed (default {FULL['decode_specs']})")
    parser.add_argument("--quality-model", default="default", help="quality: any kvlib.eval.load_model name (default: the embedded model)")
    parser.add_argument("--contexts", type=int, help=f"quality: contexts (default {FULL['contexts']})")
    parser.add_argument("--context-len", type=int, help=f"quality: context tokens (default {FULL['context_len']})")
    parser.add_argument("--new-tokens-quality", type=int, help=f"quality: greedy steps (default {FULL['new_tokens_quality']})")
    parser.add_argument("--continuation-len", type=int, help=f"quality: held-out tokens (default {FULL['continuation_len']})")
    parser.add_argument("--codecs", help="quality: ';'-separated codecs measured alone")
    parser.add_argument("--pair-codecs", help="quality: ';'-separated codecs paired with eviction at equal bytes")
    parser.add_argument("--evictions", help=f"quality: eviction policies paired (default {FULL['evictions']})")
    parser.add_argument("--byte-budgets", help=f"quality: KV byte fractions of the full cache (default {FULL['byte_budgets']})")
    parser.add_argument("--smollm2-specs", help=f"smollm2: ';'-separated codecs (default {FULL['smollm2_specs']})")
    parser.add_argument("--smollm2-contexts", help=f"smollm2: prompt tokens, comma-separated (default {FULL['smollm2_contexts']})")
    parser.add_argument("--smollm2-steps", type=int, help=f"smollm2: teacher-forced steps (default {FULL['smollm2_steps']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    page_sizes = [int(p) for p in args.page_sizes.split(",") if p.strip()]
    if args.target_page_size not in page_sizes:
        parser.error(f"--target-page-size {args.target_page_size} must be one of --page-sizes {page_sizes}")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    result: dict = {}
    if "bytes" in sections:
        result["bytes"] = bytes_section(page_sizes)
    if "throughput" in sections:
        result["throughput"] = throughput_section(args.throughput_mib, args.repeats)
    if "decode" in sections:
        result["decode"] = decode_section(args)
    if "quality" in sections:
        result["quality"] = quality_section(args)
    if "smollm2" in sections:
        contexts = [int(c) for c in args.smollm2_contexts.split(",") if c.strip()]
        result["smollm2"] = smollm2_kl(args.smollm2_specs.split(";"), contexts, args.smollm2_steps)
    result.update(run_metadata(args, load_before, started))
    write_report(args.out, "codec_bench", _markdown(result, argv), result)
    return result


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c = result["config"]
    lines = [
        "# codec_bench: page codecs (bytes, throughput, decode speed, quality)",
        "",
        f"Command: `{command_line('codec_bench.py', argv)}`",
        "",
        f"Machine: {result['machine']}; 1-minute load {result['load_avg_1min'][0]} before, "
        f"{result['load_avg_1min'][1]} after; {result['seconds']} s. Library revision: {result['git']}.",
    ]
    if "bytes" in result:
        sizes = list(result["bytes"][0]["ratio"])
        target_size = c["target_page_size"]
        lines += [
            "",
            "## Bytes per token relative to fp16 (head_dim 128, value group 32; scales and zero points included)",
            "",
            "| codec | " + " | ".join(f"page {s}" for s in sizes) + f" | target (page {target_size}) |",
            "|---|" + "---:|" * len(sizes) + "---|",
        ]
        for row in result["bytes"]:
            target = TARGETS.get(row["codec"])
            verdict = "-" if target is None else f"<= {target}: {'met' if row['ratio'][target_size] <= target else 'MISSED'}"
            lines.append(f"| {row['codec']} | " + " | ".join(f"{row['ratio'][s]:.3f}" for s in sizes) + f" | {verdict} |")
    if "throughput" in result:
        lines += [
            "",
            f"## Encode and decode throughput ({c['throughput_mib']} MiB of keys + values, head_dim 128, 16-token pages, batches of {BATCH_PAGES} pages)",
            "",
            "GB/s of uncompressed bytes in the compute dtype; copy: `copy_` of the same bytes in the same run.",
            "",
            "| codec | dtype | copy GB/s | encode GB/s | encode / copy | decode GB/s | decode / copy | max abs error |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["throughput"]:
            lines.append(
                f"| {r['codec']} | {r['dtype']} | {r['copy_gb_s']:.2f} | {r['encode_gb_s']:.2f} | {r['encode_vs_copy']:.0%} "
                f"| {r['decode_gb_s']:.2f} | {r['decode_vs_copy']:.0%} | {r['max_abs_error']:.3g} |"
            )
        lines += ["", "Targets: encode >= 10% and decode >= 20% of copy."]
    if "decode" in result:
        lines += [
            "",
            f"## Decode speed ({c['decode_model']}, prompt {c['prompt_len']}, {c['new_tokens']} greedy steps, batch 1, median of {c['repeats']})",
            "",
            "A warm-up run of each cache, then interleaved rounds; vs exact: median [min, max] of each round's ratio; first call:"
            " the seconds the warm-up run took beyond a timed one (kernel compilation included).",
            "",
            "| cache | tok/s | vs exact | first call (s) | bytes held | pages + codec metadata | read mirror |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["decode"]:
            b = r["by_component"]
            lines.append(
                f"| {r['spec']} | {r['tok_s']:.1f} | {Spread(r['vs_exact'], r['vs_exact_low'], r['vs_exact_high']).text('{:.2f}'.format)} "
                f"| {r['first_call_s']:.2f} | {r['total_bytes'] / 2**20:.1f} MiB "
                f"| {(b['pages'] + b['codec_metadata']) / 2**20:.1f} MiB | {b['read_cache'] / 2**20:.1f} MiB |"
            )
        lines += [
            "",
            "Target: kivi(bits=4) >= 0.7x exact. The exact cache decodes from its dense read mirror; codec caches keep no mirror, so every read decodes the pages.",
        ]
    if "quality" in result:
        q = result["quality"]
        full = q["full"]
        lines += [
            "",
            f"## Quality on the {c['quality_model']} model ({c['contexts']} contexts of {c['context_len']} tokens, {c['new_tokens_quality']} greedy steps, {c['continuation_len']}-token continuation)",
            "",
            f"Full cache: perplexity {full['ppl']:.3f}. KV bytes: pages + codec metadata + positions.",
            "",
            "| codec | KV bytes vs full | greedy agreement | KL (nats) | perplexity | ppl / full |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in q["codecs"]:
            lines.append(_quality_line(r, full, r["spec"]))
        cosines = ", ".join(f"{r['layers'][0]}-{r['layers'][1]}: {r['keys']:.2f} / {r['values']:.2f}" for r in q["adjacent_cosine"])
        lines += ["", f"Mean cosine of adjacent layers' keys / values per token (what MiniCache merges): {cosines}."]
        lines += [
            "",
            "### Eviction and codecs at equal bytes",
            "",
            "| target bytes | configuration | tokens kept | KV bytes vs full | greedy agreement | KL (nats) | perplexity | ppl / full |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in q["pairs"]:
            if "error" in r:
                lines.append(f"| {r['target']:g} | {r['label']} | error: {r['error'][:100]} | | | | | |")
                continue
            lines.append(
                f"| {r['target']:g} | {r['spec']} | {r['token_fraction']:.0%} | {r['bytes_vs_full']:.3f} | {r['agreement']:.3f} "
                f"| {r['kl']:.4f} | {r['ppl']:.3f} | {r['ppl'] / full['ppl']:.3f} |"
            )
    if "smollm2" in result:
        lines += ["", "## SmolLM2-135M-Instruct: KL(full || codec) at long prompts", "", SMOLLM2_HEADER]
        lines += [smollm2_line(r) for r in result["smollm2"]]
    return "\n".join(lines)


def _quality_line(r: dict, full: dict, label: str) -> str:
    if "error" in r:
        return f"| {label} | error: {r['error'][:100]} | | | | |"
    return f"| {label} | {r['bytes_vs_full']:.3f} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['ppl']:.3f} | {r['ppl'] / full['ppl']:.3f} |"


if __name__ == "__main__":
    run()
