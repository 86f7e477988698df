"""One KVzip compression serving every question about a document, on SmolLM2.

The document is a RULER ``niah_multiquery`` context (``--context`` tokens, seed ``--seed``): four
needles, each a key and its number. Each of the four questions asks for one key's number. Three
ways to answer them, interleaved question by question:

- ``full``: a full cache, the whole prompt (document + question) prefilled for each question;
- ``kvzip each``: a fresh KVzip compression of the document at ``--budget`` for each question
  (:func:`kvlib.policies.eviction.kvzip.compress`), then the question;
- ``kvzip reused``: :func:`~kvlib.adapters.compressed_context` with one
  PrefixStore: the first question compresses and holds the document, the others get forks.

Per way: each question's score (RULER's ``string_match_all`` on a greedy answer of up to
``--max-new-tokens`` tokens), the seconds per question (building the cache, reading the question,
answering), and the page bytes held while all four answers' caches are alive (``kvzip reused``:
the one shared store; the others: the sum over the four caches). ``kvzip reused`` must give
``kvzip each``'s answers token for token (the same compressed pages).

Usage:

    python benchmarks/kvzip_reuse.py [--context 4096] [--budget 0.25] [--max-new-tokens 16] [--seed 0]
        [--out benchmarks/results]

Writes ``kvzip_reuse.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import command_line, git_revision, write_report  # noqa: E402

import kvlib  # noqa: E402
from kvlib.adapters import compressed_context  # noqa: E402
from kvlib.eval import load_model  # noqa: E402
from kvlib.eval.ruler import RULER_TASKS  # noqa: E402
from kvlib.policies.eviction.kvzip import RepeatPrompt, compress  # noqa: E402
from kvlib.transformers_compat import cache_argument  # noqa: E402

WAYS = ("full", "kvzip each", "kvzip reused")
ASKED = ("What are all the special magic numbers for ", " mentioned in the provided text?")


def questions(task, tokenizer) -> tuple[list[int], list[tuple[list[int], str]]]:
    """The document's ids and, per key, the ids of the document + that key's question (and the
    reply's start) with its answer."""
    case = task.cases(tokenizer)[0]
    prompt = task.prompt(case.size, task.rng(0), tokenizer)
    keys = prompt.question.removeprefix(ASKED[0]).removesuffix(ASKED[1]).replace(", and ", ", ").split(", ")
    document = list(case.ids[: case.context_tokens])
    asked = []
    for key, answer in zip(keys, prompt.answers, strict=True):
        message = prompt.message[: -len(prompt.question)] + f"What is the special magic number for {key} mentioned in the provided text?"
        ids = tokenizer.instruct(message, f" The special magic number for {key} mentioned in the provided text is")
        if ids[: len(document)] != document:
            raise ValueError(f"the question about {key!r} does not start with the document's ids")
        asked.append((ids, answer))
    return document, asked


def answer(model, cache, ids: list[int], max_new_tokens: int, pad: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            torch.tensor([ids]), **cache_argument(cache), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad
        )[0, len(ids) :]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    loaded = load_model("smollm2")
    model, tokenizer = loaded.model, loaded.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    task = RULER_TASKS["niah_multiquery"](context=args.context, samples=1, seed=args.seed)
    document, asked = questions(task, tokenizer)
    context_ids = torch.tensor([document])
    repeat = RepeatPrompt.for_tokenizer(tokenizer)
    store = kvlib.PrefixStore(model, capacity_bytes=1 << 30)
    rows = {way: {"scores": [], "seconds": [], "answers": []} for way in WAYS}
    alive: dict[str, list] = {way: [] for way in WAYS}
    builders = {
        "full": lambda: kvlib.make_cache(model),
        "kvzip each": lambda: compressed_fresh(model, context_ids, repeat, args.budget),
        "kvzip reused": lambda: compressed_context(model, store, context_ids, repeat, budget=args.budget),
    }
    for ids, expected in asked:
        for way in WAYS:
            started = time.perf_counter()
            cache = builders[way]()
            tokens = answer(model, cache, ids, args.max_new_tokens, pad)
            rows[way]["seconds"].append(round(time.perf_counter() - started, 2))
            text = tokenizer.decode(tokens.tolist())
            rows[way]["answers"].append(tokens.tolist())
            rows[way]["scores"].append(task.score(text, (expected,)))
            alive[way].append(cache)
    for way in WAYS:
        caches = alive[way]
        shared = caches[0].store if all(c.store is caches[0].store for c in caches) else None
        pages = shared.memory_bytes()["pages"] if shared is not None else sum(c.store.memory_bytes()["pages"] for c in caches)
        rows[way]["page_bytes"] = int(pages)
    result = {
        "command": command_line("kvzip_reuse.py", argv),
        "git": git_revision(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "document_tokens": len(document),
        "questions": len(asked),
        "same_answers": rows["kvzip each"]["answers"] == rows["kvzip reused"]["answers"],
        "rows": rows,
    }
    write_report(args.out, "kvzip_reuse", render(result), result)
    return result


def compressed_fresh(model, context_ids: torch.Tensor, repeat: RepeatPrompt, budget: float):
    """A new KVzip cache with ``context_ids`` compressed into it (nothing reused)."""
    cache = kvlib.make_cache(model, "kvzip", budget=budget)
    compress(model, cache, context_ids, repeat)
    return cache


def render(result: dict) -> str:
    rows, config = result["rows"], result["config"]
    full_bytes = rows["full"]["page_bytes"]
    lines = [
        f"# One KVzip compression for every question (SmolLM2, a {result['document_tokens']}-token niah_multiquery document,"
        f" {result['questions']} questions, budget {config['budget']:g})",
        "",
        f"`{result['command']}` (library {result['git']}). Seconds per question: building the cache, reading the question and"
        f" answering (up to {config['max_new_tokens']} tokens); page bytes: held while all {result['questions']} answers' caches"
        f" are alive. kvzip reused gives kvzip each's answers token for token: {result['same_answers']}.",
        "",
        "| way | scores | mean score | seconds per question | total seconds | page bytes | bytes vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, row in rows.items():
        scores = " ".join(f"{s:.0f}" for s in row["scores"])
        mean = sum(row["scores"]) / len(row["scores"])
        seconds = " / ".join(f"{s:.1f}" for s in row["seconds"])
        lines.append(
            f"| {way} | {scores} | {mean:.2f} | {seconds} | {sum(row['seconds']):.1f} | {row['page_bytes']}"
            f" | {row['page_bytes'] / full_bytes:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
