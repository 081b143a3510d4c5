"""llama.cpp format knowledge, per GGUF architecture: metadata keys and tensor transforms.

Keyed by the GGUF arch name (``FamilySpec.gguf_arch`` in ``model_patches/families.py``). Learned
from llama.cpp's converter and loader (``src/models/<arch>.cpp``), not copied from them:

- q/k row permutation: llama.cpp's "llama", "granite" and "smollm3" graphs apply RoPE to adjacent
  pairs (``LLAMA_ROPE_TYPE_NORM``) while HF rotates halves; the rows of each q/k head are reordered
  from [x_0..x_{d/2-1}, x_{d/2}..x_{d-1}] to interleaved pairs. qwen2, qwen3, gemma*, phi3,
  olmo2 and hunyuan-dense run NEOX-style RoPE on the HF layout, and glm4 / ernie4_5 rotate adjacent pairs in HF as in
  llama.cpp: no permutation.
- smollm3: llama.cpp skips RoPE in every fourth layer (il + 1 ≡ 0 mod 4) and reads no layer list, so
  a config whose ``no_rope_layers`` says otherwise is refused.
- exaone4: NEOX RoPE (no permutation), q/k norms before it, OLMo2's post-norms under their own names. llama.cpp
  runs the sliding window (the per-layer pattern from the file) with NoPE full-attention layers only in 64-layer
  models, as transformers does wherever ``sliding_window`` is set, and rotates every layer with full attention at
  any other depth, as transformers does without a window: the other two combinations are refused. Llama 3 RoPE
  (the released models') is written as ``rope_freqs``, as for llama.
- seed_oss: Llama's layer with NEOX RoPE (no permutation) and q/k/v biases; its norm before the MLP is
  ``attn_post_norm`` (the name map's, from ``post_attention_layernorm``). No o_proj or MLP biases (refused).
- Gemma RMSNorms scale by (1 + w); llama.cpp multiplies by the stored weight, so 1 is added to
  every ``*norm.weight`` (q/k norms included for Gemma 3).
- gemma/gemma2 always read the output projection from ``token_embd`` (tied); olmo2 requires an
  ``output`` tensor (written from the embeddings when the model is tied).
- gemma2/gemma3 scale queries by 1/sqrt(head_dim) (27B shapes aside), so ``query_pre_attn_scalar``
  must equal ``head_dim``; granite takes no ``head_dim`` other than hidden/heads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import gguf_moe_arch as moe
from . import gguf_qwen35 as qwen35
from . import gguf_qwen35moe as qwen35moe

logger = logging.getLogger(__name__)


def rope_settings(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """RoPE parameters from a transformers 5 (``rope_parameters``) or 4 (``rope_theta``/``rope_scaling``) config."""
    params = cfg.get("rope_parameters") or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    elif "full_attention" in params or "sliding_attention" in params:
        params = params.get("full_attention", {})
    out = dict(cfg.get("rope_scaling") or {})
    out.update(params)
    if "rope_theta" not in out:
        if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
            out["rope_theta"] = cfg["rope_local_base_freq"]
        else:
            out["rope_theta"] = cfg.get("rope_theta", 10000.0)
    out.setdefault("rope_type", out.get("type", "default"))
    return out


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order → GGML interleaved pairs, per head (weights [rows, cols] or biases [rows])."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _swa_pattern(cfg: dict[str, Any]) -> list[bool] | None:
    layer_types = cfg.get("layer_types")
    if not layer_types:
        return None
    return [t == "sliding_attention" for t in layer_types]


def _check_query_scale(cfg: dict[str, Any]) -> None:
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is not None and scalar != head_dim(cfg):
        logger.warning("query_pre_attn_scalar=%s differs from head_dim=%s: llama.cpp scales queries by "
                       "1/sqrt(head_dim) except for the 27B shapes; logits may differ", scalar, head_dim(cfg))


def _common(w, cfg: dict[str, Any], arch: str) -> None:
    n_head = cfg["num_attention_heads"]
    w.add_context_length(int(cfg.get("max_position_embeddings") or 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    if arch != "qwen35moe" or cfg.get("intermediate_size") is not None:  # Qwen3.5-MoE has no dense MLP (optional key)
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or n_head)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    hd = head_dim(cfg)
    if arch not in ("granite", "granitemoe"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    elif hd != cfg["hidden_size"] // n_head:
        raise ValueError(f"{arch} GGUF needs head_dim == hidden_size / num_attention_heads, got head_dim={hd}")
    rope = rope_settings(cfg)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    w.add_rope_dimension_count(int(hd * partial))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    _rope_scaling(w, cfg, rope, arch)


LLAMA3_ARCHS = ("llama", "exaone4")  # arches whose graph reads Llama 3's RoPE frequency factors (rope_freqs)


def _rope_kind(arch: str, rope: dict[str, Any]) -> str:
    """The config's RoPE type, or ValueError when llama.cpp's ``arch`` cannot be told it."""
    kind = str(rope.get("rope_type") or "default").lower()
    if not (kind in ("default", "linear", "yarn") or (kind == "mrope" and arch == "qwen2vl")
            or (kind == "llama3" and arch in LLAMA3_ARCHS) or (kind in ("longrope", "su") and arch == "phi3")):
        raise ValueError(f"RoPE type {kind!r} is not supported for GGUF arch {arch!r}")
    return kind


def _rope_scaling(w, cfg: dict[str, Any], rope: dict[str, Any], arch: str) -> None:
    import gguf

    kind = _rope_kind(arch, rope)
    if kind == "default" or (kind == "mrope" and arch == "qwen2vl"):  # older Qwen2-VL configs name it "mrope"
        return
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                            or cfg.get("original_max_position_embeddings")))
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
            if rope.get(key) is not None:
                add(float(rope[key]))
    # llama3 (llama): the rope_freqs tensor; longrope (phi3): rope_factors_long/short (extra_tensors)


def _meta_llama(w, cfg):
    if cfg.get("sliding_window") and cfg["sliding_window"] < int(cfg.get("max_position_embeddings") or 0):
        logger.warning("llama.cpp's llama graph has no sliding window: attention beyond %d tokens differs",
                       cfg["sliding_window"])


def _meta_gemma2(w, cfg):
    _check_query_scale(cfg)
    w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"] or 0.0))
    w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"] or 0.0))
    w.add_sliding_window(int(cfg["sliding_window"]))
    if (pattern := _swa_pattern(cfg)) is not None:
        w.add_sliding_window_pattern(pattern)


def _meta_gemma3(w, cfg):
    _check_query_scale(cfg)
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("gemma3 GGUF has no attention soft-cap; attn_logit_softcapping must be None")
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
        if (pattern := _swa_pattern(cfg)) is not None:
            w.add_sliding_window_pattern(pattern)
        w.add_rope_freq_base_swa(float(rope_settings(cfg, "sliding_attention")["rope_theta"]))


def _meta_phi3(w, cfg):
    rope = rope_settings(cfg)
    orig = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    w.add_rope_scaling_orig_ctx_len(int(orig))
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    if (factor := phi3_attn_factor(cfg)) is not None:
        w.add_rope_scaling_attn_factors(factor)


def _meta_granite(w, cfg):
    for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
        if cfg.get(key) is not None:
            add(float(cfg[key]))


def _meta_olmo2(w, cfg):
    if cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
        if (pattern := _swa_pattern(cfg)) is not None:
            w.add_sliding_window_pattern(pattern)


def _meta_exaone4(w, cfg):
    if cfg.get("sliding_window") is not None:
        w.add_sliding_window(int(cfg["sliding_window"]))
        if (pattern := _swa_pattern(cfg)) is not None:
            w.add_sliding_window_pattern(pattern)


def _meta_qwen2vl(w, cfg):
    """Qwen2-VL's 3-D RoPE: the frequency pairs split into temporal/height/width sections (llama.cpp
    takes four, the last one 0); text-only positions rotate every section alike, as Qwen2 does."""
    sections = list(rope_settings(cfg).get("mrope_section") or [])
    if not sections or len(sections) > 4 or sum(sections) != head_dim(cfg) // 2:
        raise ValueError(f"qwen2vl GGUF needs rope mrope_section (at most 4 parts summing to head_dim/2="
                         f"{head_dim(cfg) // 2}), got {sections or None}")
    if rope_settings(cfg).get("mrope_interleaved"):
        raise ValueError("qwen2vl GGUF: an interleaved mrope_section (Qwen3-VL's layout) is not llama.cpp's qwen2vl")
    w.add_rope_dimension_sections([int(s) for s in sections] + [0] * (4 - len(sections)))


def _meta_none(w, cfg):
    return None


def _meta_qwen35(w, cfg):
    qwen35.metadata(w, cfg, rope_settings(cfg))


def _meta_qwen35moe(w, cfg):
    _meta_qwen35(w, cfg)
    qwen35moe.metadata(w, cfg)


def _meta_llama_moe(w, cfg):
    _meta_llama(w, cfg)
    moe.meta_experts(w, cfg)


def _meta_granitemoe(w, cfg):
    _meta_granite(w, cfg)
    moe.meta_experts(w, cfg)


SMOLLM3_NOPE_STEP = 4  # llama.cpp's SmolLM3 graph: no RoPE in layers il with (il + 1) % 4 == 0


def _check_smollm3(cfg: dict[str, Any]) -> None:
    layers = cfg["num_hidden_layers"]
    want = [int((il + 1) % SMOLLM3_NOPE_STEP != 0) for il in range(layers)]
    got = [int(bool(x)) for x in (cfg.get("no_rope_layers") or [1] * layers)]
    if got != want:
        raise ValueError(f"smollm3 GGUF: llama.cpp applies RoPE to layers {want} (1 = RoPE: every "
                         f"{SMOLLM3_NOPE_STEP}th layer without), this config's no_rope_layers is {got}")


EXAONE4_SWA_LAYERS = 64  # llama.cpp runs EXAONE 4's sliding-window graph for 64-layer models (EXAONE 4.0 32B) only


def _check_exaone4(cfg: dict[str, Any]) -> None:
    """llama.cpp's exaone4 graph: sliding-window layers rotate and the others are NoPE, but only in a 64-layer
    model (whose window and per-layer pattern it then reads from the file); any other depth runs every layer
    rotated with full attention. transformers rotates only the sliding layers wherever ``sliding_window`` is set."""
    layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if window is not None and layers != EXAONE4_SWA_LAYERS:
        raise ValueError(
            f"exaone4 GGUF: this config has sliding_window={window}, so transformers runs its sliding_attention "
            f"layers with that window and its full_attention layers without RoPE; llama.cpp's EXAONE 4 graph does so "
            f"only for {EXAONE4_SWA_LAYERS}-layer models and runs these {layers} layers all rotated with full "
            "attention. Only a config without a sliding window (every layer rotated, full attention) converts at "
            "this depth")
    if window is None and layers == EXAONE4_SWA_LAYERS:
        raise ValueError(
            f"exaone4 GGUF: llama.cpp gives every {EXAONE4_SWA_LAYERS}-layer EXAONE 4 the 32B's sliding window (4096 "
            "tokens on three layers of four, the fourth without RoPE), and this config has no sliding window "
            "(every layer rotated, full attention in transformers)")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ValueError(f"exaone4 GGUF: llama.cpp's EXAONE 4 loader needs num_attention_heads * head_dim == "
                         f"hidden_size (its output projection is square), got {cfg['num_attention_heads']} * "
                         f"{head_dim} != {cfg['hidden_size']}")
    if str(cfg.get("hidden_act")) not in ("silu", "swish"):
        raise ValueError(f"exaone4 GGUF: llama.cpp's EXAONE 4 graph has a SiLU-gated MLP, this config's hidden_act "
                         f"is {cfg.get('hidden_act')!r}")
    partial = rope_settings(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"exaone4 GGUF: llama.cpp's EXAONE 4 graph rotates whole heads, this config's "
                         f"partial_rotary_factor is {partial}")


def _check_seed_oss(cfg: dict[str, Any]) -> None:
    """llama.cpp's seed_oss loader reads q/k/v biases but no o_proj or MLP bias tensor (a file with one fails to
    load), and its graph rotates whole heads."""
    for key, what in (("attention_out_bias", "o_proj bias"), ("mlp_bias", "MLP projection biases")):
        if cfg.get(key):
            raise ValueError(f"seed_oss GGUF: llama.cpp's Seed-OSS graph has no {what} ({key}=True; the released "
                             "Seed-OSS models have none)")
    partial = rope_settings(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"seed_oss GGUF: llama.cpp's Seed-OSS graph rotates whole heads, this config's "
                         f"partial_rotary_factor is {partial}")


def check_config(arch: str, cfg: dict[str, Any], approximate_yarn: bool = False) -> None:
    """ValueError for a config the arch's llama.cpp graph cannot represent (before any tensor is read).

    ggml's YaRN always rounds the correction range outwards (floor/ceil: transformers'
    ``truncate=True``); a config with ``truncate=False`` (gpt-oss) gets other frequencies on the
    dimensions inside that range, so it is refused unless ``approximate_yarn`` accepts the difference."""
    _rope_kind(arch, rope_settings(cfg))  # a RoPE scaling llama.cpp cannot be told, before any tensor is read
    if arch == "smollm3":
        _check_smollm3(cfg)
    if arch == "exaone4":
        _check_exaone4(cfg)
    if arch == "seed_oss":
        _check_seed_oss(cfg)
    if arch in qwen35.ARCHS:
        qwen35.check_config(cfg)
    if arch == "qwen35moe":
        qwen35moe.check_config(cfg)
    if arch == "ernie4_5" and cfg.get("use_bias"):
        raise ValueError("ernie4_5 GGUF: llama.cpp's ERNIE 4.5 graph has no projection biases (use_bias=True; "
                         "the released ERNIE 4.5 models have none)")
    rope = rope_settings(cfg)
    if str(rope.get("rope_type") or "").lower() == "yarn" and rope.get("truncate") is False:
        if not approximate_yarn:
            raise ValueError(
                "this config's YaRN RoPE has truncate=False, and llama.cpp (ggml) always truncates the YaRN "
                "correction range: some RoPE frequencies differ (gpt-oss-20b/120b: 9 of 32, by up to 43%), so "
                "llama.cpp's logits would drift from transformers' as positions grow. llama.cpp's own converter "
                "writes such files anyway; pass approximate_yarn=True to accept the difference")
        logger.warning("GGUF: YaRN truncate=False written as llama.cpp's truncated YaRN (approximate_yarn=True): "
                       "logits differ from transformers' at long positions")
    moe.check_config(arch, cfg)


@dataclass(frozen=True)
class ArchSpec:
    """What differs between GGUF architectures.

    Attributes:
        name: GGUF ``general.architecture``.
        permute_qk: reorder q/k rows from HF rotate-half to GGML interleaved pairs.
        norm_shift: added to every ``*norm.weight`` tensor.
        output: "optional" (``output`` written when the model has its own lm_head), "never"
            (llama.cpp reads token_embd; an untied lm_head cannot be represented), "required".
        metadata: writes the arch-specific keys.
    """

    name: str
    permute_qk: bool = False
    norm_shift: float = 0.0
    output: str = "optional"
    metadata: Callable = _meta_none


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", permute_qk=True, metadata=_meta_llama_moe),  # Mixtral's experts too
    "granite": ArchSpec("granite", permute_qk=True, metadata=_meta_granite),
    "qwen2": ArchSpec("qwen2"),
    "qwen3": ArchSpec("qwen3"),
    "qwen2vl": ArchSpec("qwen2vl", metadata=_meta_qwen2vl),  # the language tower of Qwen2-VL / 2.5-VL
    "qwen3moe": ArchSpec("qwen3moe", metadata=moe.meta_qwen3moe),
    "gpt-oss": ArchSpec("gpt-oss", metadata=moe.meta_gpt_oss),
    "olmoe": ArchSpec("olmoe", output="required", metadata=moe.meta_olmoe),
    "granitemoe": ArchSpec("granitemoe", permute_qk=True, metadata=_meta_granitemoe),
    "glm4moe": ArchSpec("glm4moe", metadata=moe.meta_glm4moe),
    "qwen2moe": ArchSpec("qwen2moe", output="required", metadata=moe.meta_qwen2moe),  # shared gate: as qwen35moe
    "gemma": ArchSpec("gemma", norm_shift=1.0, output="never"),
    "gemma2": ArchSpec("gemma2", norm_shift=1.0, output="never", metadata=_meta_gemma2),
    "gemma3": ArchSpec("gemma3", norm_shift=1.0, metadata=_meta_gemma3),
    "phi3": ArchSpec("phi3", metadata=_meta_phi3),
    "olmo2": ArchSpec("olmo2", output="required", metadata=_meta_olmo2),  # OLMo 3 too (its sliding layers)
    "smollm3": ArchSpec("smollm3", permute_qk=True),
    "glm4": ArchSpec("glm4"),  # post-attention / post-MLP norms, fused gate_up, partial interleaved RoPE
    "ernie4_5": ArchSpec("ernie4_5"),
    "hunyuan-dense": ArchSpec("hunyuan-dense"),  # q/k norms after RoPE (attn_q_norm / attn_k_norm)
    "seed_oss": ArchSpec("seed_oss"),  # Llama's layer, NEOX RoPE, q/k/v biases; the MLP's norm is attn_post_norm
    "exaone4": ArchSpec("exaone4", metadata=_meta_exaone4),  # post-norms, q/k norms, NoPE full layers with a window
    "qwen35": ArchSpec("qwen35", norm_shift=1.0, metadata=_meta_qwen35),  # gguf_qwen35.py
    "qwen35moe": ArchSpec("qwen35moe", norm_shift=1.0, metadata=_meta_qwen35moe),  # gguf_qwen35moe.py
}


# Arches whose shared expert's sigmoid gate (HF ``shared_expert_gate`` [1, H]) llama.cpp reads as a vector of n_embd.
SHARED_GATE_ARCHS = ("qwen35moe", "qwen2moe")


def write_arch_metadata(writer, cfg: dict[str, Any], arch: str) -> None:
    """Writes the hyper-parameters llama.cpp reads for ``arch``."""
    _common(writer, cfg, arch)
    ARCHS[arch].metadata(writer, cfg)


def transform(arch: str, hf_name: str, data: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """The arch's tensor transform of one HF tensor (same shape)."""
    spec = ARCHS[arch]
    if spec.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        data = permute_rows(data, cfg["num_attention_heads"])
    elif spec.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        data = permute_rows(data, cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    if spec.norm_shift and hf_name.endswith("norm.weight") and not (arch in qwen35.ARCHS
                                                                     and hf_name.endswith(qwen35.PLAIN_NORM)):
        data = data + np.float32(spec.norm_shift)
    if arch in qwen35.ARCHS:
        data = qwen35.transform(hf_name, data, cfg)
    return qwen35moe.transform(hf_name, data) if arch in SHARED_GATE_ARCHS else data


def tensor_key(arch: str, hf_name: str) -> str:
    """The key the name map knows for ``hf_name`` (llama.cpp's names for the same tensor)."""
    key = moe.name_map_key(hf_name)
    return qwen35.name_key(key) if arch in qwen35.ARCHS else key


def tensor_shape(arch: str, hf_name: str, hf_shape) -> tuple:
    """The GGUF tensor's shape (row-major, as transformers'), after ``transform``."""
    if arch in SHARED_GATE_ARCHS:
        hf_shape = qwen35moe.shape(hf_name, hf_shape)
    return qwen35.shape(hf_name, hf_shape) if arch in qwen35.ARCHS else tuple(hf_shape)


def tensor_name(arch: str, mapped: str) -> str:
    """The GGUF name of a mapped key (llama.cpp reads Qwen3.5's ``ssm_a`` without a suffix)."""
    if arch in qwen35.ARCHS and mapped.endswith(".ssm_a"):
        return mapped
    return moe.gguf_tensor_name(mapped)


def extra_tensors(arch: str, cfg: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Tensors llama.cpp needs that the checkpoint does not hold (RoPE frequency factors)."""
    rope = rope_settings(cfg)
    kind = str(rope.get("rope_type") or "default").lower()
    if arch in LLAMA3_ARCHS and kind == "llama3":
        hd = head_dim(cfg)
        freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        factor = float(rope.get("factor", 8.0))
        low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
        old_ctx = float(rope.get("original_max_position_embeddings", 8192))
        factors = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old_ctx / high:
                factors.append(1.0)
            elif wavelen > old_ctx / low:
                factors.append(factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                factors.append(1.0 / ((1 - smooth) / factor + smooth))
        return [("rope_freqs.weight", np.asarray(factors, dtype=np.float32))]
    if arch == "phi3" and kind in ("longrope", "su"):
        return [("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)),
                ("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))]
    return []


def phi3_attn_factor(cfg: dict[str, Any]) -> float | None:
    """LongRoPE attention factor for phi3 (None without long-context scaling)."""
    rope = rope_settings(cfg)
    if str(rope.get("rope_type") or "").lower() not in ("longrope", "su"):
        return None
    orig = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / orig
    return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
