"""Codec quality on SmolLM2-135M-Instruct: KL(full || codec) per teacher-forced step, and KV bytes.

For each context length, a natural-text prompt (RULER's essay haystack, :mod:`kvlib.eval.ruler.haystack`)
of ``context`` tokens is prefilled, then ``steps`` further tokens of the same text are fed one at a
time (teacher forcing); each step's next-token distribution under the codec is compared with the
full cache's (``kvlib.make_cache(model)``, exact): mean KL(full || codec) in nats. Bytes: pages plus
codec metadata over the full cache's (``memory_report``) after the last step.

Usage: ``python benchmarks/codec_quality_smollm2.py --specs 'kivi(bits=2)' 'rotated(bits=2)' --contexts 2048 4096``
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import torch

import kvlib
from kvlib.eval.agreement import teacher_forced_logits
from kvlib.eval.models import load_model
from kvlib.eval.ruler.haystack import essay
from kvlib.eval.task import kv_bytes


def essay_ids(tokenizer, tokens: int, seed: int) -> torch.Tensor:
    """int64 ``[1, tokens]``: the first ``tokens`` token ids of an essay haystack."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(" ".join(essay(200, rng)))
    return torch.tensor([ids[:tokens]])


def smollm2_kl(specs: Sequence[str], contexts: Sequence[int], steps: int = 32, seed: int = 0) -> list[dict]:
    """One row per (context, spec): ``kl`` (mean KL(full || codec), nats per step), ``bytes``
    (pages + codec metadata), ``bytes_ratio`` (over the full cache's) and ``seconds``."""
    loaded = load_model("smollm2")
    rows = []
    for context in contexts:
        text = essay_ids(loaded.tokenizer, context + steps, seed)
        prompt, fed = text[:, :context], text[:, context:]
        full = teacher_forced_logits(loaded.model, kvlib.make_cache(loaded.model), prompt, fed)
        reference = torch.log_softmax(full, -1)
        for spec in specs:
            start = time.perf_counter()
            cache = kvlib.make_cache(loaded.model, spec)
            logp = torch.log_softmax(teacher_forced_logits(loaded.model, cache, prompt, fed), -1)
            kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()
            held, full_bytes = kv_bytes(cache)
            rows.append(
                {
                    "spec": spec,
                    "context": context,
                    "kl": kl,
                    "bytes": held,
                    "bytes_ratio": held / full_bytes,
                    "seconds": time.perf_counter() - start,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=["kivi(bits=2)", "rotated(bits=2)", "kivi(bits=4)", "rotated(bits=4)"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    print("| context | spec | KL (nats/step) | bytes | bytes ratio | s |")
    print("|---|---|---|---|---|---|")
    for row in smollm2_kl(args.specs, args.contexts, args.steps):
        print(
            f"| {row['context']} | `{row['spec']}` | {row['kl']:.4f} | {row['bytes']} | {row['bytes_ratio']:.3f} | {row['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
