"""Tiny random LoRA models of every family, shaped for GGUF tests, with tokenizers llama.cpp reads.

Widths are multiples of 256 (K-quant rows), the vocabulary has 512 rows (the in-process tokenizers
have ~400 tokens, so some rows are unused padding), norms are random (so Gemma's 1 + w shift and
every norm weight matter) and LoRA B is random (so the merge matters).
"""

from __future__ import annotations

import functools

import torch

from .tiny_tokenizers import bpe_tokenizer, sp_tokenizer

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2",
            "olmo3", "smollm3", "glm4", "ernie4_5", "hunyuan_v1_dense", "exaone4", "seed_oss")
# GGUF architecture when it is not the model_type
ARCH = {"mistral": "llama", "gemma3_text": "gemma3", "olmo3": "olmo2", "hunyuan_v1_dense": "hunyuan-dense"}
ROTARY = {"glm4": 0.5}  # partial_rotary_factor where not 1 (GLM-4's config default)
SP_FAMILIES = {"mistral", "gemma", "gemma2", "gemma3_text"}  # SentencePiece-style vocabularies
TIED = {"qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "smollm3", "ernie4_5", "exaone4"}
EXTRA = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "gemma2": dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=64,
                   sliding_window=64),
    "gemma3_text": dict(query_pre_attn_scalar=64, sliding_window=64, final_logit_softcapping=20.0),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "olmo2": dict(pad_token_id=0, eos_token_id=2),
    # OLMo 3: a sliding layer whose window (8) is shorter than the test prompts (16 tokens).
    "olmo3": dict(pad_token_id=0, eos_token_id=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(pad_token_id=0, no_rope_layers=[1, 1]),  # llama.cpp's NoPE layer is every 4th (SMOLLM3_NOPE)
    "glm4": dict(pad_token_id=0, attention_bias=True),
    "hunyuan_v1_dense": dict(pad_token_id=0),
    "ernie4_5": dict(pad_token_id=0),  # no biases: llama.cpp's graph has none (refused, test_gguf.py)
    # EXAONE 4 without a window (as the 1.2B): every layer rotated, full attention; llama.cpp runs the window
    # only at 64 layers (EXAONE4_SWA), and refuses it at this depth (test_gguf.py)
    "exaone4": dict(pad_token_id=0, sliding_window=None, layer_types=["full_attention"] * 2),
    # Seed-OSS as released: q/k/v biases (no o_proj or MLP bias); its dropout is off in eval
    "seed_oss": dict(attention_bias=True, attention_out_bias=False, mlp_bias=False),
}
# EXAONE 4 as the 32B is built, at tiny widths: 64 layers (the only depth at which llama.cpp runs the window),
# three sliding layers of four with a window of 5 (shorter than the test prompts) and NoPE full-attention layers,
# Llama 3 RoPE (frequency factors written as rope_freqs; a short original context so they matter), untied.
EXAONE4_LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
EXAONE4_SWA = dict(num_hidden_layers=64, sliding_window=5, sliding_window_pattern=4, layer_types=None,
                   hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   tie_word_embeddings=False, rope_parameters=EXAONE4_LLAMA3)
# SmolLM3 as llama.cpp runs it: four layers, the fourth without RoPE.
SMOLLM3_NOPE = dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
# Qwen3.5 (llama.cpp qwen35): a gated-delta-rule layer, then a full-attention one (llama.cpp needs at least
# one recurrent layer), more value heads than key heads (the head reordering matters), partial RoPE in sections.
QWEN3_5 = dict(pad_token_id=0, layer_types=["linear_attention", "full_attention"],
               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                    mrope_section=[3, 3, 2]),
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
               linear_conv_kernel_dim=4)
DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-6)


@functools.lru_cache(maxsize=None)
def gguf_tokenizer(kind: str):
    """"sp" (SentencePiece-style, llama.cpp "llama") or "bpe" (byte-level, llama.cpp "gpt2"); cached."""
    return sp_tokenizer() if kind == "sp" else bpe_tokenizer()


def family_tokenizer(family: str):
    return gguf_tokenizer("sp" if family in SP_FAMILIES else "bpe")


def gguf_model(family: str, **overrides):
    """A tiny random LoRA model of ``family`` (random B so the merge matters, random norms), in eval mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = {**DIMS, "tie_word_embeddings": family in TIED, **EXTRA.get(family, {}), **overrides}
    cfg = AutoConfig.for_model(family, **kwargs)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2).add_(0.0 if family.startswith("gemma") else 1.0)
            else:
                p.normal_(0.0, 0.05)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, lora).eval()


# Mixture-of-experts families GGUF export writes: model_type → (GGUF arch, config extras).
MOE_DIMS = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-6, num_experts_per_tok=2,
                tie_word_embeddings=False)
GPT_OSS_YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=4096, truncate=False)  # gpt-oss-20b/120b's RoPE
MOE = {
    "qwen3_moe": ("qwen3moe", dict(num_experts=4, moe_intermediate_size=128, intermediate_size=512,
                                   norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1)),
    "mixtral": ("llama", dict(num_local_experts=4, intermediate_size=128, sliding_window=None)),
    # gpt-oss's YaRN RoPE, truncated as llama.cpp runs it (its default truncate=False needs approximate_yarn);
    # a window of 5 so the sliding layers differ within the test prompts
    "gpt_oss": ("gpt-oss", dict(num_local_experts=4, intermediate_size=128, sliding_window=5,
                                rope_parameters=dict(GPT_OSS_YARN, truncate=True))),
    # llama.cpp's olmoe k norm spans the full width: as many kv heads as query heads
    "olmoe": ("olmoe", dict(num_experts=4, intermediate_size=128, num_key_value_heads=4, norm_topk_prob=False,
                            pad_token_id=0, eos_token_id=2)),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, intermediate_size=128, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    # GLM-4.5's shape: a dense first layer, a shared expert, q/k/v biases, q/k norms, half-width RoPE
    "glm4_moe": ("glm4moe", dict(n_routed_experts=4, moe_intermediate_size=128, intermediate_size=256,
                                 first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
                                 routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                                 use_qk_norm=True)),
    # Qwen1.5-MoE's shape: q/k/v biases, a sigmoid-gated shared expert, softmax → top-k not renormalised, every
    # layer a mixture, full attention (llama.cpp's qwen2moe has no dense layers and no window: refused otherwise)
    "qwen2_moe": ("qwen2moe", dict(num_experts=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                   intermediate_size=512, norm_topk_prob=False, qkv_bias=True, mlp_only_layers=[],
                                   decoder_sparse_step=1, use_sliding_window=False)),
}
# Where the stacked experts live when it is not ``mlp.experts`` (PEFT's target_parameters).
EXPERTS_AT = {"granitemoe": "block_sparse_moe.experts"}


def gguf_moe_model(family: str, **overrides):
    """A tiny random MoE model with LoRA on attention and on the stacked experts, in eval mode."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, **{**MOE_DIMS, **MOE[family][1], **overrides})
    return _random_moe_lora(cfg, EXPERTS_AT.get(family, "mlp.experts"), ["q_proj", "v_proj"])


def gguf_qwen2_moe_model(lora: bool = True, **overrides):
    """The tiny Qwen2-MoE of ``MOE`` with random weights; with ``lora``, LoRA (random B) on every linear layer
    (the shared expert and its sigmoid gate included) and on the stacked experts, so the merge of each matters."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen2_moe", **{**MOE_DIMS, **MOE["qwen2_moe"][1], **overrides})
    return _random_moe_lora(cfg, "mlp.experts", "all-linear" if lora else None)


def gguf_qwen3_5_moe_model(lora: bool = True, **overrides):
    """The tiny Qwen3.5-MoE of ``tiny_models`` (a gated-delta-rule layer, then a gated full-attention one, each
    with 4 routed experts and a sigmoid-gated shared expert; 4 value heads over 2 key heads), random weights as
    ``gguf_moe_model``'s; with ``lora``, LoRA on every linear layer (the delta rule's projections, the shared
    expert and its gate included) and on the stacked experts, so the merge of each matters. Eval mode."""
    from .tiny_models import tiny_config

    # no intermediate_size, as the released configs (tiny_models' shared 200 is a stray attribute for this type)
    cfg = tiny_config("qwen3_5_moe_text", **{"intermediate_size": None, **overrides})
    return _random_moe_lora(cfg, "mlp.experts", "all-linear" if lora else None)


def _random_moe_lora(cfg, at: str, target_modules):
    """The model of ``cfg`` with random weights (random norms, the gpt-oss sinks and GLM-4.5's selection bias far
    from 0) and LoRA (random B) on ``target_modules`` and the stacked experts under ``at`` (None: no LoRA)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2).add_(1.0)
            elif name.endswith("sinks"):  # gpt-oss: sinks far from 0 weigh in every softmax
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's expert-choice bias: it must matter
                b.normal_(0.0, 0.2)
    if target_modules is None:
        return model.eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False,
                      target_parameters=[f"{at}.gate_up_proj", f"{at}.down_proj"])
    return get_peft_model(model, lora).eval()
