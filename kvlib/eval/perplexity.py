"""The ``perplexity`` task: teacher-forced perplexity while the cache compresses as the text streams.

``samples`` windows of ``context`` tokens (BOS first) of a text (default: the evaluation text)
run as one batch, fed ``chunk`` tokens per forward call, so a token-capped cache is compacted
throughout the stream (decode-phase eviction, not just the prompt), and every token is predicted
from whatever the cache kept of the ones before it. Score: ``exp`` of the mean negative
log-likelihood of every token after the first (pooled over samples); ``metrics["by_sample"]``
has each window's perplexity; the result's ``cases`` are each window's mean negative log-likelihood
(``exp_mean``: windows are equally long, so the score is ``exp`` of their mean). ``chunk=1`` is
token-by-token decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.eval.case_scores import case_scores
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes
from kvlib.eval.texts import text_ids, windows
from kvlib.transformers_compat import cache_argument


@dataclass(frozen=True)
class PerplexityTask:
    """Streaming perplexity over ``samples`` windows of ``context`` tokens, ``chunk`` tokens per call."""

    context: int = 1024
    samples: int = 8
    chunk: int = 16
    seed: int = 0
    text: str | None = None
    name: str = "perplexity"
    metric: str = "perplexity"
    higher_is_better: bool = False

    def __post_init__(self) -> None:
        if self.context < 2 or self.samples < 1 or self.chunk < 1:
            raise ValueError("perplexity needs context >= 2, samples >= 1 and chunk >= 1")

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        check_context(self.name, self.context, context)

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult:
        bos = tokenizer.encode("", bos=True)
        rows = [bos + w for w in windows(text_ids(tokenizer, self.text), self.context - len(bos), self.samples, self.seed)]
        ids = torch.tensor(rows, device=next(model.parameters()).device)
        cache = make_cache(self.context)
        nll = []
        with torch.inference_mode():
            for start in range(0, self.context - 1, self.chunk):
                piece = ids[:, start : min(start + self.chunk, self.context - 1)]
                logits = model(input_ids=piece, **cache_argument(cache), use_cache=True).logits.float()
                targets = ids[:, start + 1 : start + 1 + piece.shape[1]]
                nll.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
        nll = torch.cat(nll, dim=1)
        held, full = kv_bytes(cache)
        return TaskResult(
            self.name,
            self.metric,
            math.exp(nll.mean().item()),
            False,
            held,
            full,
            {"by_sample": nll.mean(1).exp().tolist(), "context": self.context, "chunk": self.chunk},
            self.samples,
            case_scores(nll.mean(1).tolist(), "exp_mean", rows),
        )
