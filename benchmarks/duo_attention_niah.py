"""DuoAttention against StreamingLLM and SnapKV at the same bytes on RULER's needle tasks (SmolLM2).

For each task (``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``) at
``--context`` tokens, ``--samples`` cases (seed ``--seed``), each method compresses the whole
chat-templated prompt once after the prefill at ``--budget`` of its tokens (a float budget: prompt
compression) and then decodes greedily, one row at a time, up to ``--max-new-tokens`` tokens or EOS
(decoded tokens are all kept). Scores: the task's own scorer (RULER's ``string_match_all``). Bytes:
the cache's ``pages`` bytes after the prompt over a full cache's (``full_equivalent_bytes``), the
same budget giving each method the same bytes up to page rounding (reported per method).

DuoAttention's head split comes from a retrieval profile of SmolLM2 (each KV head's attention
from the answer's queries onto the needle while the answer is produced,
:func:`kvlib.eval.retrieval_profile.retrieval_profile`), measured once at ``--context`` tokens on
two ``niah_single`` and two ``niah_multikey`` prompts of other seeds (1000, 1001) and cached under
``<kvlib cache>/profiles/``; ``--no-profile`` runs DuoAttention's profile-free default instead.

Usage:

    python benchmarks/duo_attention_niah.py [--context 4096] [--samples 2] [--budget 0.25]
        [--max-new-tokens 24] [--seed 0] [--sinks 64] [--recent 256] [--out benchmarks/results]

Writes ``duo_attention_niah.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command_line, git_revision, write_report  # noqa: E402

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sinks", type=int, default=64)
    parser.add_argument("--recent", type=int, default=256)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not 0 < args.budget < 1 or args.samples < 1 or args.context < 64:
        parser.error("--budget must be in (0, 1), --samples >= 1, --context >= 64")
    return args


def run_case(model, spec: str, budget: float, ids: Sequence[int], max_new_tokens: int, eos: set[int]) -> dict:
    import torch

    import kvlib
    from kvlib.transformers_compat import cache_argument

    cache = kvlib.make_cache(model, spec, budget=budget)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)]), **cache_argument(cache), logits_to_keep=1)
        report = cache.memory_report()
        tokens = [int(out.logits[0, -1].argmax())]
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            out = model(input_ids=torch.tensor([[tokens[-1]]]), **cache_argument(cache))
            tokens.append(int(out.logits[0, -1].argmax()))
    return {"tokens": tokens, "bytes_ratio": report["by_component"]["pages"] / report["full_equivalent_bytes"]}


def render(result: dict) -> str:
    lines = [
        "# DuoAttention vs StreamingLLM and SnapKV at the same bytes (SmolLM2, RULER needles)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"kvlib revision {result['kvlib_revision']}; {result['samples']} cases per task at {result['context']} tokens "
        f"(seed {result['seed']}), budget {result['budget']:g} of the prompt, greedy, up to {result['max_new_tokens']} "
        f"new tokens; {result['seconds']:.0f} s on the CPU. Profile: {result['profile']}.",
        "",
        "Score: RULER's string_match_all, mean over cases. Bytes: pages held after the prompt over a full cache's.",
        "",
        "| method | " + " | ".join(result["tasks"]) + " | mean | bytes / full |",
        "|---|" + "---|" * (len(result["tasks"]) + 2),
    ]
    for method, row in result["rows"].items():
        scores = [row["scores"][t] for t in result["tasks"]]
        lines.append(
            f"| `{method}` | " + " | ".join(f"{s:.2f}" for s in scores) + f" | {sum(scores) / len(scores):.3f} | {row['bytes_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, argv: Sequence[str] | None, tasks: list[str], rows: dict, profile: str, seconds: float) -> dict:
    """The result of the ``tasks`` done so far (as written to the JSON file)."""
    table = {
        m: {
            "scores": {t: sum(r["scores"][t]) / len(r["scores"][t]) for t in tasks},
            "bytes_ratio": sum(r["bytes"]) / len(r["bytes"]),
            "case_scores": r["scores"],
            "predictions": r["predictions"],
        }
        for m, r in rows.items()
    }
    return {
        "command": command_line("duo_attention_niah.py", argv),
        "kvlib_revision": git_revision(),
        "context": args.context,
        "samples": args.samples,
        "seed": args.seed,
        "budget": args.budget,
        "max_new_tokens": args.max_new_tokens,
        "tasks": tasks,
        "profile": f"retrieval profile of SmolLM2 (niah_single and niah_multikey, 2 cases each at {args.context} tokens, seeds 1000-1001)"
        if profile
        else "none (the even spread)",
        "seconds": seconds,
        "rows": table,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    from kvlib.eval import load_model
    from kvlib.eval.retrieval_profile import retrieval_profile
    from kvlib.eval.ruler import RULER_TASKS

    loaded = load_model("smollm2")
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = {int(e) for e in [model.generation_config.eos_token_id, tokenizer.eos_token_id] if e is not None}
    profile = "" if args.no_profile else str(retrieval_profile(loaded, context=args.context))
    duo = f"duo_attention(sinks={args.sinks}, recent={args.recent}" + (f", profile={profile!r})" if profile else ")")
    label = f"duo_attention(sinks={args.sinks}, recent={args.recent}) " + ("with the retrieval profile" if profile else "(even spread)")
    methods = {label: duo, "streaming_llm": "streaming_llm", "snapkv": "snapkv"}
    tasks = [t for t in args.tasks.split(",") if t]
    rows = {m: {"scores": {}, "bytes": [], "predictions": {}} for m in methods}
    result: dict = {}
    for done, task_name in enumerate(tasks, 1):
        task = RULER_TASKS[task_name](context=args.context, samples=args.samples, seed=args.seed)
        for index, case in enumerate(task.cases(tokenizer)):
            for method, spec in methods.items():
                run = run_case(model, spec, args.budget, case.ids, args.max_new_tokens, eos)
                text = tokenizer.decode(run["tokens"])
                rows[method]["scores"].setdefault(task_name, []).append(task.score(text, case.answers))
                rows[method]["bytes"].append(run["bytes_ratio"])
                rows[method]["predictions"].setdefault(task_name, []).append(text[:60])
                print(
                    f"duo_attention_niah: {task_name} case {index} {method[:20]}: {rows[method]['scores'][task_name][-1]:.2f}", flush=True
                )
        result = report(args, argv, tasks[:done], rows, profile, time.perf_counter() - started)
        write_report(args.out, "duo_attention_niah", render(result), result)  # after each task: a partial run still reports
    return result


if __name__ == "__main__":
    main()
