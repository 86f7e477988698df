"""Mixed precision (``mixed``, ZipCache) against uniform codecs of the same average bits on
SmolLM2-135M-Instruct: KL(full || codec) of the next-token distributions and KV bytes.

The same measurement as :mod:`codec_quality_smollm2` (natural-text prompt, the full cache's greedy
tokens, each cache teacher-forced through them), for configurations ``spec`` or ``spec@budget``:
a budget (a fraction of the prompt) lets an eviction policy in the spec score tokens, so that
at ``@1.0`` it evicts nothing and only decides the codec's salience (``"snapkv+mixed(...)@1.0"``).
The RULER-style tasks run through ``kvlib compare`` (see ``results/mixed_smollm2.md``).

    python benchmarks/mixed_smollm2.py --configs "kv_bits(key_bits=4,value_bits=2);mixed(high_bits=4,low_bits=2,salient=0.5)" --context 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvlib
from kvlib.eval import load_model
from kvlib.eval.agreement import greedy_reference, teacher_forced_logits
from kvlib.eval.output_files import replace_file  # noqa: E402
from kvlib.eval.task import kv_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from codec_quality_smollm2 import natural_prompt  # noqa: E402

DEFAULT_CONFIGS = (
    "kivi(bits=2);kv_bits(key_bits=4,value_bits=2);mixed(high_bits=4,low_bits=2,salient=0.5);"
    "kivi(bits=4);mixed(high_bits=8,low_bits=2,salient=0.3125)"
)


def run(configs: list[str], context: int, steps: int, seed: int) -> list[dict]:
    """One row per configuration: ``kl`` (nats per teacher-forced step), ``agreement`` (argmax
    equal to the full cache's greedy token), ``kv_bytes``, ``bytes_ratio`` (over the full cache's), ``seconds``."""
    loaded = load_model("smollm2")
    model = loaded.model
    prompt = natural_prompt(loaded.tokenizer, context, seed)
    tokens, reference = greedy_reference(model, kvlib.make_cache(model), prompt, steps)
    reference_logp = torch.log_softmax(reference, -1)
    rows = []
    for config in configs:
        spec, _, budget = config.partition("@")
        cache = kvlib.make_cache(model, spec, budget=float(budget) if budget else None)
        start = time.perf_counter()
        logits = teacher_forced_logits(model, cache, prompt, tokens)
        seconds = time.perf_counter() - start
        kl = (reference_logp.exp() * (reference_logp - torch.log_softmax(logits, -1))).sum(-1).mean().item()
        held, full = kv_bytes(cache)
        agreement = (logits.argmax(-1) == tokens).float().mean().item()
        rows.append({"config": config, "context": context, "kl": kl, "agreement": agreement, "kv_bytes": held, "bytes_ratio": held / full})
        rows[-1]["seconds"] = seconds
        print(f"| `{config}` | {kl:.5f} | {agreement:.3f} | {held:,} | {held / full:.4f} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="'spec' or 'spec@budget', separated by ';'")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="256 tokens, 8 steps (a smoke run)")
    parser.add_argument("--out", default="", help="a folder for mixed_smollm2.json (default: none)")
    args = parser.parse_args()
    context, steps = (256, 8) if args.quick else (args.context, args.steps)
    print("| configuration | KL (nats/step) | agreement | KV bytes | bytes / full |\n|---|---|---|---|---|")
    rows = run(args.configs.split(";"), context, steps, args.seed)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        replace_file(Path(args.out) / "mixed_smollm2.json", json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
