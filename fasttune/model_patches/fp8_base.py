"""A frozen linear layer stored in FP8: the base layer of a projection under ``base_dtype="fp8"``.

``to_fp8(owner, attr, op, report)`` turns ``owner.<attr>`` (a frozen dense ``nn.Linear``, or a
bitsandbytes NF4 ``Linear4bit``, dequantised once) into an ``nn.Linear`` holding

    weight        uint8 Parameter [out, in]: e4m3 codes (kernels/fp8.py), requires_grad False
    weight_scale  int32 buffer [out]: the bits of the float32 power-of-two row scales (not in the
                  state dict; read as float32 through a free ``view``)

and a forward of its own, ``Fp8LinearForward`` (``fp8_linear``: X quantised per row, FP8
product, FP8 dX), so every path that calls the layer (PEFT's unfused forward, a disabled
adapter's reference pass, generation) computes with the same FP8 weight the fused LoRA path
reads (``lora_specs`` hands it over as an FP8 ``BaseWeight``). The 16-bit weight is freed.

uint8 storage on purpose: DDP broadcasts, FSDP2 shards and all-gathers it as plain bytes (FSDP2
casts floating-point parameters to its mixed-precision dtype; it leaves integer ones alone), and
PEFT never moves adapters to its dtype (it does for floating base weights). The scales are a
buffer: FSDP2 leaves buffers whole on every rank, so a gathered shard of rows finds all of them;
integer bits, so ``model.to(torch.float16)`` (or a mixed-precision cast) cannot round them (2^-20
is 0 in fp16).

One-way, like loading in 4 bits: FP8 codes cannot give the 16-bit weight back, so
``unpatch_model`` leaves the layer in FP8 with its forward. The layer records the checkpoint the
model was loaded from (``FP8_SOURCE_ATTR``): exports read the original 16-bit weights there.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8 import Fp8Weight, fp8_linear, product_path
from ..kernels.lora import BaseWeight, autocast_input
from .instance import PatchedForward
from .module_attr import module_attr
from .report import FUSED, PatchReport
from .zero3 import is_zero3_param

__all__ = ["FP8_OP_PREFIX", "FP8_SOURCE_ATTR", "SCALE_NAME", "Fp8LinearForward", "fp8_op", "fp8_weight_of",
           "is_fp8_layer", "to_fp8"]

FP8_OP_PREFIX = "fp8_"
SCALE_NAME = "weight_scale"
FP8_SOURCE_ATTR = "_fasttune_fp8_source"
_DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp8_op(projection: str) -> str:
    """The report's op for a projection's FP8 base products ("fp8_q_proj", ...)."""
    return FP8_OP_PREFIX + projection


def is_fp8_layer(layer: nn.Module) -> bool:
    """True for a layer ``to_fp8`` converted (uint8 codes and their scale buffer)."""
    weight, scale = module_attr(layer, "weight"), module_attr(layer, SCALE_NAME)
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.uint8
            and isinstance(scale, torch.Tensor) and scale.dtype == torch.int32)


def fp8_weight_of(layer: nn.Module) -> Fp8Weight:
    """The layer's codes and scales (as they are now: FSDP may have gathered or resharded them)."""
    return Fp8Weight(module_attr(layer, "weight"), module_attr(layer, SCALE_NAME).view(torch.float32))


class Fp8LinearForward(PatchedForward):
    """``y = x Wᵀ (+ b)`` with the layer's FP8 weight; counts (op, FUSED) on FP8 tensor cores, else
    (op, why the dequantise-and-matmul reference ran)."""

    def __init__(self, module: nn.Module, op: str):
        super().__init__(module, type(module).forward.__get__(module))
        self.op = op

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
        x, _ = autocast_input(input)
        w = fp8_weight_of(self.module)
        self.count(product_path(x, w) or FUSED)
        bias = self.module.bias
        return fp8_linear(x, w, None if bias is None else bias.detach())


def _dense_weight(layer: nn.Module) -> torch.Tensor | str:
    """The layer's weight as a float tensor to quantise (NF4 dequantised exactly to fp32), or why not."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return f"{type(layer).__name__} has no weight tensor"
    if weight.requires_grad:
        return "base weight is trainable (full fine-tuning of this layer): FP8 storage is for frozen weights"
    bias = getattr(layer, "bias", None)
    if bias is not None and bias.requires_grad:
        return "base bias is trainable"
    if is_zero3_param(weight):
        return "DeepSpeed ZeRO-3 partition (patch before deepspeed.initialize is not supported for FP8)"
    if type(weight.data) is not torch.Tensor and type(weight.data).__name__ != "Params4bit":
        return (f"weight is a {type(weight.data).__name__} (sharded by FSDP before patching): patch the model "
                "before fully_shard (FastTrainer does)")
    if weight.device.type == "meta":
        return "weight on the meta device"
    quant_state = getattr(weight, "quant_state", None) or getattr(layer, "quant_state", None)
    if quant_state is not None:
        if getattr(quant_state, "quant_type", None) != "nf4":
            return f"4-bit quant_type {getattr(quant_state, 'quant_type', None)!r}: only NF4 is converted"
        if getattr(quant_state, "packing_format_for_cpu", False):
            return "NF4 weight repacked by bitsandbytes' CPU inference path"
        return BaseWeight(weight.data, quant_state).materialize(dtype=torch.float32)
    if not isinstance(layer, nn.Linear) or weight.dim() != 2 or weight.dtype not in _DENSE_DTYPES:
        return f"base layer {type(layer).__name__} ({weight.dtype}) is not a dense float linear layer"
    return weight.detach()


def _break_params4bit_cycle(layer: nn.Module) -> None:
    """Let a replaced ``Linear4bit`` go the moment its last reference does.

    bitsandbytes' ``Params4bit.module`` points back at its ``Linear4bit``: the pair is a reference
    cycle, so the NF4 codes stayed on the GPU until the cyclic collector's next full pass, 3.35 GiB
    through the first shape of an 8B QLoRA-sourced FP8 run (benchmarks/RESULTS.md, session 15).
    The old layer keeps its weight; only the back-reference goes."""
    weight = layer._parameters.get("weight")
    if getattr(weight, "module", None) is layer:
        weight.module = None


def to_fp8(owner: nn.Module, attr: str, op: str, report: PatchReport, source: str | None) -> nn.Module | str:
    """Store ``owner.<attr>`` in FP8 (module docstring); returns the FP8 layer, or why it stays.

    A layer already in FP8 is adopted (its forward counts into ``report`` from now on).
    """
    layer = getattr(owner, attr)
    if is_fp8_layer(layer):
        fp8 = layer
    else:
        dense = _dense_weight(layer)
        if isinstance(dense, str):
            return dense
        with torch.no_grad():
            w = Fp8Weight.quantize(dense)
        del dense
        bias = getattr(layer, "bias", None)
        if isinstance(layer, nn.Linear) and type(layer) is nn.Linear:
            fp8 = layer  # converted in place: hooks, names and the PEFT wrapper stay as they are
        else:  # a Linear4bit: a plain nn.Linear takes its place
            fp8 = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
            fp8.bias = bias
        fp8.weight = nn.Parameter(w.codes, requires_grad=False)
        fp8.register_buffer(SCALE_NAME, w.scale.view(torch.int32), persistent=False)
        fp8.__dict__[FP8_SOURCE_ATTR] = source
        if fp8 is not layer:
            setattr(owner, attr, fp8)
            _break_params4bit_cycle(layer)
    fwd = fp8.__dict__.get("forward")
    if not isinstance(fwd, Fp8LinearForward):
        fwd = Fp8LinearForward(fp8, op)
        fp8.forward = fwd
    fwd.op, fwd.calls = op, report.calls
    report.installed.append((fp8, fwd))
    return fp8
