"""Re-home frozen stacked expert weights so the experts' LoRA rank-r terms ride in the grouped products.

``kernels/moe_wide.py`` computes an expert projection with LoRA, forward and input gradient, as one
product each with the bordered matrix [[W, s·B], [A, 0]], which needs the weight to be a view of a
buffer with R spare rows and columns. This
module moves a MoE block's ``gate_up_proj`` / ``down_proj`` there: a zero buffer is allocated,
W is copied in and the parameter's ``.data`` becomes the view (the same Parameter object, so
optimizers, hooks and state dicts are unaffected; ``save_pretrained`` and fasttune's exports copy
it contiguous). The ``WideExperts`` are kept on the experts module (``WIDE_EXPERTS_ATTR``, by
parameter name) and handed to the kernels while the parameter is still their view.

Widened: frozen plain dense weights in the compute dtype that own their storage, on a device the
kernels run on (not FSDP shards, DeepSpeed ZeRO-3 partitions or NF4 experts), with a PEFT
adapter on that parameter; R = the largest adapter rank there, rounded up to ``RANK_MULTIPLE``
(+1.8% of a Qwen3-30B-A3B gate/up weight, +2.9% of its down weight at r = 16).
At the first fused call, not at patch time (FSDP shards the model after fasttune patches it).
``unwiden_experts`` (an undo step of ``patch_moe``) gives every parameter contiguous storage back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels._backend import use_triton
from ..kernels.moe_wide import RANK_MULTIPLE, WideExperts
from .lora_widen import owns_storage
from .zero3 import is_zero3_param

__all__ = ["WIDE_EXPERTS_ATTR", "UnwidenExperts", "unwiden_experts", "wide_experts"]

WIDE_EXPERTS_ATTR = "_fasttune_wide_experts"


def _can_widen(weight, held: WideExperts | None) -> bool:
    return (isinstance(weight, nn.Parameter) and type(weight.data) is torch.Tensor and weight.dim() == 3
            and not weight.requires_grad and weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and not is_zero3_param(weight) and use_triton(weight) and (held is not None or owns_storage(weight)))


def wide_experts(experts: nn.Module, name: str, rank: int, transposed: bool) -> WideExperts | None:
    """The ``WideExperts`` holding ``experts.<name>`` with a border for ``rank``, widening it now
    where it qualifies (module docstring); None where it does not."""
    store = experts.__dict__.setdefault(WIDE_EXPERTS_ATTR, {})
    weight = getattr(experts, name, None)
    held = store.get(name)
    if held is not None and not held.holds(weight):
        held = None  # moved or re-homed since (.to(), a sharder): the stale buffer is dropped
    if held is not None and held.extra >= rank:
        return held
    store.pop(name, None)
    if rank < 1 or not _can_widen(weight, held):
        return None
    E, rows, cols = weight.shape
    extra = -(-rank // RANK_MULTIPLE) * RANK_MULTIPLE
    n_in, n_out = (rows, cols) if transposed else (cols, rows)
    with torch.no_grad():
        buf = torch.zeros(E, rows + extra, cols + extra, dtype=weight.dtype, device=weight.device)
        wide = WideExperts(buf, n_in, n_out, transposed)
        wide.weight_view().copy_(weight)
        weight.data = wide.weight_view()
    if buf.is_cuda:
        # The replaced weight's memory is a hole a little smaller than the next layer's buffer: hand the
        # holes back at once (one sync per widened weight, at its first call) or they stay reserved
        # (Qwen3-30B-A3B ×8: 16.45 GiB reserved for 13.5 allocated without this).
        torch.cuda.empty_cache()
    store[name] = wide
    return wide


def unwiden_experts(model: nn.Module) -> None:
    """Give every widened expert weight of ``model`` contiguous storage of its own; drop the buffers."""
    for module in model.modules():
        store = module.__dict__.pop(WIDE_EXPERTS_ATTR, None) or {}
        for name, wide in store.items():
            weight = getattr(module, name, None)
            if wide is not None and isinstance(weight, torch.Tensor) and wide.holds(weight):
                with torch.no_grad():
                    weight.data = weight.data.contiguous()


class UnwidenExperts:
    """``unwiden_experts`` as an undo step of a PatchReport (an object: deep copies of the model copy it)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self) -> None:
        unwiden_experts(self.model)
