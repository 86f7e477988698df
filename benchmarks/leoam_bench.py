"""LeoAM on the embedded model at a 1k-token needle prompt: device bytes against the full cache,
pages each (row, KV head) reads per sparse decode step and pages fetched from off the device, and
needle accuracy beside the full cache, SnapKV at 0.25 and Quest reading as many pages.

    .venv/bin/python benchmarks/leoam_bench.py [--samples 2] [--context 1024]

Prints one line per configuration (a couple of minutes on 2 loaded CPU cores)."""

from __future__ import annotations

import argparse
import time

import kvlib
from kvlib.eval import NeedleTask, load_model
from kvlib.policies.tiering.leoam import LeoAM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2, help="needle cases per depth")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens")
    args = parser.parse_args()
    loaded = load_model("default")
    model, config = loaded.model, loaded.model.config
    task = NeedleTask(context=args.context, samples=args.samples)
    rows = args.samples * len(task.depths)
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    page_bytes = 16 * 2 * config.head_dim * next(model.parameters()).element_size()
    device_mb = 2 * heads * rows * layers * page_bytes / 2**20  # two pages per (row, KV head, layer): the newest
    placement = f"lru(device_mb={device_mb:.4f})"
    configs = {
        "full": None,
        "snapkv 0.25": "snapkv",
        "quest(top_k=16)": f"quest(top_k=16, placement='{placement}')",
        "leoam(top_k=16)": f"leoam(top_k=16, placement='{placement}')",
        "leoam(top_k=16, desert=3)": f"leoam(top_k=16, desert=3.0, placement='{placement}')",
        "quest(top_k=9)": f"quest(top_k=9, placement='{placement}')",
        "leoam(top_k=8)": f"leoam(top_k=8, placement='{placement}')",
    }
    print(f"default model, needle, {args.context}-token prompt, {rows} rows in one batch, device budget {device_mb:.2f} MiB")
    for label, spec in configs.items():
        made = []

        def make(tokens: int, spec=spec, made=made):
            budget = tokens // 4 if spec == "snapkv" else None
            cache = kvlib.make_cache(model, spec, budget=budget) if spec else kvlib.make_cache(model)
            made.append(cache)
            return cache

        start = time.perf_counter()
        result = task.run(model, loaded.tokenizer, make)
        seconds = time.perf_counter() - start
        cache = made[-1]
        report = cache.memory_report()
        by_tier, full = report["by_tier"], report["full_equivalent_bytes"]
        line = (
            f"{label:28s} accuracy {result.score:.2f}  device {by_tier['device'] / 2**20:6.2f} MiB ({by_tier['device'] / full:.2f}x full)"
        )
        line += f"  host {by_tier['host'] / 2**20:5.2f} MiB  disk {by_tier['disk']}"
        tiering = cache.tiering
        if tiering is not None and tiering.retrieves_pages:
            sparse = range(tiering.dense_layers, layers)
            per_step = (task.answer_room - 1) * rows * heads * len(sparse)  # decode steps after the prompt's token
            if isinstance(tiering, LeoAM):
                line += f"  pages read/head/step {sum(tiering.fetched.values()) / per_step:.2f}"
                line += f" (chunks judged {sum(tiering.judged.values()) / per_step:.1f})"
            off_device = sum(cache.store.pools[layer].pages_read for layer in sparse) / per_step
            line += f"  fetched off the device/head/step {off_device:.2f}"
        print(f"{line}  [{seconds:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
