"""Decode speed on a GPU against DynamicCache and a preallocated StaticCache, in one run (issue 34).

Everything is built on the device from random numbers; nothing is downloaded. The model is a
random-weight ``LlamaForCausalLM`` with Llama-3-8B's shapes (32 layers, hidden 4096, 32 query and
8 KV heads of head_dim 128, MLP 14336, vocab 128256) in bfloat16. Each cache starts holding a
context of random keys and values (no prefill is timed: ``KVCache.load`` for kvlib,
``update`` of every layer for transformers' caches), then runs ``--steps`` single-token forwards
after three untimed ones (CUDA events around each, the median reported), caches interleaved over
``--rounds`` rounds; each cache is freed before the next is built, so one context at a time is
on the device. Ratios are against the DynamicCache (and the StaticCache) of the same round.

Cases (``--cases``): ``b1-8k`` (batch 1, 8192 tokens) and ``b8-32k`` (batch 8, 32768 tokens).
Caches: ``dynamic``, ``static`` (``StaticCache`` sized to the context and the steps),
``exact`` (``make_cache(model)``), ``held25`` (``streaming_llm`` with an int budget of a quarter
of the context: a ring), ``kivi4`` (``kivi(bits=4)``).

The paged kernel alone (``--kernel``): ``kvlib::paged_decode`` over one layer of at least 256 MiB
of keys and values (batch 8, 8 KV heads, 32 query heads, head_dim 128, bfloat16), its bytes read
per second against a device-to-device copy of the same bytes (bytes read and written per second).

Targets: exact >= 1.0x DynamicCache at b1-8k and >= 1.5x at b8-32k; exact >= 0.9x StaticCache at
b8-32k; held25 >= 3x DynamicCache at b8-32k; kivi4 >= 1.2x exact at b8-32k; the kernel at >= 60%
of the copy's bandwidth. Writes ``gpu_decode.md`` and ``gpu_decode.json`` to ``--out``.

On a lent GPU machine (torch, triton and numba there; kvlib also needs transformers >= 5.18 and
lmdb, carried as wheels), ``benchmarks/gpu_check.sh`` runs the CUDA tests and this benchmark in
one go: ``benchmarks/gpu_check.sh --download`` here once, then ``benchmarks/gpu_check.sh`` there
with ``.whl`` carried (the device tool's README).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import kvlib
from kvlib.eval.output_files import replace_file  # noqa: E402
from kvlib.kernels import paged_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import git_revision  # noqa: E402

LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 65536,
}
CASES = {"b1-8k": (1, 8192), "b8-32k": (8, 32768)}
SMOKE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}
"""``--smoke``: a tiny model and contexts on the CPU, to check the script itself anywhere."""
SMOKE_CASES = {"b1-8k": (1, 64), "b8-32k": (2, 128)}
CACHES = ("dynamic", "static", "exact", "held25", "kivi4")
WARMUP = 3


class RandomLayers(Sequence):
    """Keys or values of every layer, made on the device when read (one layer at a time in memory)."""

    def __init__(self, layers: int, shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.layers, self.shape, self.seed, self.device, self.dtype = layers, shape, seed, device, dtype

    def __len__(self) -> int:
        return self.layers

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < self.layers:
            raise IndexError(layer)
        generator = torch.Generator(self.device).manual_seed(self.seed + layer)
        return torch.randn(self.shape, generator=generator, device=self.device, dtype=self.dtype)


def filled_cache(name: str, model: torch.nn.Module, batch: int, context: int, steps: int):
    """Cache ``name`` holding ``context`` random tokens per row in every layer."""
    config, device, dtype = model.config, model.device, model.dtype
    shape = (batch, config.num_key_value_heads, context, config.hidden_size // config.num_attention_heads)
    keys = RandomLayers(config.num_hidden_layers, shape, 1, device, dtype)
    values = RandomLayers(config.num_hidden_layers, shape, 1000, device, dtype)
    if name in ("dynamic", "static"):
        cache = DynamicCache(config=config) if name == "dynamic" else StaticCache(config=config, max_cache_len=context + steps + WARMUP)
        position = {"cache_position": torch.arange(context, device=device)}
        for layer in range(config.num_hidden_layers):
            cache.update(keys[layer], values[layer], layer, position)
        return cache
    spec = {"exact": None, "held25": "streaming_llm", "kivi4": "kivi(bits=4)"}[name]
    cache = kvlib.make_cache(model, spec, budget=context // 4) if name == "held25" else kvlib.make_cache(model, spec)
    cache.load(keys, values)
    return cache


def decode_seconds(model: torch.nn.Module, cache, batch: int, context: int, steps: int) -> float:
    """Median seconds of one decode step over ``steps`` after ``WARMUP`` untimed ones."""
    times, device = [], model.device
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    with torch.inference_mode():
        for step in range(WARMUP + steps):
            position = torch.full((batch, 1), context + step, device=device)
            _synchronize(device)
            start = time.perf_counter()
            logits = model(input_ids=token, position_ids=position, **kvlib.transformers_compat.cache_argument(cache), use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            _synchronize(device)
            if step >= WARMUP:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_case(model: torch.nn.Module, batch: int, context: int, caches: list[str], args: argparse.Namespace) -> dict:
    runs: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.rounds):
        for name in caches:
            cache = filled_cache(name, model, batch, context, args.steps)
            runs[name].append(decode_seconds(model, cache, batch, context, args.steps))
            del cache
            gc.collect()
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
    row = {"batch": batch, "context": context, "seconds": {name: statistics.median(times) for name, times in runs.items()}}
    for base in ("dynamic", "static", "exact"):
        if base in runs:
            row[f"vs_{base}"] = {
                name: statistics.median(b / t for b, t in zip(runs[base], times)) for name, times in runs.items() if name != base
            }
    return row


def bench_kernel(tokens: int = 16384, batch: int = 8, kv_heads: int = 8, heads: int = 32, dim: int = 128, page_size: int = 16) -> dict:
    """``kvlib::paged_decode`` over one layer's pages against a copy of the same bytes."""
    pages_per_head = tokens // page_size
    capacity = batch * kv_heads * pages_per_head
    keys = torch.randn(capacity, page_size, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    positions = (
        torch.arange(page_size, device="cuda").repeat(capacity, 1)
        + torch.arange(pages_per_head, device="cuda").repeat(batch * kv_heads).unsqueeze(-1) * page_size
    )
    pages = torch.randperm(capacity, device="cuda").view(1, batch, kv_heads, pages_per_head)
    lengths = torch.full((1, batch, kv_heads), tokens, device="cuda")
    query = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    causal = torch.tensor([tokens], device="cuda")

    def attend() -> None:
        paged_ops.paged_decode(query, keys, values, positions, pages, lengths, 0, None, causal, dim**-0.5)

    def copy() -> None:
        keys.clone()
        values.clone()

    kv_bytes = 2 * keys.numel() * keys.element_size()
    attend_s, copy_s = _timed(attend), _timed(copy)
    kernel_bandwidth, copy_bandwidth = kv_bytes / attend_s, 2 * kv_bytes / copy_s  # a copy reads and writes
    return {
        "kv_mib": kv_bytes / 2**20,
        "kernel_gb_s": kernel_bandwidth / 1e9,
        "copy_gb_s": copy_bandwidth / 1e9,
        "fraction_of_copy": kernel_bandwidth / copy_bandwidth,
    }


def _timed(action: Callable[[], None], repeats: int = 20) -> float:
    for _ in range(3):
        action()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        action()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def markdown(result: dict) -> str:
    lines = [f"# Decode on {result['device']}: a random Llama-3-8B-shaped model, bfloat16", ""]
    for row in result["cases"]:
        lines += [
            f"## batch {row['batch']}, {row['context']} tokens",
            "",
            "| cache | ms / step | vs DynamicCache | vs StaticCache | vs exact |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, seconds in row["seconds"].items():
            ratios = [row.get(f"vs_{base}", {}).get(name) for base in ("dynamic", "static", "exact")]
            cells = " | ".join("-" if ratio is None else f"{ratio:.2f}x" for ratio in ratios)
            lines.append(f"| {name} | {seconds * 1000:.1f} | {cells} |")
        lines.append("")
    if "kernel" in result:
        kernel = result["kernel"]
        lines += [
            f"Paged kernel alone, {kernel['kv_mib']:.0f} MiB of keys and values: {kernel['kernel_gb_s']:.0f} GB/s read, a copy"
            f" {kernel['copy_gb_s']:.0f} GB/s (read + written): {kernel['fraction_of_copy']:.0%}.",
            "",
        ]
    lines.append(f"Command: `{result['command']}`, revision {result['git']}, torch {torch.__version__}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated, from {', '.join(CACHES)}")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-kernel", dest="kernel", action="store_false", help="skip the paged kernel alone")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and contexts on the CPU (checks the script, measures nothing)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device (--smoke runs a tiny version on the CPU)")
    torch.manual_seed(0)
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
    result: dict = {"device": name, "command": "python benchmarks/gpu_decode.py " + " ".join(argv or sys.argv[1:]), "git": git_revision()}
    if args.kernel and not args.smoke:
        result["kernel"] = bench_kernel()
    with torch.device(device):
        config = LlamaConfig(**(SMOKE if args.smoke else LLAMA3_8B), dtype=torch.bfloat16)
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    kvlib.attach(model)
    caches = args.caches.split(",")
    cases = SMOKE_CASES if args.smoke else CASES
    result["cases"] = [bench_case(model, *cases[case], caches, args) for case in args.cases.split(",")]
    text = markdown(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    replace_file(args.out / "gpu_decode.md", text)
    replace_file(args.out / "gpu_decode.json", json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
