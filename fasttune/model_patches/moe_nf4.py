"""QLoRA for mixture-of-experts models: the frozen stacked experts held in NF4.

transformers 5 + bitsandbytes quantise 2-D ``nn.Linear`` weights only: a MoE model loaded with
``BitsAndBytesConfig(load_in_4bit=True)`` keeps each layer's stacked experts (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]; gpt-oss transposed) dense in the load dtype — most of the
memory of a model like Qwen3-30B-A3B. ``FastConfig.moe_experts_nf4`` ("auto": when the base was
loaded in 4-bit NF4) quantises them with bitsandbytes' own ``quantize_4bit`` (NF4, the base's
blocksize and double-quant setting) and puts a ``kernels.nf4_weight.NF4Weight`` in the
parameter's place on that experts module instance (the class is untouched). Only experts modules
that ``moe.FastExpertsForward`` serves are quantised: every call reaches that forward, which hands
the NF4 weights to the grouped path (dequantised per use, forward and backward) or, for a call
that stays stock, puts the dequantised weights back as dense parameters for that call only
(``dense_experts``). The numbers are those of a stock model whose experts hold the dequantised
values, exactly.

Not done: trainable experts (full fine-tuning) stay dense; PEFT's in-place merge into NF4 experts is
refused (``NF4Weight.data``); ``unpatch_model`` restores dense parameters holding the dequantised
values (the original 16-bit weights are gone once quantised).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..config import FastConfig
from ..kernels.nf4_weight import NF4Weight

OP = "moe_nf4"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
DEFAULT_BLOCKSIZE = 64  # bitsandbytes' Params4bit default


def _quant_config(base: nn.Module) -> dict:
    quant = getattr(getattr(base, "config", None), "quantization_config", None)
    return quant.to_dict() if hasattr(quant, "to_dict") else quant if isinstance(quant, dict) else {}


def loaded_in_4bit(base: nn.Module) -> bool:
    """True when transformers loaded the model with bitsandbytes 4-bit weights."""
    return bool(getattr(base, "is_loaded_in_4bit", False) or _quant_config(base).get("load_in_4bit"))


def _base_quant_state(base: nn.Module):
    """The QuantState of the first bitsandbytes 4-bit weight in the model, or None."""
    for module in base.modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            return weight.quant_state
    return None


def nf4_settings(base: nn.Module, config: FastConfig) -> tuple[int, bool] | str | None:
    """(blocksize, double quant) to quantise the experts with; None to leave them alone (off, or
    "auto" on a base not loaded in 4-bit); or why they stay dense although asked for."""
    mode = config.moe_experts_nf4
    if mode == "off" or (mode == "auto" and not loaded_in_4bit(base)):
        return None
    quant = _quant_config(base)
    quant_type = quant.get("bnb_4bit_quant_type", "nf4") if quant.get("load_in_4bit") else "nf4"
    if mode == "auto" and quant_type != "nf4":
        return (f"the base is 4-bit {quant_type}, not NF4: the experts stay dense (moe_experts_nf4='on' "
                "quantises them to NF4 anyway)")
    try:
        import bitsandbytes.functional  # noqa: F401
    except ImportError:
        return "bitsandbytes is not installed: the experts stay dense"
    state = _base_quant_state(base)
    if state is not None:
        return int(state.blocksize), bool(getattr(state, "nested", False))
    return DEFAULT_BLOCKSIZE, bool(quant.get("bnb_4bit_use_double_quant", False))


def _put(module: nn.Module, name: str, value: nn.Module | nn.Parameter) -> None:
    """Set ``name`` to a parameter or an ``NF4Weight`` (nn.Module refuses a module over a parameter)."""
    if name in module._parameters or name in module._modules:
        delattr(module, name)
    setattr(module, name, value)


def holds_nf4(experts: nn.Module) -> bool:
    """True when the experts module's stacked weights are held in NF4."""
    return any(isinstance(getattr(experts, n, None), NF4Weight) for n in EXPERT_WEIGHTS)


SOURCE_ATTR = "_fasttune_nf4_source"  # on a restored dense parameter: the NF4Weight it was dequantised from


class _RestoreDense:
    """Undo of ``quantize_experts``: dense frozen parameters holding the dequantised values. An
    object, not a closure, so ``copy.deepcopy`` of a patched model maps it onto the copy. Each
    parameter remembers its NF4 source, so a re-patch (``patch_model`` unpatches first) takes the
    same codes back instead of quantising the dequantised values again (double quant would drift)."""

    def __init__(self, experts: nn.Module):
        self.experts = experts

    def __call__(self) -> None:
        for name in EXPERT_WEIGHTS:
            held = getattr(self.experts, name, None)
            if isinstance(held, NF4Weight):
                dense = nn.Parameter(held.dequantize(), requires_grad=False)
                setattr(dense, SOURCE_ATTR, held)
                _put(self.experts, name, dense)


def _unchanged_source(w: nn.Parameter, blocksize: int, nested: bool) -> NF4Weight | None:
    """The NF4Weight a restored parameter came from, when it still holds exactly its values (a
    value check, not the version counter: PEFT merges through ``param.data``, which bumps none)."""
    held = getattr(w, SOURCE_ATTR, None)
    if (isinstance(held, NF4Weight) and held.blocksize == blocksize
            and held.nested == nested and held.device == w.device and held.shape == w.shape and held.dtype == w.dtype
            and torch.equal(held.dequantize(), w.detach())):
        return held
    return None


def quantize_experts(experts: nn.Module, blocksize: int, nested: bool):
    """Replace the experts module's stacked weights by NF4 ones (module docstring); returns the
    undo, or why the weights stay dense."""
    import bitsandbytes.functional as bnb_f

    weights = {n: getattr(experts, n, None) for n in EXPERT_WEIGHTS}
    for name, w in weights.items():
        if not isinstance(w, nn.Parameter) or w.dim() != 3:
            return f"{name} is not a 3-D parameter"
        if w.numel() == 0 or hasattr(w, "ds_id") or type(w).__name__ == "DTensor":
            return f"{name} is partitioned or sharded (ZeRO-3 / FSDP): NF4 experts need the whole tensor"
        if w.requires_grad:
            return f"{name} is trainable (full fine-tuning): NF4 holds frozen weights only"
    for name, w in weights.items():
        held = _unchanged_source(w, blocksize, nested)
        if held is None:
            packed, state = bnb_f.quantize_4bit(w.detach().contiguous(), blocksize=blocksize,
                                                compress_statistics=nested, quant_type="nf4")
            held = NF4Weight(packed, state)
            del packed, state
        _put(experts, name, held)  # the dense parameter is dropped here
    weights.clear()
    return _RestoreDense(experts)


def hit_experts(index: torch.Tensor, projections):
    """For a decode step (a few rows): (index renumbered over the experts it hits, the projections
    cut to those experts, NF4 weights dequantised for them only), or None where a weight's experts
    do not start on scale blocks. Dequantising the whole stack for a handful of tokens would cost
    more than the step (Qwen3-30B-A3B: 1.2 GB of bf16 per layer)."""
    ids, compact = torch.unique(index, return_inverse=True)
    out = []
    for p in projections:
        weight = p.weight.dequantize_experts(ids) if isinstance(p.weight, NF4Weight) else p.weight[ids]
        if weight is None:
            return None
        pick = (lambda t: None if t is None else t[ids])
        out.append(p._replace(weight=weight, bias=pick(p.bias), lora_a=pick(p.lora_a), lora_b=pick(p.lora_b)))
    return compact.view(index.shape), tuple(out)


@contextlib.contextmanager
def dense_experts(experts: nn.Module):
    """For one stock call: the dequantised weights as frozen dense parameters, NF4 again after."""
    held = {n: getattr(experts, n) for n in EXPERT_WEIGHTS if isinstance(getattr(experts, n, None), NF4Weight)}
    for name, w in held.items():
        _put(experts, name, nn.Parameter(w.dequantize(), requires_grad=False))
    try:
        yield
    finally:
        for name, w in held.items():
            _put(experts, name, w)


__all__ = ["OP", "dense_experts", "hit_experts", "holds_nf4", "loaded_in_4bit", "nf4_settings", "quantize_experts"]
