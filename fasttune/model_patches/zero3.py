"""DeepSpeed ZeRO-3 parameters as the fused paths see them (duck-typed: deepspeed is not imported).

ZeRO-3 keeps each parameter partitioned and gathers it around the forward (and backward) of the
module that owns it, through hooks on every module. The fused paths read the weights of modules
whose own forward never runs (lm_head for the loss, the projections of a fused LoRA attention or
MLP), so they may use a ZeRO-3 parameter only when it is gathered now and stays gathered until
backward: a persistent parameter, or an external parameter of the module whose forward is
running (``deepspeed.zero.register_external_parameter``; ``hf_integration.distributed`` registers
them at train begin). Anything else takes the stock path, where DeepSpeed's hooks gather it.
"""

from __future__ import annotations

from torch import nn

DEEPSPEED_HOOK_MODULE = "deepspeed."


def is_zero3_param(p) -> bool:
    """A parameter that DeepSpeed ZeRO-3 manages (it carries a ``ds_id``)."""
    return p is not None and hasattr(p, "ds_id")


def zero3_ready(module: nn.Module, *params) -> bool:
    """ZeRO-3 parameters gathered now and kept gathered through backward: persistent ones, or
    external parameters of ``module`` (DeepSpeed gathers those around its forward and backward).
    Parameters that are None or not ZeRO-3's are ready."""
    params = [p for p in params if is_zero3_param(p)]
    if not params:
        return True
    external = getattr(module, "ds_external_parameters", None)
    registered = {id(p) for _, p in external()} if callable(external) else set()
    for p in params:
        if getattr(getattr(p, "ds_status", None), "name", None) != "AVAILABLE" or p.numel() == 0:
            return False
        if not (getattr(p, "ds_persist", False) or id(p) in registered):
            return False
    return True


def only_zero3_hooks(module: nn.Module) -> bool:
    """True when every forward (pre-)hook on ``module`` is one of DeepSpeed's (its parameter
    fetch/release and backward set-up), which a fused path may skip once it holds the parameters."""
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    return all(getattr(h, "__module__", "").startswith(DEEPSPEED_HOOK_MODULE) for h in hooks)


__all__ = ["is_zero3_param", "only_zero3_hooks", "zero3_ready"]
