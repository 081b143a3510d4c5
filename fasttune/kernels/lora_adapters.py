"""LoRA adapters in the compute dtype: B cast, A stacked per group, and X·[A_p; …]ᵀ.

PEFT keeps A [r, in] and B [out, r] in float32; the fused Functions (``lora.py``, ``lora_glu.py``)
multiply in x's dtype, as torch.autocast would, so each call casts them. The projections of one
input (q/k/v, gate/up) stack their A's: XA = X [A_p; …]ᵀ is one product and one saved [N, Σr]
tensor. In a checkpointed layer's recompute the casts and XA come back from its forward
(``forward_reuse.py``) instead of being made again.
"""

from __future__ import annotations

import torch

from . import forward_reuse
from .lora_wide import wide_columns

__all__ = ["adapters_of", "b_as", "cast_b", "stack_a", "stacked_xa"]


def adapters_of(tensors, scalings):
    """[(A, B, s) or None] per projection from the flat (A, B, A, B, ...) Function inputs."""
    return [None if tensors[2 * p] is None else (tensors[2 * p], tensors[2 * p + 1], s)
            for p, s in enumerate(scalings)]


def stack_a(adapters, dt: torch.dtype) -> torch.Tensor | None:
    """[A_p; …] in ``dt`` over the projections with an adapter (None if none has one)."""
    a_list = [ad[0].to(dt) for ad in adapters if ad is not None]
    return torch.cat(a_list) if len(a_list) > 1 else (a_list[0] if a_list else None)


def cast_b(bases, adapters, dt: torch.dtype) -> list[torch.Tensor | None]:
    """Each adapter's B in ``dt``, cast once in forward and saved for backward (None without an adapter,
    and for a widened group, whose B goes straight into its buffer's tail)."""
    if wide_columns(bases, adapters, dt) is not None:
        return [None] * len(adapters)
    bs = [None if ad is None else ad[1] for ad in adapters]
    return forward_reuse.reused("b", bs, dt, lambda: [None if b is None else b.to(dt) for b in bs])


def b_as(ad, bc: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor:
    """B of adapter ``ad`` in ``dt``: ``bc`` (its forward cast) when it is that, else cast now."""
    return bc if bc is not None and bc.dtype == dt else ad[1].to(dt)


def stacked_xa(x2: torch.Tensor, adapters) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(XA, [A_p; ...]): XA = X [A_p; ...]ᵀ for the projections p of one input that have an adapter
    (one product), and the stacked A in x's dtype, which backward reuses instead of casting again."""
    def compute():
        a = stack_a(adapters, x2.dtype)
        return (None, None) if a is None else (x2 @ a.t(), a)

    a_tensors = [ad[0] for ad in adapters if ad is not None]
    return forward_reuse.reused("xa", a_tensors, (tuple(x2.shape), x2.dtype), compute)
