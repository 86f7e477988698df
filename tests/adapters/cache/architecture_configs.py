"""Tiny random-weight models of every causal-LM model type transformers ships, for the walk over
its config mapping (:mod:`tests.adapters.cache.test_architecture_walk`).

:func:`tiny_config` builds a model type's config class with its sizes shrunk (layers, hidden
size, heads, vocabulary, experts, state sizes): :data:`SIZES` sets every size attribute the class
has, sub-configs (a multimodal model's text and vision parts) are shrunk alike, and
:data:`SETTINGS` adds what a model type needs beyond that (a layer pattern that keeps both kinds
of a hybrid model's layers in four layers, MLA's latent sizes, a small sliding window, sizes
its validators tie together). Doge keeps its default of no sliding window: its attention builds a
per-head mask over the keys ``update`` returns, which kvlib serves over every token but not over
a slid layer's ring of slots yet. Nothing is downloaded: every model is built from its config class.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

WINDOW = 8
"""The sliding window of the models' sliding layers, so that generation slides past it."""

SIZES: dict[str, Any] = dict(
    num_hidden_layers=4,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    n_layer=4,
    n_embd=64,
    n_head=4,
    n_positions=256,
    n_inner=64,
    n_ctx=256,
    num_layers=4,
    d_model=64,
    ffn_dim=64,
    decoder_layers=4,
    decoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    sliding_window=WINDOW,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
"""Size attributes every config class that has one gets."""

MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, head_dim=8, num_key_value_heads=4)
"""Multi-head latent attention's sizes (the latent, the shared rotary key, per-head key and value parts)."""
MLA_Q = dict(MLA, q_lora_rank=16)
"""The same, for the classes whose queries always go through a low-rank projection."""

MAMBA = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=16)
"""Mamba-2 mixers' sizes (``mamba_n_heads * mamba_d_head == mamba_expand * hidden_size``)."""

DOTS3 = dict(
    MLA_Q,
    n_group=1,
    topk_group=1,
    index_head_dim=16,
    index_n_heads=2,
    index_topk=8,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=4,
    swa_q_lora_rank=16,
    swa_kv_lora_rank=16,
    swa_head_dim=16,
    swa_qk_nope_head_dim=8,
    swa_v_head_dim=12,
    moe_shared_expert_intermediate_size=32,
)
"""Dots 3 Note's MLA sizes for its DSA and sliding layers."""
QWEN4_INDEXER = dict(
    indexer_kv_heads=1,
    indexer_n_heads=2,
    indexer_head_dim=16,
    indexer_budget=16,
    indexer_compress_ratio=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
"""Qwen4-Exp's sparse-attention indexer sizes."""

HYBRID_LINEAR = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
"""Four layers of a linear-attention hybrid: both kinds, a state layer first."""

GEMMA4_TEXT = dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, global_head_dim=32, num_kv_shared_layers=0)
"""Gemma 4's text sizes: its per-layer input embeddings, wider heads on its global layers, no KV sharing."""

SETTINGS: dict[str, dict[str, Any]] = {
    "falcon_h1": dict(MAMBA, mamba_d_ssm=128),
    "jamba": dict(mamba_d_state=8, mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(MAMBA, attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(MAMBA, layer_types=HYBRID_LINEAR),
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=1,
        chunk_size=16,
        moe_shared_expert_intermediate_size=32,
    ),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
        mamba_d_state=8,
        n_mamba_heads=8,
        mamba_headdim=16,
        adapter_rank=8,
        chunk_size=16,
    ),
    "qwen3_next": dict(
        layer_types=HYBRID_LINEAR,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "deepseek_v2": dict(MLA, first_k_dense_replace=1),
    "deepseek_v3": dict(MLA, first_k_dense_replace=1, n_group=1, topk_group=1),
    "minicpm3": dict(MLA),
    "mimo_v2_flash": dict(head_dim=12, v_head_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=WINDOW),
    "cpmant": dict(dim_head=16, dim_ff=64, prompt_length=4, position_bias_num_buckets=32, position_bias_max_distance=64),
    "axk1": dict(MLA_Q, n_group=1, topk_group=1),
    "axk2": dict(MLA_Q, n_group=1, topk_group=1, index_head_dim=16, index_n_heads=2, index_topk=8),
    "deepseek_v32": dict(MLA_Q, n_group=1, topk_group=1, index_head_dim=16, index_n_heads=2, index_topk=8, first_k_dense_replace=1),
    "deepseek_v4": dict(head_dim=16, q_lora_rank=16, o_lora_rank=16, index_head_dim=16, index_n_heads=2, index_topk=8),
    "glm_moe_dsa": dict(MLA_Q, n_group=1, topk_group=1, index_head_dim=16, index_n_heads=2, index_topk=8),
    "hy_v4": dict(MLA_Q, index_head_dim=16, index_n_heads=2, index_topk=8),
    "glm4_moe_lite": dict(MLA, n_group=1, topk_group=1),
    "youtu": dict(MLA),
    "sarvam_mla": dict(MLA, n_group=1, topk_group=1),
    "longcat_flash": dict(MLA_Q, ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=2, qk_head_dim=16),
    "bailing_hybrid": dict(MLA, layer_group_size=2, first_k_dense_replace=1, n_group=1, topk_group=1),
    "inkling_text": dict(swa_head_dim=16, n_shared_experts=1),
    "inkling2_text": dict(swa_head_dim=16, unpadded_vocab_size=128),
    "inkling2_loop_text": dict(swa_head_dim=16, unpadded_vocab_size=128),
    "roc_bert": dict(pronunciation_embed_dim=16, pronunciation_vocab_size=16, shape_embed_dim=16, shape_vocab_size=16),
    "ctrl": dict(dff=64),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "dots3_note_text": DOTS3,
    "dots3_note": dict(
        text_config=DOTS3,
        vision_config=dict(num_hidden_layers=42, adapter_in_dim=64, adapter_out_dim=64),
        audio_config=dict(adapter_input_size=64, adapter_out_dim=64),
    ),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=8, n_groups=1, chunk_size=16),
    "zaya": dict(num_experts_per_tok=1),
    "doge": dict(sliding_window=None),  # its checkpoints have none; see the module docstring
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "qwen4_exp_text": QWEN4_INDEXER,
    "qwen4_exp": dict(text_config=QWEN4_INDEXER),
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=4,
        max_seq_len=256,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "zamba": dict(
        layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
        mamba_d_state=8,
        mamba_dt_rank=8,
        attention_head_dim=16,
    ),
    "blt": dict(encoder_hash_byte_group_vocab=64),
    "reformer": dict(is_decoder=True, axial_pos_embds=False),
    "kimi_linear": dict(MLA, linear_head_dim=16, linear_num_heads=4, layer_types=HYBRID_LINEAR),
    "gemma3n_text": dict(
        num_hidden_layers=6,
        layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
    ),
    "dory": dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2),
    "beam": dict(n_group=1, topk_group=1),
    "gemma4_text": GEMMA4_TEXT,
    "gemma4": dict(text_config=GEMMA4_TEXT),
    "gemma4_unified_text": GEMMA4_TEXT,
    "gemma4_unified": dict(text_config=GEMMA4_TEXT),
}
"""What a model type needs beyond :data:`SIZES` (a sub-config's settings under its name)."""


def tiny_config(model_type: str) -> PretrainedConfig:
    """``model_type``'s config, shrunk (see the module docstring)."""
    config_class = CONFIG_MAPPING[model_type]
    return config_class(**_shrunk_arguments(config_class, SETTINGS.get(model_type, {})))


EAGER = {"gemma4"}
"""Model types built with eager attention: a part of them has no SDPA path (Gemma 4's audio tower)."""


def tiny_model(model_type: str) -> torch.nn.Module:
    """A seeded, eval-mode, float32 random-weight causal LM of ``model_type``, ready to generate."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager" if model_type in EAGER else None).eval()
    if model_type == "xmod":  # X-MOD routes through per-language adapters: it needs one named
        model.set_default_language(config.languages[0])
    return model


def _shrunk_arguments(config_class: type[PretrainedConfig], settings: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments building ``config_class`` shrunk: :data:`SIZES` it has, ``settings``
    over them; sub-configs as dicts of their own shrunk arguments (as a saved config holds them)."""
    fields = getattr(config_class, "__dataclass_fields__", {})
    try:
        default = config_class()
    except ValueError:  # a class whose defaults alone fail its validators: its fields name its sizes
        default = None
    names = set(fields) | set(getattr(config_class, "attribute_map", {}) or {}) | set(vars(default) if default is not None else ())
    arguments = {name: value for name, value in SIZES.items() if name in names}
    if "layer_types" in fields and getattr(default, "layer_types", None) is not None:
        arguments["layer_types"] = None  # rebuilt by the class for the shrunk layer count
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    for name, sub in sub_configs.items():
        current = getattr(default, name, None)
        sub_class = type(current) if isinstance(current, PretrainedConfig) else sub
        if isinstance(sub_class, type) and issubclass(sub_class, PretrainedConfig) and sub_class.__name__ != "AutoConfig":
            arguments[name] = dict(_shrunk_arguments(sub_class, settings.get(name, {})), model_type=sub_class.model_type)
    arguments.update((name, value) for name, value in settings.items() if name not in sub_configs)
    return arguments
