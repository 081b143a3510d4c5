"""Qwen3.5-MoE (text) in llama.cpp's ``qwen35moe`` layout: Qwen3.5's layers with a mixture of experts.

Learned from llama.cpp's loader and graph (``src/models/qwen35moe.cpp``) and its converter, not copied
from them, and checked against its logits (tests/export/test_gguf_llama_cpp.py):

- The token mixers are Qwen3.5's (gated delta rule, gated full attention, (1 + w) norms): ``gguf_qwen35``
  writes them for both arches.
- Every layer's MLP is a routed mixture: softmax → top-k → renormalised weights (transformers'
  ``Qwen3_5MoeTopKRouter`` always renormalises; llama.cpp hard-codes it), SiLU experts. The stacked
  ``gate_up_proj`` / ``down_proj`` split into ``ffn_{gate,up,down}_exps`` (``gguf_moe_arch.expert_parts``),
  the router is ``ffn_gate_inp``.
- Plus a shared expert (``ffn_{gate,up,down}_shexp``) scaled by ``sigmoid(ffn_gate_inp_shexp · x)``; llama.cpp
  reads that gate as a vector of ``n_embd`` where transformers holds a ``Linear(hidden, 1)`` weight [1, H].
- Keys: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (``moe_intermediate_size``),
  ``expert_shared_feed_forward_length`` (``shared_expert_intermediate_size``); the config has no dense MLP,
  so ``feed_forward_length`` (which llama.cpp reads optionally) is written only when the config has one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import gguf_moe_arch as moe

SHARED_GATE = "mlp.shared_expert_gate.weight"


def shape(hf_name: str, hf_shape: tuple) -> tuple:
    """The GGUF tensor's shape: the shared expert's gate as a vector."""
    if hf_name.endswith(SHARED_GATE) and len(hf_shape) == 2 and hf_shape[0] == 1:
        return (hf_shape[1],)
    return tuple(hf_shape)


def transform(hf_name: str, data: np.ndarray) -> np.ndarray:
    """One tensor as llama.cpp reads it (after ``gguf_qwen35.transform``)."""
    if hf_name.endswith(SHARED_GATE) and data.ndim == 2 and data.shape[0] == 1:
        return data.reshape(-1)
    return data


def check_config(cfg: dict[str, Any]) -> None:
    """ValueError for a config llama.cpp's qwen35moe graph cannot run (Qwen3.5's own checks aside)."""
    if not moe.n_experts(cfg):
        raise ValueError("llama.cpp's qwen35moe graph has a mixture of experts in every layer; num_experts is unset")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"llama.cpp's qwen35moe graph runs SiLU experts; hidden_act={act!r} has no GGUF form")
    if not cfg.get("shared_expert_intermediate_size"):
        raise ValueError("qwen35moe GGUF: the shared expert's width (shared_expert_intermediate_size) is unset")


def metadata(w, cfg: dict[str, Any]) -> None:
    moe.meta_experts(w, cfg)
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
