"""The perplexity and agreement tasks (kvlib.eval.perplexity, kvlib.eval.agreement)."""

import math

import pytest
import torch

import kvlib
from kvlib.eval.agreement import AgreementTask, agreement_metrics
from kvlib.eval.perplexity import PerplexityTask
from kvlib.eval.texts import text_ids, windows


def full(model):
    return lambda tokens: kvlib.make_cache(model)


def test_full_cache_streaming_perplexity_equals_one_forward_pass(byte_model, tokenizer):
    task = PerplexityTask(context=96, samples=2, chunk=7)
    result = task.run(byte_model, tokenizer, full(byte_model))
    rows = [[tokenizer.bos_token_id] + w for w in windows(text_ids(tokenizer), 95, 2, 0)]
    ids = torch.tensor(rows)
    with torch.no_grad():
        logits = byte_model(ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    assert result.score == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    assert result.metrics["by_sample"] == pytest.approx(nll.mean(1).exp().tolist(), rel=1e-4)
    assert not result.higher_is_better


def test_a_capped_cache_stays_capped_while_streaming(byte_model, tokenizer):
    task = PerplexityTask(context=96, samples=1, chunk=8)
    caches = []

    def make(tokens):
        caches.append(kvlib.make_cache(byte_model, "streaming_llm", budget=16))
        return caches[-1]

    result = task.run(byte_model, tokenizer, make)
    assert caches[0].kept_positions(0).shape[-1] <= 16 + 8 and result.kv_fraction < 0.5
    assert caches[0].get_seq_length() == 95  # every token but the last was fed
    assert math.isfinite(result.score)


def test_agreement_metrics_by_hand():
    reference = torch.tensor([[1, 2, 0]])
    logits = torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [0.0, 5.0, 0.0]]])  # argmax 1, 2, 1
    metrics = agreement_metrics(reference, logits.clone(), logits)
    assert metrics["agreement"] == pytest.approx(2 / 3) and metrics["first_divergence"] == 2
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    other = torch.zeros_like(logits)
    p = torch.softmax(logits, -1)
    expected = (p * (p.log() - math.log(1 / 3))).sum(-1).mean().item()
    assert agreement_metrics(reference, logits, other)["kl"] == pytest.approx(expected, rel=1e-5)


def test_full_cache_agrees_with_itself_and_eviction_is_measured(byte_model, tokenizer):
    task = AgreementTask(context=80, samples=2, steps=6)
    same = task.run(byte_model, tokenizer, full(byte_model))
    assert same.score == 1.0 and same.metrics["kl"] == pytest.approx(0.0, abs=1e-5)
    assert same.metrics["first_divergence"] == 6
    evicted = task.run(byte_model, tokenizer, lambda tokens: kvlib.make_cache(byte_model, "random", budget=4))
    assert evicted.metrics["kl"] > 1e-4 and evicted.kv_fraction < 0.3


@pytest.mark.parametrize("task", [PerplexityTask, AgreementTask])
def test_longer_than_the_model_is_refused(task, byte_model):
    with pytest.raises(ValueError, match="the model's context is 256"):
        task(context=512).check(byte_model, None, 256)
