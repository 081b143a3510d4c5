"""Re-home frozen dense projection weights so the LoRA rank-r term rides in the base product.

``kernels/lora_wide.py`` computes a LoRA projection group as Y_p = [X | s·XA] [W_p | B_p]ᵀ, which
needs each base weight W_p [out, in] to be the first ``in`` columns of a buffer [out, in + R]. This
module moves a base layer's weight there: the buffer is allocated with a zero tail, W is copied in
and the parameter's ``.data`` becomes the [out, in] view of it (the same Parameter object, so
optimizers, hooks and state dicts are unaffected; ``save_pretrained`` and fasttune's exports copy
it contiguous). The ``WideWeight`` is kept on the base layer (``WIDE_ATTR``) and
``lora_specs.lora_spec`` hands it to the kernels while the parameter is still its view.

A group is widened when it pays: its projections' outputs together are wider than its input (q/k/v,
gate/up; the gated MLP's down projection always, its input being written in place by the GLU
kernel), and only weights fasttune may re-home: plain dense tensors in the compute dtype that own
their storage (not FSDP shards or views of flat buffers, not DeepSpeed ZeRO-3 partitions, not FP8
bases, whose codes cannot hold the 16-bit B columns and whose rank-r term must keep its precision,
so FP8 groups keep the two-product path). A group of NF4 bases is widened by the same rule without
re-homing anything: each gets a ``BorderedNf4`` (the layout only; every product dequantises into a
widened buffer of its own, ``lora_wide.py``), unless its codes are a tensor subclass (FSDP2) or
ZeRO-3 partitions, or (on CUDA) a width is not a multiple of 512 (``nf4.fast_rows_apart``). Memory: R = Σ r_p rounded up to
``TAIL_MULTIPLE`` (64) columns per weight, +1.2% of an 8B model's weights at r = 16. Widening
happens at a projection group's first fused call, not at patch time: FSDP shards the model after
fasttune patches it and refuses strided parameters.
``unwiden`` (run by ``unpatch_model``) gives every parameter contiguous storage back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.lora import BaseWeight
from ..kernels.lora_wide import TAIL_MULTIPLE, BorderedNf4, WideWeight
from ..kernels.nf4 import fast_rows_apart
from .module_attr import base_layer_of, module_attr
from .zero3 import is_zero3_param

__all__ = ["WIDE_ATTR", "owns_storage", "widen_group", "unwiden", "wide_of"]

WIDE_ATTR = "_fasttune_wide"


def wide_of(layer: nn.Module, weight: torch.Tensor, quant_state=None):
    """The layer's ``WideWeight`` when ``weight`` still lives in it (its ``BorderedNf4`` when these are
    still its NF4 codes and ``quant_state``); a stale one (the parameter was moved or re-homed since, by
    ``.to()``, FSDP or a merge) is dropped, freeing its buffer."""
    wide = layer.__dict__.get(WIDE_ATTR)
    if wide is None:
        return None
    if wide.holds(weight, quant_state):
        return wide
    del layer.__dict__[WIDE_ATTR]
    return None


def owns_storage(weight: torch.Tensor) -> bool:
    """A plain contiguous tensor that is the whole of its storage (not a view into a flat or
    all-gather buffer, not a tensor subclass such as FSDP2's DTensor)."""
    data = weight.data
    return (type(data) is torch.Tensor and data.is_contiguous() and data.storage_offset() == 0
            and data.untyped_storage().nbytes() == data.numel() * data.element_size())


def _can_widen(layer: nn.Module, base: BaseWeight, dtype: torch.dtype) -> bool:
    weight = module_attr(layer, "weight")
    return (isinstance(layer, nn.Linear) and isinstance(weight, nn.Parameter) and base.weight is weight
            and not base.is_nf4 and not base.is_fp8 and not weight.requires_grad and weight.dtype == dtype
            and not is_zero3_param(weight) and (base.wide is not None or owns_storage(weight)))


def _can_border(layer: nn.Module, base: BaseWeight, dtype: torch.dtype, extra: int) -> bool:
    weight = module_attr(layer, "weight")
    # On CUDA only widths whose rows-apart store runs near the contiguous rate (multiples of 512: every
    # Llama/Qwen3 8B and Qwen2.5-7B projection): the slower store costs about what the rank-r passes save
    # (RESULTS.md).
    return (isinstance(layer, nn.Linear) and base.is_nf4 and type(base.weight) is torch.Tensor
            and dtype in (torch.float32, torch.float16, torch.bfloat16) and not is_zero3_param(weight)
            and fast_rows_apart(base.shape[1], base.shape[1] + extra, base.weight.device))


def _border(layer: nn.Module, base: BaseWeight, extra: int, dtype: torch.dtype) -> BorderedNf4:
    wide = BorderedNf4(base.weight, base.quant_state, extra, dtype)
    layer.__dict__[WIDE_ATTR] = wide
    return wide


def _widen(layer: nn.Module, extra: int) -> WideWeight:
    weight = layer.weight
    out_f, in_f = weight.shape
    with torch.no_grad():
        buf = torch.zeros((out_f, in_f + extra), dtype=weight.dtype, device=weight.device)
        buf[:, :in_f].copy_(weight)
        wide = WideWeight(buf, in_f)
        weight.data = wide.weight_view()
    layer.__dict__[WIDE_ATTR] = wide
    return wide


def widen_group(projections: list[nn.Module], specs: list, dtype: torch.dtype, input_copied: bool = True) -> list:
    """``specs`` (``(BaseWeight, A, B, s)`` per projection) with every base widened, when the group
    qualifies (module docstring); else ``specs`` unchanged.

    Args:
        projections: the group's projection modules (PEFT LoRA layers or plain linears), in the
            column order of their stacked XA.
        specs: their ``lora_spec``s.
        dtype: the compute dtype of the call (the autocast dtype under autocast).
        input_copied: the widened input costs a copy of X (False: the producer writes it there).
    """
    ranks = sum(spec[1].shape[0] for spec in specs if spec[1] is not None)
    if ranks == 0:
        return specs
    extra = -(-ranks // TAIL_MULTIPLE) * TAIL_MULTIPLE
    bases = [spec[0] for spec in specs]
    tails = {None if b.wide is None else b.wide.extra for b in bases}
    if len(tails) == 1 and None not in tails and tails.pop() >= ranks:
        return specs  # widened already, with room for these adapters
    if input_copied and sum(b.shape[0] for b in bases) <= bases[0].shape[1]:
        return specs  # copying X would cost as much as the rank-r passes it saves
    layers = [base_layer_of(p) for p in projections]
    if all(b.is_nf4 for b in bases):  # NF4: the layout only, nothing re-homed
        if not all(_can_border(layer, base, dtype, extra) for layer, base in zip(layers, bases)):
            return specs
        return [(BaseWeight(spec[0].weight, spec[0].quant_state, spec[0].bias, _border(layer, spec[0], extra, dtype)),
                 *spec[1:]) for layer, spec in zip(layers, specs)]
    if not all(_can_widen(layer, base, dtype) for layer, base in zip(layers, bases)):
        return specs  # FP8, a mix with NF4, or a weight fasttune may not re-home
    out = []
    for layer, spec in zip(layers, specs):
        base = spec[0]
        wide = base.wide if base.wide is not None and base.wide.extra == extra else _widen(layer, extra)
        out.append((BaseWeight(layer.weight, None, base.bias, wide), *spec[1:]))
    return out


def unwiden(model: nn.Module) -> None:
    """Give every widened weight of ``model`` contiguous storage of its own and drop the buffers."""
    for module in model.modules():
        wide = module.__dict__.pop(WIDE_ATTR, None)
        weight = getattr(module, "weight", None)
        if isinstance(wide, WideWeight) and isinstance(weight, torch.Tensor) and wide.holds(weight):
            with torch.no_grad():
                weight.data = weight.data.contiguous()


class Unwiden:
    """``unwiden`` as an undo step of a PatchReport (an object: deep copies of the model copy it)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self) -> None:
        unwiden(self.model)
