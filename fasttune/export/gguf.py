"""GGUF export in-process: a model (or a saved merged folder) → ``<name>-<QUANT>.gguf`` files.

Built on the ``gguf`` package (writer, tensor-name maps, quantisers); no converter script is
downloaded and llama.cpp is never built behind the user's back.

- F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 are quantised in Python (``gguf.quants``; Q8_0 and
  Q4_0 bytes match llama.cpp's). Norms, biases and other 1-D tensors stay F32; rows whose width is
  not a multiple of the block size fall back to F16; with 4/5-bit types the output projection is
  kept at Q8_0 (llama.cpp keeps it at Q6_K, which Python cannot produce).
- K-quants (Q2_K … Q6_K) go through llama.cpp's own quantiser (``llama_model_quantize`` from
  ``llama-cpp-python``, the optional ``fasttune[gguf-kquants]`` extra) from a lossless BF16
  intermediate file.

Files are streamed: every tensor is computed (LoRA merged, arch transform applied), quantised and
written for all requested types before the next one is read, and each file is written under a
temporary name and renamed when complete. Arch-specific knowledge lives in ``gguf_arch.py``, the
vocabulary in ``gguf_tokenizer.py``; a tokenizer llama.cpp could not reproduce is refused before any
file is opened. A vision-language model's language model is written as its text arch, and its vision
tower and projector as a separate ``mmproj-*.gguf`` (``gguf_mmproj.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from . import gguf_arch, gguf_mmproj, gguf_moe_arch
from .atomic import atomic_path, fsync_dir
from .gguf_tokenizer import GGUFVocab, gguf_vocab, write_vocab
from .merged_weights import WeightEntry, checkpoint_weights, model_weights, unwrap_model
from .write_errors import free_bytes, naming_write_errors

logger = logging.getLogger(__name__)

PY_QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
KQUANT_INSTALL = (
    "K-quants (q2_k ... q6_k) need llama.cpp's quantizer from llama-cpp-python: pip install "
    "'fasttune[gguf-kquants]'. It builds llama.cpp from source; build it without -march=native, which "
    "crashes on quantized models on some CPUs: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON "
    "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON\" pip install --no-cache-dir llama-cpp-python==0.3.36")


def _qtype(quant: str):
    import gguf

    return gguf.GGMLQuantizationType[quant.upper()]


def _file_type(quant: str):
    import gguf

    return gguf.LlamaFileType.ALL_F32 if quant == "f32" else gguf.LlamaFileType[f"MOSTLY_{quant.upper()}"]


def gguf_filename(name: str, quant: str) -> str:
    """``<name>-<QUANT>.gguf``, e.g. ``my-model-Q4_K_M.gguf`` (the Hub / Ollama tag convention)."""
    return f"{name}-{quant.upper()}.gguf"


def _check_quants(quantizations: Sequence[str] | str) -> list[str]:
    if isinstance(quantizations, str):
        quantizations = (quantizations,)
    out = []
    for q in quantizations:
        q = str(q).lower()
        if q not in PY_QUANTS + K_QUANTS:
            raise ValueError(f"quantizations: {q!r} is not one of {', '.join(PY_QUANTS + K_QUANTS)}")
        if q not in out:
            out.append(q)
    if not out:
        raise ValueError("quantizations must name at least one GGUF type")
    if any(q in K_QUANTS for q in out):
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise ImportError(KQUANT_INSTALL) from e
    return out


@dataclass
class _Tensor:
    name: str                      # GGUF name
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]  # fp32 numpy, transformed


def _source(model_or_dir, tokenizer):
    """(config dict, weight entries, tokenizer, default name) of a model or a saved folder."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        from transformers import AutoConfig, AutoTokenizer

        path = Path(model_or_dir)
        cfg = AutoConfig.from_pretrained(str(path))
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
        return cfg, checkpoint_weights(path), tokenizer, path.resolve().name
    if not isinstance(model_or_dir, nn.Module):
        raise TypeError(f"model_or_dir must be a model or a folder path, got {type(model_or_dir).__name__}")
    if tokenizer is None:
        raise ValueError("tokenizer is required when exporting a model object to GGUF")
    cfg = unwrap_model(model_or_dir).config
    name = str(getattr(cfg, "_name_or_path", "") or "model").rstrip("/").split("/")[-1] or "model"
    return cfg, model_weights(model_or_dir)[0], tokenizer, name


def _family(cfg_dict: dict[str, Any]):
    from fasttune.model_patches.families import FAMILIES, family_for

    spec = family_for(cfg_dict.get("model_type"))
    if spec is None:
        raise ValueError(f"GGUF export: model_type {cfg_dict.get('model_type')!r} is not one of {sorted(FAMILIES)}")
    return spec


def _arch_for(cfg_dict: dict[str, Any]) -> str:
    spec = _family(cfg_dict)
    if spec.vision is not None and spec.vision.mmproj_type not in gguf_mmproj.SUPPORTED:
        raise ValueError(
            f"GGUF export of the vision-language model {spec.model_type!r} is not supported yet: llama.cpp needs the "
            f"language model (the tensors under `{spec.vision.language_model}`) as its {spec.gguf_arch!r} "
            f"architecture and a separate mmproj GGUF of the vision tower and projector (projector type "
            f"{spec.vision.mmproj_type!r}), and fasttune writes neither. Save the merged 16-bit model "
            "(save_merged, with the processor) and convert it with llama.cpp's convert_hf_to_gguf.py, once as is "
            "and once with --mmproj.")
    if spec.gguf_arch not in gguf_arch.ARCHS:
        raise ValueError(f"GGUF export of {cfg_dict.get('model_type')!r} (llama.cpp arch {spec.gguf_arch!r}) is not "
                         f"implemented; GGUF arches with converter rules: {sorted(gguf_arch.ARCHS)}. Save the "
                         "merged 16-bit model (save_merged) and convert it with llama.cpp's convert_hf_to_gguf.py.")
    return spec.gguf_arch


def gguf_refusal(config) -> str | None:
    """Why ``save_gguf`` would refuse a model of this transformers ``config`` before writing anything
    (family, architecture, config values llama.cpp cannot run), or None. The tokenizer and the weights
    are checked by ``save_gguf`` itself."""
    cfg = config.to_dict()
    cfg.setdefault("model_type", getattr(config, "model_type", None))
    try:
        arch = _arch_for(cfg)
        spec = _family(cfg)
        if spec.vision is None:
            gguf_arch.check_config(arch, cfg, False)
    except ValueError as err:
        return str(err)
    return None


def _plan(arch: str, cfg: dict[str, Any], entries: list[WeightEntry], approximate_yarn: bool = False) -> list[_Tensor]:
    """GGUF tensors (names, shapes, loaders) in checkpoint order, plus extras."""
    import gguf

    spec = gguf_arch.ARCHS[arch]
    gguf_arch.check_config(arch, cfg, approximate_yarn)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)  # "gpt-oss" → GPT_OSS
    name_map = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    by_name = {e.name: e for e in entries}
    plan: list[_Tensor] = []
    for e in entries:
        if e.name.endswith("rotary_emb.inv_freq"):
            continue
        if e.name == "lm_head.weight" and spec.output == "never":
            embed = by_name.get("model.embed_tokens.weight")
            if embed is None or not torch.equal(e.load(), embed.load()):
                raise ValueError(f"GGUF arch {arch!r} ties the output projection to the embeddings; "
                                 "this model has a separate lm_head (tie_word_embeddings=False)")
            continue
        parts = gguf_moe_arch.expert_parts(arch, e.name, e.shape)
        if parts is not None:  # stacked MoE experts (no ".weight" suffix in transformers 5)
            for key, shape, take in parts:
                new = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise ValueError(f"GGUF arch {arch!r}: no tensor name for {key!r}")
                plan.append(_Tensor(gguf_moe_arch.gguf_tensor_name(new), shape, lambda e=e, take=take: take(
                    e.load().detach()).to("cpu", torch.float32).contiguous().numpy()))
            continue
        new = name_map.get_name(gguf_arch.tensor_key(arch, e.name), try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"GGUF arch {arch!r}: no tensor name for {e.name!r}")
        new = gguf_arch.tensor_name(arch, new)  # gpt-oss's attention sinks carry no suffix
        plan.append(_Tensor(new, gguf_arch.tensor_shape(arch, e.name, e.shape), lambda e=e: gguf_arch.transform(
            arch, e.name, e.load().detach().to("cpu", torch.float32).numpy(), cfg)))
    names = {t.name for t in plan}
    if spec.output == "required" and "output.weight" not in names:
        embed = next(t for t in plan if t.name == "token_embd.weight")
        plan.append(_Tensor("output.weight", embed.shape, embed.load))
    for new, data in gguf_arch.extra_tensors(arch, cfg):
        plan.append(_Tensor(new, data.shape, lambda d=data: d))
    return sorted(plan, key=_order)


def _order(t: _Tensor) -> tuple:
    """Embeddings, then blocks in numeric order, then the rest: the same file whatever the source order."""
    parts = t.name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), t.name)
    return (0 if parts[0] == "token_embd" else 2, 0, t.name)


def _tensor_type(quant: str, t: _Tensor):
    """The GGML type of tensor ``t`` in a file of type ``quant``."""
    import gguf

    q = _qtype(quant)
    # MoE routers (ffn_gate_inp) stay F32, as llama.cpp's own converter keeps them; so does a gated delta rule's
    # depthwise conv (ggml_ssm_conv reads F32 weights only: a Q8_0/F16 one aborts llama.cpp).
    if len(t.shape) <= 1 or t.name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight")) \
            or not t.name.endswith(".weight") \
            or t.name.startswith(("rope_freqs", "rope_factors")):
        return gguf.GGMLQuantizationType.F32
    if quant in ("f32", "f16", "bf16"):
        return q
    if quant in ("q4_0", "q4_1", "q5_0", "q5_1") and t.name == "output.weight":
        q = gguf.GGMLQuantizationType.Q8_0
    block, _ = gguf.GGML_QUANT_SIZES[q]
    if t.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return q


def _encode(data: np.ndarray, qtype) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _open_writer(path: Path, arch: str, quant: str, cfg: dict[str, Any], vocab: GGUFVocab, plan: list[_Tensor],
                 name: str, base_model_id: str | None):
    """A GGUFWriter on ``path`` with header, metadata and tensor infos written; returns it and the
    bytes of tensor data still to come (for the space a full disk would need)."""
    import gguf

    w = gguf.GGUFWriter(path=None, arch=arch)
    w.add_type("model")
    w.add_name(_safe_general_name(name, vocab))
    if base_model_id:
        w.add_base_model_count(1)
        w.add_base_model_name(0, base_model_id.split("/")[-1])
        w.add_base_model_repo_url(0, f"https://huggingface.co/{base_model_id}")
    w.add_file_type(_file_type(quant))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_arch.write_arch_metadata(w, cfg, arch)
    write_vocab(w, vocab)
    data_bytes = 0
    for t in plan:
        qtype = _tensor_type(quant, t)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
            nbytes = int(np.prod(t.shape)) * np.dtype(dtype).itemsize
            w.add_tensor_info(t.name, t.shape, np.dtype(dtype), nbytes)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(t.shape, qtype)
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        data_bytes += nbytes
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w, data_bytes


def _safe_general_name(name: str, vocab: GGUFVocab) -> str:
    """llama.cpp applies Phi-3 token attributes to any model whose general.name contains "phi3"/"phi-3"
    and aborts when the Phi-3 special tokens are missing; keep such names only for Phi-3 vocabularies."""
    if not any(s in name.lower() for s in ("phi3", "phi-3")):
        return name
    if {"</s>", "<unk>", "<s>", "<|endoftext|>"} <= set(vocab.tokens):
        return name
    return name.replace("phi3", "phi_3").replace("Phi3", "Phi_3").replace("phi-3", "phi_3").replace("Phi-3", "Phi_3")


def _llama_quantize(src: Path, dst: Path, quant: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        free = free_bytes(dst)
        if free is not None and free < src.stat().st_size // 4:  # llama.cpp reports no reason: a full disk?
            raise OSError(errno.ENOSPC, f"llama_model_quantize({quant.upper()}) failed with {free} bytes free")
        raise RuntimeError(f"llama_model_quantize({quant.upper()}) failed with code {rc}")


def save_gguf(model_or_dir, tokenizer, out_dir: str | Path, quantizations: Sequence[str] | str = ("q8_0",), *,
              name: str | None = None, base_model_id: str | None = None, approximate_yarn: bool = False) -> list[Path]:
    """Writes one GGUF file per quantisation type.

    Args:
        model_or_dir: a (PEFT LoRA or plain) causal LM, merged on the fly without modifying it, or
            a folder written by ``save_merged``/``save_pretrained``.
        tokenizer: the model's tokenizer (a fast/tokenizers-backed one), or a VLM's processor (its
            image mean/std go into the mmproj file); for a folder, None loads it from there.
        out_dir: destination folder (created).
        quantizations: any of "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1" (Python)
            and "q2_k" … "q6_k" (need llama-cpp-python: ``pip install 'fasttune[gguf-kquants]'``).
        name: file stem; defaults to the folder's or the model's name.
        base_model_id: Hub id recorded as ``general.base_model.0.*``.
        approximate_yarn: accept a YaRN RoPE with ``truncate=False`` (gpt-oss), which llama.cpp can
            only run truncated: an approximation, logits drift from transformers' at long positions.

    Returns:
        The written paths, ``<out_dir>/<name>-<QUANT>.gguf``, in the order requested; for a
        vision-language model (Qwen2-VL, Qwen2.5-VL, Gemma 3) these hold its language model, and
        ``<out_dir>/mmproj-<name>-F16.gguf`` (F32 when "f32" is requested) follows: the vision tower
        and projector, which llama.cpp loads beside any of them (``gguf_mmproj.py``).

    Raises:
        ValueError: a quantisation type, model type or tokenizer that GGUF/llama.cpp cannot express
            (checked before anything is written; the message says why).
    """
    quants = _check_quants(quantizations)
    processor = tokenizer if hasattr(tokenizer, "image_processor") else None
    tokenizer = getattr(processor, "tokenizer", tokenizer)
    config, entries, tokenizer, default_name = _source(model_or_dir, tokenizer)
    cfg = config.to_dict()
    cfg.setdefault("model_type", getattr(config, "model_type", None))
    arch = _arch_for(cfg)
    vision, split = _family(cfg).vision, None
    if vision is not None:  # a VLM: its language model as a text model, the vision side as an mmproj file
        split = gguf_mmproj.split_vlm(vision, cfg, entries)
        cfg, entries = split.text_cfg, split.text_entries
        gguf_mmproj.mmproj_tensors(split, vision)  # a vision tensor llama.cpp has no name for stops here
        folder = model_or_dir if isinstance(model_or_dir, (str, os.PathLike)) else None
        image_norm = gguf_mmproj.image_norm(processor, split.projector, folder)
    vocab = gguf_vocab(tokenizer, cfg["vocab_size"])  # a tokenizer llama.cpp cannot reproduce stops here
    name = name or default_name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = _plan(arch, cfg, entries, approximate_yarn)

    py = [q for q in quants if q in PY_QUANTS]
    kq = [q for q in quants if q in K_QUANTS]
    targets = [(q, out_dir / gguf_filename(name, q)) for q in py]
    # K-quants start from a lossless BF16 file: the requested one, or a temporary one.
    scratch = out_dir / f".{name}-intermediate-BF16.gguf" if kq and "bf16" not in py else None
    if scratch is not None:
        targets.append(("bf16", scratch))
    with torch.no_grad(), contextlib.ExitStack() as stack:
        tmp_paths = [stack.enter_context(atomic_path(path)) for _, path in targets]
        writers, guards = [], []
        stack.callback(lambda: [w.close() for w in writers])  # closed before the renames
        for (q, final), tmp in zip(targets, tmp_paths):
            with naming_write_errors(final):
                w, data_bytes = _open_writer(tmp, arch, q, cfg, vocab, plan, name, base_model_id)
            writers.append(w)
            # each file's own path and size in the message when the disk fills up while writing it
            expected = tmp.stat().st_size + data_bytes
            guards.append(lambda f=final, t=tmp, n=expected: naming_write_errors(f, n, lambda: t.stat().st_size))
        for t in plan:
            data = t.load()
            for (q, _), w, guard in zip(targets, writers, guards):
                with guard():
                    w.write_tensor_data(_encode(data, _tensor_type(q, t)))
    written = {q: out_dir / gguf_filename(name, q) for q in py}
    if kq:
        source = scratch if scratch is not None else written["bf16"]
        try:
            for q in kq:
                final = out_dir / gguf_filename(name, q)
                with atomic_path(final) as tmp:
                    _llama_quantize(source, tmp, q)
                written[q] = final
        finally:
            if scratch is not None:
                scratch.unlink(missing_ok=True)
            fsync_dir(out_dir)
    paths = [written[q] for q in quants]
    if split is not None:
        mm_quant = gguf_mmproj.mmproj_quant(quants)
        final = out_dir / gguf_mmproj.mmproj_filename(name, mm_quant)
        with naming_write_errors(final), atomic_path(final) as tmp:
            gguf_mmproj.write_mmproj(tmp, split, vision, mm_quant, name, *image_norm)
        paths.append(final)
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths

