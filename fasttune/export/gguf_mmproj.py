"""The vision half of a vision-language model's GGUF: llama.cpp's ``mmproj`` file (its "clip" format).

llama.cpp runs a VLM from two files: the language model as its text architecture (``qwen2vl``,
``gemma3``) and ``mmproj-<name>-<TYPE>.gguf`` holding the vision tower and the projector, read by
``libmtmd``. Learned from llama.cpp's converter (``MmprojModel`` and its Qwen2-VL / Gemma 3
subclasses) and loader (``tools/mtmd/clip.cpp``), not copied from them. What the loader assumes,
and so what is checked here before anything is written:

- Qwen2-VL / 2.5-VL: the Conv3d patch embedding of a still image (the frame repeated over the 2
  temporal steps) is two 2-D kernels summed (``v.patch_embd.weight`` and ``.weight.1``); the
  merger is 2x2 (``spatial_merge_size`` 2) and its LayerNorm/RMSNorm is ``v.post_ln``; fused qkv
  rows are split into q, k, v. 2.5-VL's window attention is a pattern (every n-th block full) over
  112-pixel windows, and its MLP is gated SiLU. The vision RoPE (theta 10000) is built in.
- Gemma 3: SigLIP with learned positions; the 2-D average pool's kernel is
  ``proj_scale_factor`` (written when it is not llama.cpp's default 4); the soft-embedding RMSNorm
  scales by (1 + w), so 1 is added to its weight; the input projection stays [vision, text].
- The loader swaps ffn up/down when the down projection's input width equals the embedding width
  (old files), so a tower whose ``intermediate_size`` equals its ``hidden_size`` is refused.

The file is F16 (norms, biases and position embeddings F32) or F32, llama.cpp's convention for
mmproj files, whatever the text model's type.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .merged_weights import WeightEntry

logger = logging.getLogger(__name__)

SUPPORTED = ("qwen2vl_merger", "qwen2.5vl_merger", "gemma3")
# Image normalisation of the stock processors, used when no processor says otherwise.
_DEFAULT_NORM = {"qwen2vl_merger": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
                 "qwen2.5vl_merger": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
                 "gemma3": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])}
_ACT = {"qwen2vl_merger": "quick_gelu", "qwen2.5vl_merger": "silu", "gemma3": "gelu_pytorch_tanh"}
_QWEN_WINDOW = 112  # pixels; llama.cpp's Qwen2.5-VL window attention is built for this size
_GEMMA_DEFAULT_POOL = 4


def mmproj_filename(name: str, quant: str) -> str:
    """``mmproj-<name>-<TYPE>.gguf`` (llama.cpp's and the Hub's convention)."""
    return f"mmproj-{name}-{quant.upper()}.gguf"


def is_mmproj(path: str | Path) -> bool:
    return Path(path).name.startswith("mmproj-")


def mmproj_quant(quants: list[str]) -> str:
    """The mmproj file's type: F32 when F32 was asked for, else F16 (the clip loader's usual type)."""
    return "f32" if "f32" in quants else "f16"


@dataclass
class VisionSplit:
    """A VLM's checkpoint cut in two: the language model as a text model, and the vision side."""

    projector: str                     # llama.cpp projector type
    text_cfg: dict[str, Any]
    text_entries: list[WeightEntry]
    vision_cfg: dict[str, Any]
    vision_entries: list[WeightEntry]
    n_embd_text: int
    mm_tokens_per_image: int | None = None


# The Hub's original checkpoints, and transformers 5's own save_pretrained, use the older key layout
# (transformers maps it on load), so a folder read directly is mapped the same way here.
_LEGACY = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
           ("vision_tower.vision_model.", "model.vision_tower."), ("vision_tower.", "model.vision_tower."),
           ("multi_modal_projector.", "model.multi_modal_projector."), ("visual.", "model.visual."))
_CURRENT = ("model.language_model.", "model.visual.", "model.vision_tower.", "model.multi_modal_projector.")


def current_name(name: str) -> str:
    """A VLM checkpoint key in transformers 5's layout (``model.language_model.*``, ``model.visual.*``, ...)."""
    for old, new in _LEGACY:
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith("model.") and not name.startswith(_CURRENT):  # Qwen2-VL's language model at model.*
        return "model.language_model." + name[len("model."):]
    return name


def split_vlm(vision, cfg: dict[str, Any], entries: list[WeightEntry]) -> VisionSplit:
    """``vision``: the family's ``VisionLayout``. Language tensors are renamed to a text model's
    (``model.language_model.x`` → ``model.x``); ValueError for a tensor of neither tower."""
    lang, tower, proj = vision.language_model + ".", vision.vision_tower + ".", vision.projector + "."
    entries = [WeightEntry(current_name(e.name), e.shape, e.load) for e in entries]
    text_cfg = dict(cfg.get("text_config") or {})
    if not text_cfg:
        raise ValueError(f"GGUF export of {cfg.get('model_type')!r}: the config has no text_config")
    for key in ("tie_word_embeddings", "vocab_size"):
        if key not in text_cfg and key in cfg:
            text_cfg[key] = cfg[key]
    text, seen = [], []
    for e in entries:
        if e.name.startswith(lang):
            text.append(WeightEntry("model." + e.name[len(lang):], e.shape, e.load))
        elif e.name == "lm_head.weight":
            text.append(e)
        elif e.name.startswith((tower, proj)):
            seen.append(e)
        else:
            raise ValueError(f"GGUF export of {cfg.get('model_type')!r}: tensor {e.name!r} belongs to neither "
                             f"{vision.language_model} nor {vision.vision_tower}/{vision.projector}")
    split = VisionSplit(vision.mmproj_type, text_cfg, text, dict(cfg.get("vision_config") or {}), seen,
                        int(text_cfg["hidden_size"]), cfg.get("mm_tokens_per_image"))
    check_vision(split)
    return split


def _vision_dims(split: VisionSplit) -> dict[str, int]:
    v = split.vision_cfg
    if split.projector == "qwen2vl_merger":  # embed_dim is the tower's width, hidden_size the merger's output
        return dict(n_embd=v["embed_dim"], n_ff=int(v["embed_dim"] * v["mlp_ratio"]), n_layer=v["depth"],
                    n_head=v["num_heads"], out=v["hidden_size"])
    if split.projector == "qwen2.5vl_merger":
        return dict(n_embd=v["hidden_size"], n_ff=v["intermediate_size"], n_layer=v["depth"],
                    n_head=v["num_heads"], out=v["out_hidden_size"])
    return dict(n_embd=v["hidden_size"], n_ff=v["intermediate_size"], n_layer=v["num_hidden_layers"],
                n_head=v["num_attention_heads"], out=split.n_embd_text)


def check_vision(split: VisionSplit) -> None:
    """ValueError naming what llama.cpp's clip loader cannot run (before any file is opened)."""
    p, v = split.projector, split.vision_cfg
    if p not in SUPPORTED:
        raise ValueError(f"mmproj GGUF: projector type {p!r} is not written by fasttune (supported: {SUPPORTED})")
    d = _vision_dims(split)
    missing = []
    if v.get("hidden_act") != _ACT[p]:
        missing.append(f"vision hidden_act {_ACT[p]!r} (llama.cpp's {p} graph), got {v.get('hidden_act')!r}")
    if d["out"] != split.n_embd_text:
        missing.append(f"a projector output width equal to the text hidden_size {split.n_embd_text}, got {d['out']}")
    if d["n_ff"] == d["n_embd"]:
        missing.append(f"vision intermediate_size != hidden_size ({d['n_ff']}): llama.cpp's loader would read "
                       "ffn_up/ffn_down as swapped")
    if d["n_embd"] % d["n_head"]:
        missing.append(f"vision hidden size {d['n_embd']} divisible by {d['n_head']} heads")
    if p != "gemma3":
        if v.get("spatial_merge_size") != 2 or v.get("temporal_patch_size") != 2:
            missing.append(f"spatial_merge_size 2 and temporal_patch_size 2 (llama.cpp's merger and patch split), "
                           f"got {v.get('spatial_merge_size')} and {v.get('temporal_patch_size')}")
        if (d["n_embd"] // d["n_head"]) % 4:
            missing.append(f"a vision head_dim divisible by 4 (2-D RoPE sections), got {d['n_embd'] // d['n_head']}")
    if p == "qwen2.5vl_merger":
        if v.get("window_size") != _QWEN_WINDOW:
            missing.append(f"window_size {_QWEN_WINDOW} (llama.cpp's fixed attention window), got {v.get('window_size')}")
        try:
            wa_pattern(v)
        except ValueError as e:
            missing.append(str(e))
    if p == "gemma3":
        try:
            gemma3_pool(v, split.mm_tokens_per_image)
        except ValueError as e:
            missing.append(str(e))
    if missing:
        raise ValueError(f"mmproj GGUF ({p}): llama.cpp's clip loader needs " + "; ".join(missing))


def wa_pattern(v: dict[str, Any]) -> int:
    """llama.cpp's ``n_wa_pattern``: every n-th block (n, 2n, ...) attends fully, the others in windows."""
    full = list(v.get("fullatt_block_indexes") or [])
    n = full[0] + 1 if full else 0
    if not n or full != [i for i in range(v["depth"]) if (i + 1) % n == 0]:
        raise ValueError(f"fullatt_block_indexes every n-th block (n-1, 2n-1, ...), got {full}")
    return n


def gemma3_pool(v: dict[str, Any], tokens: int | None) -> int:
    """Gemma 3's average-pool kernel: patches per side / image tokens per side."""
    side = v["image_size"] // v["patch_size"]
    per_side = int(round((tokens or 0) ** 0.5))
    if v["image_size"] % v["patch_size"] or not per_side or per_side ** 2 != tokens or side % per_side:
        raise ValueError(f"image_size/patch_size ({v['image_size']}/{v['patch_size']}) patches per side divisible "
                         f"by sqrt(mm_tokens_per_image={tokens})")
    return side // per_side


@dataclass
class MmTensor:
    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]  # fp32 numpy


def _np(e: WeightEntry, take=lambda t: t) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(take(e.load().detach().to("cpu", torch.float32)).numpy())


_QWEN_BLOCK = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_QWEN_TOP = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2"}
_SIGLIP_BLOCK = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out",
                 "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
_SIGLIP_TOP = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
               "post_layernorm": "v.post_ln"}


def _qwen(e: WeightEntry, local: str) -> list[MmTensor]:
    if local == "patch_embed.proj.weight":  # [E, C, T=2, P, P]: one 2-D kernel per temporal step
        shape = e.shape[:2] + e.shape[3:]
        return [MmTensor("v.patch_embd.weight", shape, _np(e, lambda t: t[:, :, 0])),
                MmTensor("v.patch_embd.weight.1", shape, _np(e, lambda t: t[:, :, 1]))]
    stem, kind = local.rsplit(".", 1)
    if stem.startswith("blocks."):
        _, bid, part = stem.split(".", 2)
        if part == "attn.qkv":  # q, k, v rows stacked
            rows = e.shape[0] // 3
            return [MmTensor(f"v.blk.{bid}.attn_{x}.{kind}", (rows,) + e.shape[1:],
                             _np(e, lambda t, i=i: t[i * rows:(i + 1) * rows])) for i, x in enumerate("qkv")]
        if part in _QWEN_BLOCK:
            return [MmTensor(f"v.blk.{bid}.{_QWEN_BLOCK[part]}.{kind}", e.shape, _np(e))]
    elif stem in _QWEN_TOP:
        return [MmTensor(f"{_QWEN_TOP[stem]}.{kind}", e.shape, _np(e))]
    return []


def _gemma3(e: WeightEntry, local: str) -> list[MmTensor]:
    if local == "mm_input_projection_weight":  # [vision, text]; llama.cpp transposes it in the graph
        return [MmTensor("mm.input_projection.weight", e.shape, _np(e))]
    if local == "mm_soft_emb_norm.weight":  # Gemma RMSNorm scales by (1 + w)
        return [MmTensor("mm.soft_emb_norm.weight", e.shape, _np(e, lambda t: t + 1.0))]
    if local.startswith("head."):  # SigLIP's pooling head: Gemma 3 does not use it
        return []
    stem, kind = local.rsplit(".", 1)
    if stem.startswith("encoder.layers."):
        _, _, bid, part = stem.split(".", 3)
        if part in _SIGLIP_BLOCK:
            return [MmTensor(f"v.blk.{bid}.{_SIGLIP_BLOCK[part]}.{kind}", e.shape, _np(e))]
    elif stem in _SIGLIP_TOP:
        return [MmTensor(f"{_SIGLIP_TOP[stem]}.{kind}", e.shape, _np(e))]
    return []


def mmproj_tensors(split: VisionSplit, vision) -> list[MmTensor]:
    """The clip file's tensors, in checkpoint order; ValueError for a vision tensor with no clip name."""
    out = []
    for e in split.vision_entries:
        if split.projector == "gemma3":
            base = vision.projector + "." if e.name.startswith(vision.projector + ".") else vision.vision_tower + "."
            made = _gemma3(e, e.name[len(base):])
        else:
            made = _qwen(e, e.name[len(vision.vision_tower) + 1:])
        if not made and not e.name.startswith(vision.vision_tower + ".head."):
            raise ValueError(f"mmproj GGUF ({split.projector}): no llama.cpp tensor for {e.name!r}")
        out.extend(made)
    return out


def image_norm(processor, projector: str, folder: str | Path | None = None) -> tuple[list[float], list[float]]:
    """(image_mean, image_std) of ``processor`` (or of a saved folder's processor config), else the stock ones."""
    ip = getattr(processor, "image_processor", processor)
    mean, std = getattr(ip, "image_mean", None), getattr(ip, "image_std", None)
    if (mean is None or std is None) and folder is not None:
        for file in ("preprocessor_config.json", "processor_config.json"):
            try:
                data = json.loads((Path(folder) / file).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            data = data.get("image_processor", data)
            mean, std = data.get("image_mean"), data.get("image_std")
            if mean is not None and std is not None:
                break
    if mean is None or std is None:
        mean, std = _DEFAULT_NORM[projector]
        logger.warning("mmproj GGUF: no image processor given; writing the stock %s image mean/std %s / %s",
                       projector, mean, std)
    return [float(x) for x in mean], [float(x) for x in std]


def _tensor_type(quant: str, t: MmTensor):
    import gguf

    # norms, biases and the (small) patch/position embeddings stay F32, as llama.cpp's converter keeps Gemma's
    if quant == "f32" or len(t.shape) <= 1 or t.name.startswith(("v.position_embd", "v.patch_embd")):
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType.F16


def open_mmproj_writer(path: Path, split: VisionSplit, quant: str, tensors: list[MmTensor], name: str,
                       mean: list[float], std: list[float]):
    """A GGUFWriter on ``path`` with the clip header, hyper-parameters and tensor infos written;
    returns it and the tensor types (in ``tensors`` order)."""
    import gguf

    v, d = split.vision_cfg, _vision_dims(split)
    w = gguf.GGUFWriter(path=None, arch="clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(split.projector)
    w.add_vision_projection_dim(split.n_embd_text)
    w.add_vision_image_size(int(v.get("image_size") or 560))  # Qwen: warm-up size only (dynamic resolution)
    w.add_vision_patch_size(int(v["patch_size"]))
    w.add_vision_embedding_length(d["n_embd"])
    w.add_vision_feed_forward_length(d["n_ff"])
    w.add_vision_block_count(d["n_layer"])
    w.add_vision_head_count(d["n_head"])
    w.add_vision_image_mean(mean)
    w.add_vision_image_std(std)
    if split.projector == "gemma3":
        w.add_vision_attention_layernorm_eps(float(v.get("layer_norm_eps", 1e-6)))
        w.add_vision_use_gelu(True)
        pool = gemma3_pool(v, split.mm_tokens_per_image)
        if pool != _GEMMA_DEFAULT_POOL:
            w.add_vision_projector_scale_factor(pool)
    else:
        w.add_vision_attention_layernorm_eps(1e-6)  # transformers hard-codes the Qwen vision norms' eps
        w.add_vision_spatial_merge_size(int(v["spatial_merge_size"]))
        if split.projector == "qwen2.5vl_merger":
            w.add_vision_use_silu(True)
            w.add_vision_n_wa_pattern(wa_pattern(v))
    types = []
    for t in tensors:
        qtype = _tensor_type(quant, t)
        dtype = np.dtype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
        w.add_tensor_info(t.name, t.shape, dtype, int(np.prod(t.shape)) * dtype.itemsize)
        types.append(dtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w, types


def write_mmproj(path: Path, split: VisionSplit, vision, quant: str, name: str, mean, std) -> None:
    """Writes the whole mmproj file at ``path`` (the caller makes it atomic)."""
    tensors = mmproj_tensors(split, vision)
    w, types = open_mmproj_writer(path, split, quant, tensors, name, mean, std)
    try:
        with torch.no_grad():
            for t, dtype in zip(tensors, types):
                w.write_tensor_data(np.ascontiguousarray(t.load(), dtype=dtype))
    finally:
        w.close()
