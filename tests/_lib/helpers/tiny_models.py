"""Tiny random models of every supported family, built from configs in-process (no downloads)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILY_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2",
                "olmo3", "ministral", "smollm3", "glm4", "ernie4_5", "hunyuan_v1_dense", "exaone4", "seed_oss",
                "qwen3_5_text")
# A family whose layers compute something else under another config gets a second tiny model here, which
# the parity tests run as they run FAMILY_TYPES (FAMILY_CASES): case name → (model_type, config extras).
# EXAONE 4 without a sliding window: every layer rotates (with one, its full-attention layers are NoPE).
VARIANTS = {"exaone4_no_window": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 2))}
FAMILY_CASES = FAMILY_TYPES + tuple(VARIANTS)
# Families whose q/k rotate in interleaved pairs: their own apply_rotary_pos_emb runs (a "rope" fallback).
OWN_ROPE_TYPES = ("glm4", "ernie4_5")
# Softmax-attention layers of the two-layer tiny model where not both (Qwen3.5's first layer mixes
# tokens with a gated delta rule, which stays stock with its gated norm).
ATTENTION_LAYERS = {"qwen3_5_text": 1, "qwen3_5_moe_text": 1}


def family_type(case: str) -> str:
    """The model_type of a FAMILY_CASES entry (a family's own name, or a VARIANTS name)."""
    return VARIANTS[case][0] if case in VARIANTS else case


def attention_layers(model_type: str) -> int:
    return ATTENTION_LAYERS.get(family_type(model_type), 2)


def stock_fallback_ops(model_type: str) -> list[str]:
    """The ops a fully patched tiny model of ``model_type`` (or a VARIANTS case) reports as fallbacks
    (FastConfig()), in order."""
    model_type = family_type(model_type)
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        return ["rms_norm", "rope"]  # the gated delta rule's RMSNormGated; the layer without self_attn
    return ["rope"] if model_type in OWN_ROPE_TYPES else []

# GQA everywhere (4 query heads over 2 KV heads), odd-ish widths, vocab > 65,536 (the kernels'
# int32/large-vocab paths), two layers so layer stacking is exercised.
_BASE = dict(
    vocab_size=70_001, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0,
)

# Per-family extras so each family's distinctive features are on (soft-caps, multipliers, ...).
_EXTRA = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "gemma": dict(tie_word_embeddings=True),
    "gemma2": dict(tie_word_embeddings=True, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   query_pre_attn_scalar=24, sliding_window=64),
    "gemma3_text": dict(tie_word_embeddings=True, final_logit_softcapping=30.0, query_pre_attn_scalar=24,
                        sliding_window=64),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=4.0),
    "olmo2": dict(pad_token_id=0),
    # One sliding and one full layer; SmolLM3's second layer is NoPE; GLM-4 rotates half of each head
    # (partial_rotary_factor 0.5, the config's default) in interleaved pairs, as ERNIE 4.5 does whole.
    "olmo3": dict(pad_token_id=0, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "ministral": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(pad_token_id=0, no_rope_layers=[1, 0], tie_word_embeddings=True),
    "glm4": dict(pad_token_id=0, attention_bias=True),
    "ernie4_5": dict(pad_token_id=0, use_bias=True, tie_word_embeddings=True),
    # EXAONE 4 with a window shorter than the test batches: the sliding layer rotates, the full one is NoPE.
    "exaone4": dict(pad_token_id=0, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # Seed-OSS with every bias it can have (q/k/v, o_proj, MLP); its residual dropout off here (the released config
    # has 0.1, run in training by tests/model_patches/test_output_dropout.py).
    "seed_oss": dict(attention_bias=True, attention_out_bias=True, mlp_bias=True, residual_dropout=0.0),
    # Qwen3.5: a gated-delta-rule layer (stock) then a gated full-attention layer; partial RoPE over 12
    # of 24 dims in 3-D sections (one position per token in text: the sections rotate alike).
    "qwen3_5_text": dict(pad_token_id=0, layer_types=["linear_attention", "full_attention"],
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                              mrope_section=[2, 2, 2]),
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4),
}


# Mixture-of-experts families (tests/model_patches/test_moe.py): 4 experts, top-2, a small vocab
# (the large-vocab path is the loss head's, covered by the dense families). Qwen3-MoE's second
# layer is dense (mlp_only_layers), so both layer kinds run.
MOE_TYPES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "granitemoe", "glm4_moe", "qwen3_5_moe_text",
             "qwen2_moe")
_MOE = dict(vocab_size=1000, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
_EXTRA.update({
    "qwen3_moe": dict(_MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                      decoder_sparse_step=1),
    "mixtral": dict(_MOE, num_local_experts=4, intermediate_size=32, sliding_window=None),
    "gpt_oss": dict(_MOE, num_local_experts=4, intermediate_size=32, swiglu_limit=0.1, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    "olmoe": dict(_MOE, num_experts=4, intermediate_size=32, norm_topk_prob=False, pad_token_id=0),
    "glm4_moe": dict(_MOE, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, use_qk_norm=True,
                     partial_rotary_factor=0.5),
    "qwen3_5_moe_text": dict(_EXTRA["qwen3_5_text"], **_MOE, num_experts=4, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48),
    # Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert, the second layer dense (mlp_only_layers; its
    # intermediate_size 200), a sliding first layer (window 8) and softmax → top-k without renormalising.
    "qwen2_moe": dict(_MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, qkv_bias=True, mlp_only_layers=[1], decoder_sparse_step=1,
                      use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "granitemoe": dict(_MOE, num_local_experts=4, intermediate_size=32, embedding_multiplier=2.0,
                       residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
})


def tiny_config(model_type: str, **overrides):
    """A tiny random config of ``model_type`` or a VARIANTS case (attention on the eager path for exact parity)."""
    model_type, variant = VARIANTS.get(model_type, (model_type, {}))
    kwargs = {**_BASE, **_EXTRA.get(model_type, {}), **variant, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = overrides.get("attn_implementation", "eager")
    return config


def tiny_model(model_type: str = "llama", dtype=torch.float32, seed: int = 0, **overrides):
    """A randomly initialised causal LM of ``model_type`` (or a VARIANTS case) in ``dtype``, weights fixed by
    ``seed``."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    # Gemma-style norms start at zero weight ((1 + w)); randomise every norm so gradients are generic.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2).add_(0.0 if model_type.startswith("gemma") else 1.0)
    return model


def make_batch(vocab_size: int, batch: int = 2, seq: int = 17, seed: int = 0, ignore_frac: float = 0.25,
               device="cpu"):
    """input_ids, attention_mask and labels with a fraction of labels set to -100."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    labels = input_ids.clone()
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = -100
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
        "labels": labels.to(device),
    }
