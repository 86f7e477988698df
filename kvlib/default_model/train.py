"""Train kvlib's default model: ``python -m kvlib.default_model.train [--out DIR]``.

A small Llama (RoPE, grouped-query attention, byte-level vocabulary, context 1024) trained from
scratch on the Python standard library's source (:mod:`.corpus`, minus the held-out modules)
mixed with synthetic retrieval episodes (:mod:`.episodes`). Every sequence starts with BOS, so the
model learns an attention sink; the episodes teach it to find and copy facts (retrieval heads).

Deterministic: numpy and torch are seeded, data order is a function of the seed, and torch runs
with a fixed thread count; the same Python version (the corpus is its stdlib), torch version and
thread count give the same weights. The loss is next-byte cross-entropy plus the same averaged
over answer bytes only (weight :attr:`TrainingConfig.answer_weight`), so the few answer bytes per
sequence are not drowned out. Writes ``config.json``, ``model.safetensors`` and ``training.json``
(the run's settings, loss curve, run time and versions).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kvlib.default_model import corpus, episodes
from kvlib.default_model.files import MODEL_DIR
from kvlib.default_model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


@dataclass(frozen=True)
class Phase:
    """``steps`` optimizer steps on batches of ``batch`` sequences of ``length`` bytes (+ BOS).

    ``repeats``: every sequence is a :func:`repeat_sequence`, half on random filler, half on
    text: the induction warm-up. Content-based copying appears abruptly after a plateau of a few thousand steps
    (the default model: loss on the copies flat until step ~2,000, near 0.9 nats by 2,700; a
    2-layer one: ~2,300); diluted in text it had not appeared after 650 steps.
    Otherwise text mixed with retrieval episodes and repeats (half of them on random filler, as
    in the warm-up, so the copying is kept up). ``lr_scale`` multiplies the
    learning rate in this phase (lower after the warm-up, so text does not wash the copying out).
    """

    length: int
    batch: int
    steps: int
    repeats: bool = False
    lr_scale: float = 1.0


@dataclass(frozen=True)
class TrainingConfig:
    """Model shape and optimisation settings (learning rate: see :func:`learning_rate`)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    context: int = 1024
    phases: tuple[Phase, ...] = field(
        default_factory=lambda: (
            Phase(length=128, batch=32, steps=4000, repeats=True),
            Phase(length=256, batch=32, steps=500, lr_scale=0.5),
            Phase(length=1024, batch=8, steps=500, lr_scale=0.5),
        )
    )
    episode_fraction: float = 0.4
    repeat_fraction: float = 0.4
    answer_weight: float = 1.0
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)


def model_config(cfg: TrainingConfig):
    """The ``LlamaConfig`` of the model ``cfg`` trains."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.context,
        rope_theta=10000.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
    )


REPEAT_ALPHABET = np.arange(ord("0"), ord("0") + 36, dtype=np.uint8)
"""The 36 bytes ``0``-``9``, ``:``-``@``, ``A``-``S`` that repeat units (and a warm-up's filler) are drawn from."""


def repeat_sequence(rng: np.random.Generator, text: np.ndarray, length: int, random_filler: bool) -> tuple[np.ndarray, np.ndarray]:
    """A filler with one unit of random bytes inserted twice at random places; the mask marks the
    second copy after its first byte (what copying can predict).

    The random distance between the copies rules out copying by a fixed offset, so what is learned
    is content matching (induction heads). ``random_filler``: the filler is random bytes of the
    same alphabet (single-byte matches are ambiguous everywhere); otherwise a text window. The
    unit is 24 bytes at lengths up to 128 (the warm-up), else 16-64 bytes.
    """
    size = 24 if random_filler and length <= 128 else int(rng.integers(16, 65))
    unit = rng.choice(REPEAT_ALPHABET, size=size)
    rest = length - 2 * size
    if random_filler:
        filler = rng.choice(REPEAT_ALPHABET, size=rest)
    else:
        start = int(rng.integers(0, len(text) - rest))
        filler = text[start : start + rest]
    first = int(rng.integers(0, rest // 2 + 1))
    second = int(rng.integers(first, rest + 1))
    tokens = np.concatenate([filler[:first], unit, filler[first:second], unit, filler[second:]])
    mask = np.zeros(length, dtype=bool)
    mask[second + size + 1 : second + 2 * size] = True
    return tokens, mask


def batch(rng: np.random.Generator, text: np.ndarray, phase: Phase, cfg: TrainingConfig):
    """``(ids long[batch, length + 1], answer_mask bool[batch, length + 1])``, each row BOS first.

    A row is a :func:`repeat_sequence` (always in a ``repeats`` phase, else with probability
    ``cfg.repeat_fraction``, which keeps the copying alive), an episode (``cfg.episode_fraction``)
    or a plain text window.
    """
    rows, masks = [], []
    for _ in range(phase.batch):
        draw = rng.random()
        if phase.repeats or draw < cfg.repeat_fraction:
            random_filler = rng.random() < 0.5
            tokens, mask = repeat_sequence(rng, text, phase.length, random_filler=random_filler)
        elif draw < cfg.repeat_fraction + cfg.episode_fraction:
            tokens, mask = episodes.episode(rng, text, phase.length)
        else:
            start = int(rng.integers(0, len(text) - phase.length))
            tokens, mask = text[start : start + phase.length], np.zeros(phase.length, dtype=bool)
        rows.append(np.concatenate([[BOS_ID], tokens.astype(np.int64)]))
        masks.append(np.concatenate([[False], mask]))
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(masks))


def learning_rate(cfg: TrainingConfig, step: int) -> float:
    """Linear warmup, constant until the last phase, cosine down to 10% over the last phase."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    decay_start = cfg.total_steps - cfg.phases[-1].steps
    if step < decay_start:
        return cfg.learning_rate
    progress = (step - decay_start) / max(1, cfg.phases[-1].steps)
    return cfg.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def loss_terms(model, ids: torch.Tensor, answer_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-byte cross-entropy over all positions, and over answer positions only."""
    logits = model(input_ids=ids[:, :-1]).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    answers = answer_mask[:, 1:]
    answer_loss = losses[answers].mean() if answers.any() else losses.new_zeros(())
    return losses.mean(), answer_loss


def train(cfg: TrainingConfig, out: Path, log_every: int = 50) -> dict:
    """Train, save to ``out`` and return the training log (also written as ``training.json``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    text = np.frombuffer(corpus.training_text() + b"\n", dtype=np.uint8)
    model = LlamaForCausalLM(model_config(cfg))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )
    started, step, curve = time.perf_counter(), 0, []
    model.train()
    for phase in cfg.phases:
        for _ in range(phase.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg, step) * phase.lr_scale
            ids, answer_mask = batch(rng, text, phase, cfg)
            text_loss, answer_loss = loss_terms(model, ids, answer_mask)
            optimizer.zero_grad(set_to_none=True)
            (text_loss + cfg.answer_weight * answer_loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1
            if step % log_every == 0 or step == cfg.total_steps:
                entry = {
                    "step": step,
                    "length": phase.length,
                    "loss": round(text_loss.item(), 4),
                    "answer_loss": round(answer_loss.item(), 4),
                    "seconds": round(time.perf_counter() - started, 1),
                }
                curve.append(entry)
                print(json.dumps(entry), flush=True)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    log = {
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(time.perf_counter() - started, 1),
        "corpus_bytes": int(len(text)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "curve": curve,
    }
    (out / "training.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help=f"output folder (default: {MODEL_DIR})")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every phase's step count (a quick trial: 0.05)")
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    base = TrainingConfig()
    phases = tuple(replace(p, steps=max(1, round(p.steps * args.scale))) for p in base.phases)
    train(TrainingConfig(phases=phases), args.out, log_every=10 if args.scale < 0.2 else 50)
    return 0


if __name__ == "__main__":
    sys.exit(main())
