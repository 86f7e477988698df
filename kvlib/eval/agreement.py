"""The ``agreement`` task: how closely a compressed cache follows the full cache's greedy decoding.

``samples`` prompts of ``context - steps`` tokens (BOS first) of the evaluation text run as one
batch. The full cache decodes ``steps`` greedy tokens (:func:`greedy_reference`); the compressed
cache is then fed the same tokens one at a time (:func:`teacher_forced_logits`), so one early
mismatch does not derail the rest. Score: greedy agreement, the share of steps whose argmax is
the full cache's token; ``metrics["kl"]`` is the mean ``KL(full || compressed)`` of the
next-token distributions over those steps (nats), ``metrics["first_divergence"]`` the mean first
step that differs (``steps`` when none does). The result's ``cases`` are each prompt's agreement
(every prompt decodes ``steps`` tokens, so their mean is the score).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import kvlib
from kvlib.eval.case_scores import case_scores
from kvlib.eval.task import CacheFactory, TaskResult, check_context, kv_bytes
from kvlib.eval.texts import text_ids, windows
from kvlib.transformers_compat import cache_argument


def teacher_forced_logits(model: torch.nn.Module, cache, prompt: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """Float32 ``[batch, steps, vocab]``: prefill ``prompt``, then feed ``fed[:, :-1]`` one token
    at a time; step ``t`` predicts ``fed[:, t]``."""
    with torch.inference_mode():
        out = model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        logits = [out.logits[:, -1].float()]
        for t in range(fed.shape[1] - 1):
            out = model(input_ids=fed[:, t : t + 1], **cache_argument(cache), use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)


def greedy_reference(model: torch.nn.Module, cache, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[batch, steps]`` decoded with ``cache`` and their logits ``[batch, steps, vocab]``."""
    with torch.inference_mode():
        out = model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        logits = [out.logits[:, -1].float()]
        tokens = [logits[-1].argmax(-1, keepdim=True)]
        for _ in range(steps - 1):
            out = model(input_ids=tokens[-1], **cache_argument(cache), use_cache=True)
            logits.append(out.logits[:, -1].float())
            tokens.append(logits[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def agreement_metrics(reference_tokens: torch.Tensor, reference_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    """Agreement, mean KL(reference || logits) and mean first divergence, overall and per row."""
    match = logits.argmax(-1) == reference_tokens
    steps = match.shape[1]
    first = torch.where(match.all(-1), steps, (~match).int().argmax(-1))
    reference_logp = torch.log_softmax(reference_logits, -1)
    kl = (reference_logp.exp() * (reference_logp - torch.log_softmax(logits, -1))).sum(-1)
    return {
        "agreement": match.float().mean().item(),
        "agreement_per_row": match.float().mean(-1).tolist(),
        "kl": kl.mean().item(),
        "kl_per_row": kl.mean(-1).tolist(),
        "first_divergence": first.float().mean().item(),
        "first_divergence_per_row": first.tolist(),
    }


@dataclass(frozen=True)
class AgreementTask:
    """Greedy agreement and KL against the full cache over ``steps`` decoded tokens."""

    context: int = 1024
    samples: int = 8
    steps: int = 48
    seed: int = 0
    text: str | None = None
    name: str = "agreement"
    metric: str = "agreement"
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if self.samples < 1 or self.steps < 1 or self.context <= self.steps + 1:
            raise ValueError("agreement needs samples >= 1, steps >= 1 and context > steps + 1")

    def check(self, model: torch.nn.Module, tokenizer, context: int) -> None:
        check_context(self.name, self.context, context)

    def run(self, model: torch.nn.Module, tokenizer, make_cache: CacheFactory) -> TaskResult:
        bos = tokenizer.encode("", bos=True)
        length = self.context - self.steps - len(bos)
        prompts = [bos + w for w in windows(text_ids(tokenizer, self.text), length, self.samples, self.seed + 1)]
        prompt = torch.tensor(prompts, device=next(model.parameters()).device)
        reference, reference_logits = _reference(self, model, prompt)
        cache = make_cache(self.context)
        metrics = agreement_metrics(reference, reference_logits, teacher_forced_logits(model, cache, prompt, reference))
        metrics["context"] = self.context
        held, full = kv_bytes(cache)
        cases = case_scores(metrics["agreement_per_row"], "mean", prompts)
        return TaskResult(self.name, self.metric, metrics["agreement"], True, held, full, metrics, self.samples, cases)


@functools.lru_cache(maxsize=4)
def _reference_cached(task: AgreementTask, model: torch.nn.Module, prompt_key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    prompt = torch.tensor(prompt_key, device=next(model.parameters()).device)
    return greedy_reference(model, kvlib.make_cache(model), prompt, task.steps)


def _reference(task: AgreementTask, model: torch.nn.Module, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full cache's greedy decoding of ``prompt``, computed once per (task, model, prompt)."""
    return _reference_cached(task, model, tuple(map(tuple, prompt.tolist())))
