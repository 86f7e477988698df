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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvlib.default_model import corpus, episodes
from kvlib.default_model.files import MODEL_DIR
from kvlib.default_model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


@dataclass(frozen=True)
class Phase:
    """``steps`` optimizer steps on batches of ``batch`` sequences of ``length`` bytes (+ BOS)."""

    length: int
    batch: int
    steps: int


@dataclass(frozen=True)
class TrainingConfig:
    """Model shape and optimisation settings. Learning rate: linear warmup, cosine to 10%."""

    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    context: int = 1024
    phases: tuple[Phase, ...] = field(
        default_factory=lambda: (Phase(length=256, batch=32, steps=1200), Phase(length=1024, batch=8, steps=1300))
    )
    episode_fraction: float = 0.6
    answer_weight: float = 1.0
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
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


def batch(rng: np.random.Generator, text: np.ndarray, phase: Phase, episode_fraction: float):
    """``(ids long[batch, length + 1], answer_mask bool[batch, length + 1])``, each row BOS first."""
    rows, masks = [], []
    for _ in range(phase.batch):
        if rng.random() < episode_fraction:
            tokens, mask = episodes.episode(rng, text, phase.length)
        else:
            start = int(rng.integers(0, len(text) - phase.length))
            tokens, mask = text[start : start + phase.length], np.zeros(phase.length, dtype=bool)
        rows.append(np.concatenate([[BOS_ID], tokens.astype(np.int64)]))
        masks.append(np.concatenate([[False], mask]))
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(masks))


def learning_rate(cfg: TrainingConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
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
                group["lr"] = learning_rate(cfg, step)
            ids, answer_mask = batch(rng, text, phase, cfg.episode_fraction)
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
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every phase's step count (a quick trial: 0.05)"
    )
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    base = TrainingConfig()
    phases = tuple(Phase(p.length, p.batch, max(1, round(p.steps * args.scale))) for p in base.phases)
    train(TrainingConfig(phases=phases), args.out, log_every=10 if args.scale < 0.2 else 50)
    return 0


if __name__ == "__main__":
    sys.exit(main())
