"""Read a projection module as the ``(base, lora_a, lora_b, scaling)`` spec the fused-LoRA kernels take.

``lora_spec(module)`` duck-types PEFT's ``peft.tuners.lora.Linear`` (and its bitsandbytes
``Linear4bit`` variant), a plain ``nn.Linear`` and a bare bitsandbytes ``Linear4bit`` (no adapter
targeted on that projection). It returns a reason string instead whenever the fused Functions
would not compute what the module's own forward computes: dropout, DoRA or another LoRA
variant, several active adapters, merged or disabled adapters, a LoRA bias, fan-in-fan-out
weights, a trainable base weight, a base layer other than a linear or an NF4 ``Linear4bit``, a
DeepSpeed ZeRO-3 weight that is not gathered for the caller. Call it at each forward: it reads
the module's current state (set_adapter, merge, disable). A dense base weight re-homed by
``lora_widen.py`` comes with its ``WideWeight``; one stored in FP8 by ``fp8_base.py`` is an FP8
``BaseWeight`` (codes and row scales).
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from ..kernels.lora import BaseWeight
from .fp8_base import fp8_weight_of, is_fp8_layer
from .lora_widen import wide_of
from .module_attr import base_layer_of, module_attr
from .zero3 import is_zero3_param, zero3_ready

__all__ = ["lora_spec"]


def _check_code_storage(layer: nn.Module, weight: torch.Tensor, quant_state) -> None:
    """NF4 codes are bytes held in a tensor of the storage dtype (``bnb_4bit_quant_storage``). A cast of
    that tensor (an FSDP2 ``MixedPrecisionPolicy`` whose param_dtype differs from the storage, a
    ``model.to(dtype)``) keeps the values, not the bytes: every number read from it would be wrong,
    on the fused path and on bitsandbytes' own alike, so refuse it by name."""
    if getattr(quant_state, "packing_format_for_cpu", False):
        return  # bitsandbytes' CPU inference layout: uint8 by design (model_patches/lora.py falls back on it)
    storage = getattr(weight, "quant_storage", None) or module_attr(layer, "quant_storage")
    if isinstance(storage, torch.dtype) and weight.dtype != storage:
        raise TypeError(f"the NF4 codes of this {type(layer).__name__} are {weight.dtype} but were stored as "
                        f"{storage} (bnb_4bit_quant_storage): a cast turned the packed bytes into other numbers. "
                        f"Under FSDP2, give MixedPrecisionPolicy a param_dtype equal to bnb_4bit_quant_storage "
                        f"(accelerate's FSDP2 preparation drops the policy for 4-bit models)")


def _base_weight(layer: nn.Module, zero3_owner: nn.Module | None) -> BaseWeight | str:
    """The frozen weight (and bias) of a plain linear or bitsandbytes NF4 layer."""
    weight = module_attr(layer, "weight")
    if not isinstance(weight, torch.Tensor):
        return f"base layer {type(layer).__name__} has no weight tensor"
    bias = module_attr(layer, "bias")
    if bias is not None and bias.requires_grad:
        return "base layer bias is trainable"
    if weight.requires_grad:
        return "base layer weight is trainable"
    if is_zero3_param(weight):
        if zero3_owner is not None:  # a call: the weight must be whole now and until backward
            if not zero3_ready(zero3_owner, weight, bias):
                return ("DeepSpeed ZeRO-3 base weight not gathered for the fused path (FastTrainer registers it "
                        "at train begin: register_zero3_fused_lora)")
        elif type(layer) is nn.Linear:  # patching: judge the layer by DeepSpeed's record of its shape
            return BaseWeight(torch.empty(tuple(weight.ds_shape), dtype=weight.dtype, device="meta"))
    if is_fp8_layer(layer):  # stored in FP8 by fp8_base.py (FastConfig.base_dtype="fp8")
        return BaseWeight(weight, None, None if bias is None else bias.detach(), fp8_scale=fp8_weight_of(layer).scale)
    if type(layer).__name__ == "Linear8bitLt" or hasattr(weight, "SCB"):
        return "8-bit bitsandbytes base layer"
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is None:  # FSDP may strip it off the parameter; bitsandbytes keeps a copy on the layer
        quant_state = module_attr(layer, "quant_state")
    if type(layer).__name__ == "Linear4bit" or quant_state is not None:
        if quant_state is None:
            return "bitsandbytes Linear4bit weight is not quantized yet (move the model to its device first)"
        if getattr(quant_state, "quant_type", None) != "nf4":
            return f"4-bit quant_type {getattr(quant_state, 'quant_type', None)!r}, only nf4 is fused"
        _check_code_storage(layer, weight, quant_state)
        return BaseWeight(weight.data, quant_state, None if bias is None else bias.detach(),
                          wide_of(layer, weight.data, quant_state))
    if not isinstance(layer, nn.Linear) or weight.dim() != 2 or not weight.is_floating_point():
        return f"base layer {type(layer).__name__} is not a linear layer"
    return BaseWeight(weight, None, bias, wide_of(layer, weight))


def _active_adapter(module: nn.Module, lora_a_dict) -> str | None:
    active = getattr(module, "active_adapters", None)
    if active is None:
        active = getattr(module, "active_adapter", None)
    if isinstance(active, str):
        active = [active]
    active = [a for a in (active or []) if a in lora_a_dict]
    return active[0] if len(active) == 1 else (None if not active else "")


def lora_spec(module: nn.Module, zero3_owner: nn.Module | None = None, ignore_disabled: bool = False):
    """``(BaseWeight, lora_a, lora_b, scaling)`` for ``module``, or a string saying why not.

    A module with no active adapter here gives ``(BaseWeight, None, None, 0.0)`` (the kernels
    then run the base projection only). ``lora_a``/``lora_b`` are the adapter's parameters
    themselves, so their gradients land where PEFT's would.

    DeepSpeed ZeRO-3 parameters (``zero3.py``): with ``zero3_owner`` (the attention or MLP whose
    forward is running) they must be gathered and kept gathered by that module, else a reason;
    without it (at patch time) a partitioned base weight stands in as a meta tensor of its shape.
    ``ignore_disabled``: the spec as if PEFT's ``disable_adapter()`` were not in force (its ranks
    size the widened layout before a reference pass, ``lora_widen.py``).
    """
    lora_a_dict = module_attr(module, "lora_A")
    if module_attr(module, "base_layer") is None or lora_a_dict is None:
        base = _base_weight(module, zero3_owner)
        return base if isinstance(base, str) else (base, None, None, 0.0)
    if getattr(module, "merged", False):
        return "LoRA adapter merged into the base weight"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D-style) weights"
    base = _base_weight(base_layer_of(module), zero3_owner)
    if isinstance(base, str):
        return base
    if getattr(module, "disable_adapters", False) and not ignore_disabled:
        # A widened base (lora_widen.py) runs the disabled pass through the same widened product
        # with a zero tail, so a fresh adapter's output (B = 0) is bitwise this one; else PEFT's path.
        return (base, None, None, 0.0) if base.wide is not None else "LoRA adapters disabled"
    adapter = _active_adapter(module, lora_a_dict)
    if adapter == "":
        return "several active LoRA adapters"
    if adapter is None:
        return base, None, None, 0.0
    if adapter in module_attr(module, "lora_variant", {}) or module_attr(module, "use_dora", {}).get(adapter, False):
        return "LoRA variant (DoRA, aLoRA, ...) is not fused"
    dropout = module_attr(module, "lora_dropout")[adapter]
    if not (isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and dropout.p == 0)):
        return "lora_dropout > 0"
    lora_a, lora_b = lora_a_dict[adapter], module_attr(module, "lora_B")[adapter]
    if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)):
        return "LoRA A/B are not linear layers"
    if module_attr(lora_b, "bias") is not None or module_attr(lora_a, "bias") is not None:
        return "LoRA bias (lora_bias=True)"
    scaling = module.scaling[adapter]
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        return f"scaling of type {type(scaling).__name__}"
    if zero3_owner is not None and not zero3_ready(zero3_owner, module_attr(lora_a, "weight"), module_attr(lora_b, "weight")):
        return "DeepSpeed ZeRO-3 adapter weights not gathered for the fused path"
    return base, module_attr(lora_a, "weight"), module_attr(lora_b, "weight"), float(scaling)
