"""``fasttune doctor``: what this machine has, and what fasttune will do on it.

Reports library versions (against the ranges fasttune supports), the GPU (name and memory, or
"none"), where each kernel runs here (Triton on CUDA, Triton's interpreter when TRITON_INTERPRET
is set, else the plain-PyTorch reference), and a dry patch of a tiny randomly initialised model of
every supported family (plus one with LoRA adapters), listing what was patched and what would fall
back to the stock path, with the reason. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

# distribution → (import-free display name, minimum version fasttune supports or None)
PACKAGES = (
    ("torch", "2.6"), ("triton", "3.4"), ("transformers", "5.0"), ("peft", "0.17"), ("trl", "1.0"),
    ("accelerate", "1.10"), ("datasets", "3.0"), ("huggingface_hub", "1.0"), ("bitsandbytes", "0.45"),
    ("gguf", "0.17"), ("llama-cpp-python", "0.3.30"), ("gradio", "5.0"),
)
KERNELS = {
    "cross_entropy": "fused linear cross-entropy (loss head)",
    "logprobs": "fused log-probabilities (TRL DPO/GRPO heads)",
    "rms_norm": "RMSNorm",
    "rope": "rotary embedding",
    "swiglu": "SwiGLU / GeGLU",
    "lora": "fused LoRA linear / MLP / QKV",
    "nf4": "NF4 dequantisation (QLoRA)",
}
# Tiny configs for the dry patch: small enough that building all families takes about a second.
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
_TINY_EXTRA = {"gemma2": dict(query_pre_attn_scalar=16), "gemma3_text": dict(query_pre_attn_scalar=16),
               "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
               "olmo2": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
               "smollm3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
               "glm4": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def versions() -> list[dict[str, Any]]:
    """[{name, version or None, minimum, ok}] without importing the packages."""
    rows = [{"name": "python", "version": platform.python_version(), "minimum": "3.10",
             "ok": sys.version_info >= (3, 10)}]
    for dist, minimum in PACKAGES:
        try:
            v = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v = None
        ok = None if v is None else _version_tuple(v) >= _version_tuple(minimum)
        rows.append({"name": dist, "version": v, "minimum": minimum, "ok": ok})
    return rows


def gpu() -> dict[str, Any]:
    """{"name", "memory_gib", "capability", "count"} of CUDA device 0, or {"name": "none"}."""
    import torch

    if not torch.cuda.is_available():
        return {"name": "none", "count": 0}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count(),
            "bf16": torch.cuda.is_bf16_supported()}


def kernel_backends() -> dict[str, str]:
    """Kernel → where it runs on this machine ("triton", "triton-interpreter" or "reference")."""
    import torch

    from .kernels._backend import triton_importable, use_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe = torch.empty(1, device=device)
    if use_triton(probe):
        where = "triton" if device == "cuda" else "triton-interpreter"
    else:
        why = "Triton not importable" if not triton_importable() else "no CUDA device"
        where = f"reference ({why})"
    return {name: where for name in KERNELS}


# Vision-language rows: a tiny language tower (_TINY) and a tiny vision tower.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16
_TINY_VLM = {
    "qwen2_5_vl": dict(text_config=dict(_TINY, rope_parameters=_MROPE), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0])),
    "qwen2_vl": dict(text_config=dict(_TINY, rope_parameters=_MROPE), vision_config=dict(
        depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2)),
    "gemma3": dict(text_config=dict(_TINY, query_pre_attn_scalar=16), mm_tokens_per_image=4, vision_config=dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, image_size=28, patch_size=7)),
}


def _tiny_model(model_type: str, lora: bool = False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = model_type in _TINY_VLM
    kwargs = _TINY_VLM[model_type] if vlm else dict(_TINY, **_TINY_EXTRA.get(model_type, {}))
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    return model


def dry_patch() -> list[dict[str, Any]]:
    """Patches a tiny model of each family (and a LoRA one); what was patched and what fell back."""
    from .config import FastConfig
    from .model_patches import FAMILIES, patch_model, unpatch_model

    rows = []
    cases = [(t, False) for t in FAMILIES] + [("llama", True)]
    for model_type, lora in cases:
        label = model_type + (" + LoRA" if lora else "")
        try:
            model = _tiny_model(model_type, lora)
            report = patch_model(model, FastConfig())
            reasons = sorted({f"{f.op}: {f.reason}" for f in report.fallbacks})
            rows.append({"family": label, "patched": dict(sorted(report.patched.items())), "fallbacks": reasons})
            unpatch_model(model)
        except Exception as e:  # noqa: BLE001 - a family this transformers cannot build is itself a finding
            rows.append({"family": label, "patched": {}, "fallbacks": [f"could not build: {type(e).__name__}: {e}"]})
    return rows


def collect(dry: bool = True) -> dict[str, Any]:
    """Everything ``fasttune doctor`` prints, as a dict (``--json``)."""
    import logging
    import warnings

    from .model_patches import FAMILIES

    info: dict[str, Any] = {"platform": platform.platform(), "versions": versions(), "gpu": gpu(),
                            "kernels": kernel_backends(), "families": sorted(FAMILIES)}
    if dry:
        quiet = logging.getLogger("fasttune")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the rows below say it all; no per-family log lines
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                info["dry_patch"] = dry_patch()
        finally:
            quiet.setLevel(level)
    return info


def format_report(info: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = ["fasttune doctor", "", "versions:"]
    for row in info["versions"]:
        v = row["version"] or "not installed"
        flag = "" if row["ok"] in (True, None) else f"  (fasttune needs >= {row['minimum']})"
        lines.append(f"  {row['name']:<18} {v}{flag}")
    g = info["gpu"]
    gpu_text = "none" if g["name"] == "none" else (
        f"{g['name']}, {g['memory_gib']} GiB, compute capability {g['capability']}, {g['count']} device(s)")
    lines += ["", f"GPU: {gpu_text}", "", "kernels on this machine:"]
    for name, where in info["kernels"].items():
        lines.append(f"  {name:<14} {where:<28} {KERNELS[name]}")
    lines += ["", "supported families: " + ", ".join(info["families"])]
    if "dry_patch" in info:
        lines += ["", "dry patch of a tiny model per family:"]
        for row in info["dry_patch"]:
            patched = ", ".join(f"{k} x{v}" for k, v in row["patched"].items()) or "nothing patched"
            lines.append(f"  {row['family']:<14} {patched}")
            lines += [f"  {'':<14}   falls back: {r}" for r in row["fallbacks"]]
    return "\n".join(lines)
