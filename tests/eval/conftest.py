"""A tiny random byte-level Llama saved as a kvlib model folder (so the CLI loads it by path)."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.default_model import ByteTokenizer
from kvlib.default_model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


def tiny_byte_model(context: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_model")
    tiny_byte_model().save_pretrained(folder)
    (folder / "training.json").write_text(json.dumps({"note": "test model"}))
    return folder


@pytest.fixture(scope="session")
def byte_model():
    return tiny_byte_model()


@pytest.fixture(scope="session")
def tokenizer():
    return ByteTokenizer()
