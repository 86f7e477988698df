"""Codec quality on SmolLM2-135M-Instruct at long prompts: KL(full || codec) and KV bytes.

For each prompt length of ``contexts``, a natural-text prompt (essay sentences from the RULER
haystack generator, BOS first, cut to the length) is prefilled; the full cache decodes ``steps``
greedy tokens; each codec's cache is fed the same tokens one at a time (teacher forcing) and its
next-token distributions are compared with the full cache's: mean KL(full || codec) in nats per
step. KV bytes are pages plus codec metadata at the end (``memory_report``, as the eval tasks
count them), over the full cache's (``full_equivalent_bytes``).

Used by ``codec_bench.py``'s ``smollm2`` section, or alone:

    python benchmarks/codec_quality_smollm2.py --specs "kivi(bits=4);gear" --contexts 2048,4096
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import torch

import kvlib
from kvlib.eval import load_model
from kvlib.eval.agreement import greedy_reference, teacher_forced_logits
from kvlib.eval.ruler.haystack import essay
from kvlib.eval.task import kv_bytes


def natural_prompt(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` ids: BOS, then essay sentences (RULER's haystack filler) cut to ``length``."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < length:
        ids = tokenizer.encode(" ".join(essay(length // 6, rng)), bos=True)
    return torch.tensor([ids[:length]])


def smollm2_kl(specs: Sequence[str], contexts: Sequence[int], steps: int = 32, seed: int = 0) -> list[dict]:
    """One row per (context, spec): ``kl`` (mean KL(full || codec), nats per teacher-forced step),
    ``kv_bytes``, ``bytes_ratio`` (over the full cache's), ``agreement`` (argmax equal to the full
    cache's greedy token), ``seconds`` (prefill and steps)."""
    loaded = load_model("smollm2")
    model = loaded.model
    rows = []
    for context in contexts:
        prompt = natural_prompt(loaded.tokenizer, context, seed)
        tokens, reference = greedy_reference(model, kvlib.make_cache(model), prompt, steps)
        reference_logp = torch.log_softmax(reference, -1)
        for spec in specs:
            cache = kvlib.make_cache(model, spec)
            start = time.perf_counter()
            logits = teacher_forced_logits(model, cache, prompt, tokens)
            seconds = time.perf_counter() - start
            kl = (reference_logp.exp() * (reference_logp - torch.log_softmax(logits, -1))).sum(-1).mean().item()
            held, full = kv_bytes(cache)
            agreement = (logits.argmax(-1) == tokens).float().mean().item()
            rows.append(
                {
                    "context": context,
                    "spec": spec,
                    "kl": kl,
                    "kv_bytes": held,
                    "bytes_ratio": held / full,
                    "agreement": agreement,
                    "seconds": seconds,
                }
            )
    return rows


SMOLLM2_HEADER = "| context | spec | KL (nats/step) | agreement | KV bytes | bytes / full | seconds |\n|---|---|---|---|---|---|---|"


def smollm2_line(row: dict) -> str:
    """One markdown table row (under :data:`SMOLLM2_HEADER`) of a :func:`smollm2_kl` row."""
    return (
        f"| {row['context']} | `{row['spec']}` | {row['kl']:.5f} | {row['agreement']:.3f} | {row['kv_bytes']:,} |"
        f" {row['bytes_ratio']:.4f} | {row['seconds']:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--specs", default="kivi(bits=2);rotated(bits=2);kivi(bits=4);rotated(bits=4);gear", help="codec specs separated by ';'"
    )
    parser.add_argument("--contexts", default="2048,4096", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    rows = smollm2_kl(args.specs.split(";"), [int(c) for c in args.contexts.split(",")], args.steps)
    print("\n".join([SMOLLM2_HEADER, *map(smollm2_line, rows)]))


if __name__ == "__main__":
    main()
