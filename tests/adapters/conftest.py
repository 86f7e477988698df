"""Models for the adapter tests: small random-weight configs of the required families, and kvlib's
embedded default model (trained weights, GQA, RoPE; :mod:`kvlib.default_model`), which ships in
the package: nothing outside the checkout is read."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvlib.default_model import MODEL_DIR

VOCAB = 97
"""Vocabulary of the random-weight families."""
DEFAULT_BYTES = 256
"""Ids the default model reads as text (bytes 0-255); random prompts for it draw from these, not
from its special ids (BOS 256, EOS 257, PAD 258)."""
PAD = 0
GEMMA3_WINDOW = 16
"""The sliding window of the ``gemma3`` family's sliding layers (Gemma 3's is 512)."""


def build_model(family: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A fresh, seeded, eval-mode model of ``family`` (llama, mistral, qwen2, gpt2, default, gemma3).

    ``default`` is the embedded trained model: a byte-level Llama of 4 layers, 4 query and 2 KV
    heads of 32 channels, vocabulary 259 (ids 0-255 are bytes, 256-258 BOS, EOS, PAD), context
    1024 tokens. The others have random weights and a vocabulary of :data:`VOCAB`.

    ``gemma3`` is Gemma 3's layer mix in small: six layers, five sliding-window layers (window
    :data:`GEMMA3_WINDOW`) to each global one, one KV head of 32 channels for four query heads."""
    torch.manual_seed(0)
    if family == "default":
        return AutoModelForCausalLM.from_pretrained(MODEL_DIR, attn_implementation=attn_implementation).eval()
    common = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
    if family == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common)
        model = GPT2LMHeadModel(config)
    else:
        sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        if family == "llama":
            model = LlamaForCausalLM(LlamaConfig(**sizes, **common))
        elif family == "mistral":
            model = MistralForCausalLM(MistralConfig(**sizes, sliding_window=8, **common))
        elif family == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**sizes, **common))
        elif family == "gemma3":
            gemma = dict(sizes, num_hidden_layers=6, num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
            model = Gemma3ForCausalLM(Gemma3TextConfig(**gemma, sliding_window=GEMMA3_WINDOW, **common))
        else:
            raise ValueError(family)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "default"]


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def prompt_vocab(family: str) -> int:
    """Token ids random prompts for ``family`` draw from: ``[3, prompt_vocab(family))``."""
    return DEFAULT_BYTES if family == "default" else VOCAB


def left_padded(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random prompts of ``lengths``, left-padded: ``(input_ids, attention_mask)``."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def assert_same_logits(ours, theirs) -> None:
    """Logits of two runs that do the same math agree to float32 rounding (tolerances that hold
    across thread counts and machines, where the kernels' reduction orders may differ), and
    pick the same tokens. ``ours`` and ``theirs``: a tensor or a sequence of tensors (one per step)."""
    ours = [ours] if isinstance(ours, torch.Tensor) else list(ours)
    theirs = [theirs] if isinstance(theirs, torch.Tensor) else list(theirs)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def edit_one_weight(model: torch.nn.Module, delta: float = 1e-3) -> None:
    """Add ``delta`` to one value in the middle of one tensor (layer 1's MLP up projection), in
    place: far from the first and last values of any tensor, the shapes and config unchanged."""
    weight = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        weight[weight.shape[0] // 2, weight.shape[1] // 2] += delta
