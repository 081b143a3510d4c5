"""FastConfig(base_dtype="fp8"): the fused LoRA projections' frozen base weights stored in FP8.

Runs after ``patch_lora``: every projection a fused-LoRA hook reads (q/k/v, o, gate/up, down,
or Phi-3's fused qkv_proj / gate_up_proj; with or without an adapter of its own) has its base
layer converted by ``fp8_base.to_fp8`` (dense 16-bit weights quantised; NF4 weights dequantised
once, then quantised), one layer at a time, so the peak is one extra weight. An approximation,
named as one: each converted projection is the report's op ``fp8_<projection>`` (patched once
per layer, calls counted by the hooks and by the layer's own forward), and the log line says
how much memory the base weights take before and after. A projection that cannot be converted
stays as it is and is listed as a fallback of its ``fp8_*`` op.

Not converted: models without fused LoRA (``lora=False``, full fine-tuning: the weights train),
DeepSpeed ZeRO-3 partitions, parameters FSDP sharded before patching (FastTrainer patches before
accelerate shards), base layers other than dense linears and NF4 ``Linear4bit``.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn

from ..config import FastConfig
from .families import FamilySpec
from .fp8_base import fp8_op, is_fp8_layer, to_fp8
from .lora import fused_projection_names, is_lora_layer
from .report import PatchReport

logger = logging.getLogger("fasttune")

__all__ = ["checkpoint_source", "fp8_load_config", "patch_fp8_bases"]

GIB = 1 << 30


def checkpoint_source(model: nn.Module) -> str | None:
    """Where ``model`` was loaded from (its config's ``_name_or_path``: a folder or a Hub id), or
    None for a model built from a config: the place exports read the original 16-bit weights."""
    source = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not isinstance(source, str) or not source:
        return None
    if os.path.isdir(source):
        return os.path.abspath(source)
    return source if source.count("/") == 1 and not source.startswith((".", "/", "~")) else None


def fp8_load_config(load_in_fp8, fast_config: FastConfig | None, lora) -> FastConfig | None:
    """``load_model(load_in_fp8=...)``: ``fast_config`` with ``base_dtype="fp8"`` when True (it stays
    as given when False). ValueError for a non-bool, or for True without an adapter to train."""
    if not isinstance(load_in_fp8, bool):
        raise ValueError(f"load_in_fp8 must be True or False, got {load_in_fp8!r}")
    if not load_in_fp8:
        return fast_config
    if lora is None:
        raise ValueError("load_in_fp8=True stores the frozen base weights of LoRA projections in FP8: it needs "
                         "lora (a LoraSpec or peft.LoraConfig), not None")
    return dataclasses.replace(fast_config or FastConfig(), base_dtype="fp8")


def _nbytes(layer: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*layer.parameters(recurse=False), *layer.buffers(recurse=False)))


def patch_fp8_bases(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig, report: PatchReport) -> None:
    """Convert the fused LoRA projections' base layers to FP8 (module docstring); no-op unless
    ``config.base_dtype == "fp8"``."""
    if config.base_dtype != "fp8":
        return
    where = str(report.model_type)
    if not config.lora:
        report.fallback("fp8", where, "base_dtype='fp8' stores the bases of fused LoRA projections: needs lora=True")
        return
    source = checkpoint_source(base)
    before = after = converted = 0
    for module_name, module in base.named_modules():
        for name in fused_projection_names(module):
            proj = getattr(module, name)
            owner, attr = (proj, "base_layer") if is_lora_layer(proj) else (module, name)
            layer = getattr(owner, attr)
            size = 0 if is_fp8_layer(layer) else _nbytes(layer)
            op = fp8_op(name)
            result = to_fp8(owner, attr, op, report, source)
            if isinstance(result, str):
                report.fallback(op, f"{module_name}.{name}", result)
                continue
            report.add(op, counted=True)
            before, after, converted = before + (size or _nbytes(result)), after + _nbytes(result), converted + 1
    if not converted:
        if not any(fb.op.startswith("fp8_") for fb in report.fallbacks):
            report.fallback("fp8", where, "no fused LoRA projection to store in FP8 (see the lora_* entries: full "
                            "fine-tuning, or no adapter took the fused path)")
        return
    logger.info("fasttune: %d base projections stored in FP8 (an approximation: fp8_* in the report): "
                "%.2f GiB -> %.2f GiB%s%s", converted, before / GIB, after / GIB, _release_freed_weights(),
                "" if source else "; the model was not loaded from a checkpoint, so merged/GGUF exports need "
                "base=<its 16-bit original>")


def _release_freed_weights() -> str:
    """Give the CUDA allocator's free segments back to the device, and say how much.

    The 16-bit weights just replaced were freed, but the caching allocator keeps their segments
    reserved: an 8B model kept ~5 GiB reserved beyond what the FP8 step ever allocates (15.86 GiB
    reserved, 10.65 allocated, benchmarks/RESULTS.md). ``empty_cache`` releases only segments with
    nothing in use; no live tensor moves."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    freed = reserved - torch.cuda.memory_reserved()
    return f"; {freed / GIB:.2f} GiB of freed cache returned to the device" if freed > 0 else ""
