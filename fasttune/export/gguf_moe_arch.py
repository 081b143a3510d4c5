"""llama.cpp's mixture-of-experts GGUF architectures: expert metadata, the configs each graph can
express, and the split of transformers' stacked expert parameters into ``ffn_{gate,up,down}_exps``.

Learned from llama.cpp's converter and graphs (``src/models/*.cpp``), not copied from them:

- Routing. The ``llama`` (Mixtral), ``qwen3moe`` and ``granitemoe`` graphs take softmax → top-k →
  renormalised weights (HF ``norm_topk_prob=True``, or top-k logits → softmax, the same numbers);
  ``olmoe`` takes softmax → top-k without renormalising (OLMoE's ``norm_topk_prob=False``);
  ``gpt-oss`` takes top-k of the biased router logits → softmax over the k (HF's GptOssTopKRouter).
- gpt-oss: the experts are stored transposed ([E, H, 2I], [E, I, H]) with gate and up columns
  interleaved (gate = even, up = odd), each with a bias; llama.cpp's ``swiglu_oai`` hard-codes
  alpha 1.702 and limit 7 (gate clamped above, up clamped both ways, ``(up + 1)·gate·σ(α·gate)``);
  the sliding window alternates, even layers sliding (``set_swa_pattern(2)``); attention sinks are
  the per-head ``attn_sinks.weight``; q/k/v/o biases and the router bias are read.
- olmoe: the q/k RMSNorms span the whole projection (``{n_embd}`` in llama.cpp's loader for both),
  so the k norm only fits when there are as many key/value heads as query heads; no ``clip_qkv``.
- qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layer (q/k/v biases, NEOX RoPE on whole heads, square
  ``attn_q``/``attn_output``: ``n_embd`` wide), every layer a mixture routed softmax → top-k *without*
  renormalising (HF ``norm_topk_prob=False``, the released configs'), SiLU experts, plus a shared expert
  ``ffn_{gate,up,down}_shexp`` scaled by ``sigmoid(ffn_gate_inp_shexp · x)`` (a vector of ``n_embd``; HF's
  ``shared_expert_gate`` [1, H]); ``output`` is required; no sliding window.
- glm4moe: leading dense layers (``leading_dense_block_count``), a shared expert of
  ``n_shared_experts·moe_intermediate_size`` added to every MoE layer, sigmoid gating with the
  ``exp_probs_b`` selection bias; no expert groups (``n_group``/``topk_group`` must select all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # llama.cpp's swiglu_oai constants

# (HF-style key the GGUF name map knows, shape, how to take it from the stacked tensor)
Part = tuple[str, tuple[int, ...], Callable[[Any], Any]]


def n_experts(cfg: dict[str, Any]) -> int | None:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")


def meta_experts(w, cfg: dict[str, Any]) -> None:
    """Expert counts of a mixture-of-experts config (nothing for a dense one)."""
    if not (count := n_experts(cfg)):
        return
    w.add_expert_count(int(count))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))


def meta_qwen3moe(w, cfg: dict[str, Any]) -> None:
    meta_experts(w, cfg)
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))


def meta_qwen2moe(w, cfg: dict[str, Any]) -> None:
    meta_experts(w, cfg)
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))


def meta_gpt_oss(w, cfg: dict[str, Any]) -> None:
    meta_experts(w, cfg)
    w.add_expert_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_sliding_window(int(cfg["sliding_window"]))


def meta_olmoe(w, cfg: dict[str, Any]) -> None:
    meta_experts(w, cfg)


def meta_glm4moe(w, cfg: dict[str, Any]) -> None:
    """GLM-4.5: sigmoid router scores, top-k chosen on scores + e_score_correction_bias, the unbiased
    scores renormalised (norm_topk_prob) and scaled by routed_scaling_factor; dense leading layers."""
    import gguf

    meta_experts(w, cfg)
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_count(int(cfg["n_shared_experts"]))
    w.add_leading_dense_block_count(int(cfg.get("first_k_dense_replace") or 0))
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor") or 1.0))
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


# Top-k renormalisation each graph applies (True: weights renormalised over the chosen k).
_RENORMALISES = {"llama": True, "qwen3moe": True, "granitemoe": True, "olmoe": False, "qwen2moe": False}


def check_config(arch: str, cfg: dict[str, Any]) -> None:
    """ValueError for a MoE config the arch's llama.cpp graph cannot represent (before any tensor is read)."""
    if arch == "qwen2moe" and not n_experts(cfg):
        raise ValueError("llama.cpp's qwen2moe graph has a mixture of experts in every layer; num_experts is unset")
    if not n_experts(cfg):
        return
    if arch in ("qwen3moe", "qwen2moe") and (cfg.get("mlp_only_layers")
                                             or int(cfg.get("decoder_sparse_step") or 1) != 1):
        raise ValueError(f"llama.cpp's {arch} graph has a mixture of experts in every layer; this config has "
                         "dense layers (mlp_only_layers / decoder_sparse_step)")
    if arch == "qwen2moe":
        _check_qwen2moe(cfg)
    if arch in _RENORMALISES and "norm_topk_prob" in cfg and bool(cfg["norm_topk_prob"]) != _RENORMALISES[arch]:
        does = "renormalises" if _RENORMALISES[arch] else "does not renormalise"
        raise ValueError(f"llama.cpp's {arch} graph {does} the top-k router weights; norm_topk_prob="
                         f"{cfg['norm_topk_prob']} has no GGUF form")
    if arch == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise ValueError("llama.cpp's olmoe graph does not clamp q/k/v; clip_qkv must be None")
        if (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
            raise ValueError("llama.cpp's olmoe graph normalises k over the full hidden width; grouped-query "
                             "attention (num_key_value_heads != num_attention_heads) has no GGUF form")
    if arch == "gpt-oss":
        _check_gpt_oss(cfg)
    if arch == "glm4moe":
        groups, used = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if groups > 1 and used < groups:
            raise ValueError(f"llama.cpp's glm4moe graph routes over all experts; group-limited routing "
                             f"(n_group={groups}, topk_group={used}) has no GGUF form")
        if not cfg.get("n_shared_experts"):
            raise ValueError("llama.cpp's glm4moe graph always adds a shared expert; n_shared_experts=0 has no "
                             "GGUF form")


def _check_qwen2moe(cfg: dict[str, Any]) -> None:
    """llama.cpp's qwen2moe loader and graph: square q/o projections, whole-head RoPE, SiLU experts and shared
    expert (always present), full attention in every layer."""
    heads = cfg["num_attention_heads"]
    head = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head * heads != cfg["hidden_size"]:
        raise ValueError(f"llama.cpp's qwen2moe loader needs num_attention_heads * head_dim == hidden_size (its "
                         f"attn_q and attn_output are n_embd wide), got {heads} * {head} != {cfg['hidden_size']}")
    if (act := cfg.get("hidden_act", "silu")) not in ("silu", "swish"):
        raise ValueError(f"llama.cpp's qwen2moe graph runs SiLU experts; hidden_act={act!r} has no GGUF form")
    if not cfg.get("shared_expert_intermediate_size"):
        raise ValueError("llama.cpp's qwen2moe graph always adds a shared expert; shared_expert_intermediate_size "
                         "is unset or 0")
    sliding = [i for i, t in enumerate(cfg.get("layer_types") or []) if t == "sliding_attention"]
    if sliding and cfg.get("sliding_window"):
        raise ValueError(f"llama.cpp's qwen2moe graph has no sliding window; this config (use_sliding_window) "
                         f"limits layers {sliding} to {cfg['sliding_window']} tokens")


def _check_gpt_oss(cfg: dict[str, Any]) -> None:
    alpha, limit = cfg.get("swiglu_alpha", GPT_OSS_ALPHA), cfg.get("swiglu_limit", GPT_OSS_LIMIT)
    if abs(float(alpha) - GPT_OSS_ALPHA) > 1e-9 or abs(float(limit) - GPT_OSS_LIMIT) > 1e-9:
        raise ValueError(f"llama.cpp's gpt-oss graph hard-codes the clamped SwiGLU's alpha={GPT_OSS_ALPHA} and "
                         f"limit={GPT_OSS_LIMIT}; this config has swiglu_alpha={alpha}, swiglu_limit={limit}")
    if not cfg.get("sliding_window"):
        raise ValueError("llama.cpp's gpt-oss graph needs a sliding window (config.sliding_window is unset)")
    n_layer = cfg["num_hidden_layers"]
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    if list(cfg.get("layer_types") or want) != want:
        raise ValueError("llama.cpp's gpt-oss graph alternates sliding (even layers) and full (odd layers) "
                         f"attention; this config's layer_types are {cfg['layer_types']}")
    if cfg.get("attention_bias") is False:
        raise ValueError("llama.cpp's gpt-oss graph reads q/k/v/o biases; attention_bias=False has no GGUF form")


def _layer_key(hf_name: str, leaf: str) -> str:
    """``model.layers.<i>.mlp.experts.<leaf>``: the key llama.cpp's name map knows for every MoE arch
    (granitemoe's ``block_sparse_moe`` included)."""
    bid = hf_name.split(".layers.")[1].split(".")[0]
    return f"model.layers.{bid}.mlp.experts.{leaf}"


def expert_parts(arch: str, hf_name: str, shape: tuple[int, ...]) -> list[Part] | None:
    """The GGUF pieces of a stacked expert parameter (None for any other parameter). GGUF stores
    each with the dimensions reversed: gate/up [H, I, E], down [I, H, E], llama.cpp's layout."""
    if ".experts." not in hf_name or ".layers." not in hf_name:
        return None
    if arch == "gpt-oss":
        return _gpt_oss_parts(hf_name, shape)
    if hf_name.endswith("experts.gate_up_proj") and len(shape) == 3:  # [E, 2I, H]: gate rows, then up rows
        E, two_i, H = shape
        half = two_i // 2
        return [(_layer_key(hf_name, "gate_proj"), (E, half, H), lambda t: t[:, :half]),
                (_layer_key(hf_name, "up_proj"), (E, half, H), lambda t: t[:, half:])]
    if hf_name.endswith("experts.down_proj") and len(shape) == 3:  # [E, H, I]
        return [(_layer_key(hf_name, "down_proj"), tuple(shape), lambda t: t)]
    return None


def _gpt_oss_parts(hf_name: str, shape: tuple[int, ...]) -> list[Part] | None:
    """gpt-oss: weights transposed ([E, H, 2I] and [E, I, H]), gate/up interleaved, biases alongside."""
    if hf_name.endswith("experts.gate_up_proj") and len(shape) == 3:
        E, H, two_i = shape
        return [(_layer_key(hf_name, "gate_proj"), (E, two_i // 2, H), lambda t: t.transpose(-1, -2)[:, 0::2]),
                (_layer_key(hf_name, "up_proj"), (E, two_i // 2, H), lambda t: t.transpose(-1, -2)[:, 1::2])]
    if hf_name.endswith("experts.gate_up_proj_bias") and len(shape) == 2:
        E, two_i = shape
        return [(_layer_key(hf_name, "gate_proj.bias"), (E, two_i // 2), lambda t: t[:, 0::2]),
                (_layer_key(hf_name, "up_proj.bias"), (E, two_i // 2), lambda t: t[:, 1::2])]
    if hf_name.endswith("experts.down_proj") and len(shape) == 3:
        E, inner, H = shape
        return [(_layer_key(hf_name, "down_proj"), (E, H, inner), lambda t: t.transpose(-1, -2))]
    if hf_name.endswith("experts.down_proj_bias") and len(shape) == 2:
        return [(_layer_key(hf_name, "down_proj.bias"), tuple(shape), lambda t: t)]
    return None


def name_map_key(hf_name: str) -> str:
    """The key llama.cpp's name map knows for ``hf_name``: GraniteMoE's router
    (``block_sparse_moe.router.weight``) under the ``mlp.gate`` name it maps, GLM-4.5's router bias
    buffer as ``e_score_correction.bias`` (``exp_probs_b.bias``)."""
    return (hf_name.replace(".block_sparse_moe.router.", ".mlp.gate.")
            .replace(".e_score_correction_bias", ".e_score_correction.bias"))


def gguf_tensor_name(mapped: str) -> str:
    """The GGUF name of a mapped key: the name map gives weights without a suffix (gpt-oss's ``sinks``
    and the stacked experts) their ``.weight``."""
    return mapped if mapped.endswith((".weight", ".bias")) else mapped + ".weight"
