"""Qwen3.5 (text) in llama.cpp's ``qwen35`` layout: the gated-delta-rule layers' tensors and keys.

Learned from llama.cpp's converter and loader, not copied from them, and checked against its logits
(tests/export/test_gguf_llama_cpp.py):

- ``A_log`` is written as ``ssm_a`` = −exp(A_log); ``dt_bias`` as ``ssm_dt.bias``; the depthwise
  ``conv1d.weight`` [C, 1, K] as [C, K].
- With more value heads than key heads, transformers gives each group of r = nv / nk consecutive value
  heads one key head; llama.cpp tiles the key heads instead. Every per-value-head row or column (the v
  part of in_proj_qkv and conv1d, in_proj_z/b/a, A_log, dt_bias, out_proj's columns) is reordered.
- Qwen3.5's RMSNorms scale by (1 + w): 1 is added to every norm weight but the gated delta rule's own
  output norm (``linear_attn.norm``, a plain weight).
- llama.cpp's loader sizes the value heads by ``ssm.state_size`` (the key head width): a config whose value
  heads are wider or narrower fails to load there ("wrong shape"), so it is refused.
- Keys: the SSM sizes of the gated delta rule, the interval of its full-attention layers, and the
  rotary sections (a text position rotates every section alike).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCHS = ("qwen35", "qwen35moe")  # llama.cpp's arches with these layers (qwen35moe adds experts: gguf_qwen35moe.py)
PLAIN_NORM = "linear_attn.norm.weight"  # Qwen3_5RMSNormGated: no (1 + w)


def name_key(hf_name: str) -> str:
    """The key llama.cpp's name map knows for ``hf_name``."""
    if hf_name.endswith("linear_attn.dt_bias"):
        return hf_name[: -len("dt_bias")] + "dt_proj.bias"
    return hf_name


def shape(hf_name: str, hf_shape: tuple) -> tuple:
    """The GGUF tensor's shape: the depthwise conv without its middle axis of 1."""
    if hf_name.endswith("linear_attn.conv1d.weight") and len(hf_shape) == 3:
        return (hf_shape[0], hf_shape[2])
    return tuple(hf_shape)


def _value_head_order(cfg: dict[str, Any]) -> np.ndarray | None:
    """GGUF value head j ← transformers value head h. transformers shares key head h // r among the r = nv / nk
    value heads of a group (``repeat_interleave``); llama.cpp tiles the key heads (value head j reads key head
    j % nk), so j = i·nk + k takes head k·r + i. None when nv = nk."""
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if nv == nk:
        return None
    if nv % nk:
        raise ValueError(f"qwen35 GGUF: {nv} value heads do not share {nk} key heads evenly")
    r = nv // nk
    j = np.arange(nv)
    return (j % nk) * r + j // nk


def _heads(data: np.ndarray, order: np.ndarray, width: int, axis: int = 0) -> np.ndarray:
    """``data`` with its ``len(order)`` blocks of ``width`` along ``axis`` put in ``order``."""
    moved = np.moveaxis(data, axis, 0)
    blocks = moved.reshape(len(order), width, *moved.shape[1:])[order]
    return np.moveaxis(blocks.reshape(moved.shape), 0, axis)


def transform(hf_name: str, data: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """One tensor as llama.cpp reads it (the module docstring lists what changes)."""
    if ".linear_attn." not in hf_name:
        return data
    if hf_name.endswith("conv1d.weight") and data.ndim == 3:
        data = data[:, 0, :]
    order = _value_head_order(cfg)
    if order is not None:
        dv = int(cfg["linear_value_head_dim"])
        qk = 2 * int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])  # q and k rows, then v
        if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            data = np.concatenate([data[:qk], _heads(data[qk:], order, dv)])
        elif hf_name.endswith("in_proj_z.weight"):
            data = _heads(data, order, dv)
        elif hf_name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            data = _heads(data, order, 1)
        elif hf_name.endswith("out_proj.weight"):
            data = _heads(data, order, dv, axis=1)
    if hf_name.endswith("A_log"):
        data = -np.exp(data.astype(np.float64)).astype(np.float32)
    return data


def _full_attention_interval(cfg: dict[str, Any]) -> int:
    layer_types = cfg.get("layer_types") or []
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    interval = full[0] + 1 if full else 0
    if not full or [i for i in range(len(layer_types)) if (i + 1) % interval == 0] != full:
        raise ValueError(f"qwen35 GGUF: llama.cpp places a full-attention layer every n-th layer; this config's "
                         f"layer_types are {layer_types}")
    return interval


def check_config(cfg: dict[str, Any]) -> None:
    _full_attention_interval(cfg)
    _value_head_order(cfg)
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    if dk != dv:  # llama.cpp sizes the delta rule's value heads by ssm.state_size, the key head width
        raise ValueError(f"qwen35 GGUF: llama.cpp's loader gives the gated delta rule's value heads the key heads' "
                         f"width; linear_value_head_dim={dv} differs from linear_key_head_dim={dk}")


def metadata(w, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(cfg["linear_key_head_dim"]))
    w.add_ssm_group_count(int(cfg["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(cfg["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(cfg["linear_value_head_dim"]) * int(cfg["linear_num_value_heads"]))
    w.add_full_attention_interval(_full_attention_interval(cfg))
    sections = [int(s) for s in rope.get("mrope_section") or []]
    if sections:
        w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
