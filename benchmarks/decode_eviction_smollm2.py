"""Decode-time eviction quality on SmolLM2-135M-Instruct: KL of next-token distributions against the
full cache over a long-ish generation, for the decode-time policies and h2o / tova / streaming_llm
at the same int budget.

Each sample is a window of ``--prompt-len`` tokens of the default evaluation text
(:func:`kvlib.eval.texts.text_ids`, Python source). The full cache decodes ``--new-tokens`` greedy
tokens; every policy's cache (an int budget of ``--budget`` tokens per (layer, head), held at the
prefill and at every decode step) is prefilled with the same prompt and fed the same tokens
(teacher forcing), so each step compares the two caches' next-token distributions at the same
position: ``KL(full || evicted)`` in nats, averaged over the steps and samples, and the share of
steps whose argmax agrees with the full cache's token. Also each cache's ``pages`` bytes over the
full cache's at the end. Quality only, no timings.

Usage:

    python benchmarks/decode_eviction_smollm2.py [--specs keyformer,scope,...] [--budget 128]
        [--prompt-len 512] [--new-tokens 64] [--samples 2] [--seed 0] [--out benchmarks/results]

Writes ``decode_eviction_smollm2.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import command_line, git_revision  # noqa: E402

import kvlib  # noqa: E402
from kvlib.eval import load_model
from kvlib.eval.output_files import replace_file  # noqa: E402
from kvlib.eval.texts import text_ids, windows  # noqa: E402
from kvlib.transformers_compat import cache_argument  # noqa: E402

SPECS = "keyformer,scope,morphkv,rkv,h2o,tova,streaming_llm"


def teacher_forced(model: torch.nn.Module, cache, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[steps, vocab]`` of the next token after the prompt and after each of ``tokens`` but the last."""
    with torch.no_grad():
        out = model(input_ids=prompt, **cache_argument(cache))
        steps = [out.logits[0, -1].log_softmax(-1)]
        for token in tokens[:-1]:
            out = model(input_ids=token.view(1, 1), **cache_argument(cache))
            steps.append(out.logits[0, -1].log_softmax(-1))
    return torch.stack(steps)


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default=SPECS)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2")
    model = loaded.model
    prompts = windows(text_ids(loaded.tokenizer), args.prompt_len, args.samples, args.seed)
    specs = [spec for spec in args.specs.split(",") if spec]
    totals = {spec: {"kl": 0.0, "agreement": 0.0, "pages_vs_full": 0.0} for spec in specs}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        full = kvlib.make_cache(model)
        with torch.no_grad():
            greedy = model.generate(
                ids, **cache_argument(full), do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
            )
        tokens = greedy[0, len(prompt) :]
        reference_cache = kvlib.make_cache(model)
        reference = teacher_forced(model, reference_cache, ids, tokens)
        full_pages = reference_cache.memory_report()["by_component"]["pages"]
        for spec in specs:
            cache = kvlib.make_cache(model, spec, budget=args.budget)
            evicted = teacher_forced(model, cache, ids, tokens)
            kl = (reference.exp() * (reference - evicted)).sum(-1)
            totals[spec]["kl"] += float(kl.mean()) / len(prompts)
            totals[spec]["agreement"] += float((evicted.argmax(-1) == tokens).float().mean()) / len(prompts)
            totals[spec]["pages_vs_full"] += cache.memory_report()["by_component"]["pages"] / full_pages / len(prompts)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    result = {
        "config": config,
        "command": command_line("decode_eviction_smollm2.py", argv),
        "git": git_revision(),
        "rows": [{"spec": spec, **values} for spec, values in totals.items()],
    }
    replace_file(out / "decode_eviction_smollm2.json", json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Decode-time eviction on SmolLM2: {args.samples} prompts of {args.prompt_len} tokens, {args.new_tokens} teacher-forced steps,"
        f" int budget {args.budget} tokens per (layer, head)",
        "",
        f"`{result['command']}` (library {result['git']})",
        "",
        "| spec | KL(full ‖ evicted), nats/step | argmax agreement | pages vs full |",
        "|---|---|---|---|",
        *(f"| {row['spec']} | {row['kl']:.4f} | {row['agreement']:.3f} | {row['pages_vs_full']:.3f} |" for row in result["rows"]),
    ]
    replace_file(out / "decode_eviction_smollm2.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    run()
