"""q and k as the attention takes them: split into heads, q/k-normed and rotated in the family's order.

The orders (``FamilySpec.qk_norm``): none (Llama: heads, transpose, RoPE); "head" (Qwen3, Gemma 3,
Exaone 4: heads, norms per head, transpose, RoPE); "full" (OLMo 2: norms over the whole projection,
then heads, transpose, RoPE); "head_after_rope" (Hunyuan: heads, transpose, RoPE, norms per head).

In a stashed core (``attention_stash.py``) what follows the norms' inputs is registered with the stash
(``LayerStash.remakes``): the attention's saved q/k are then made again from those inputs in backward
(``stash_remake.py``) instead of going to the host beside them.
"""

from __future__ import annotations

from typing import Callable

import torch

from .instance import graphless_training

_BEFORE_NORMS = {"full": (), "head": ("heads",), "head_after_rope": ("heads", "transpose", "rope")}
_AFTER_NORMS = {"full": ("heads", "transpose", "rope"), "head": ("transpose", "rope"), "head_after_rope": ()}
_NO_NORMS = ("heads", "transpose", "rope")


def attention_qk(q: torch.Tensor, k: torch.Tensor, heads_shape: tuple, qk_norm: str | None,
                 norms: tuple | None, rope: Callable | None, stash=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [B, heads, S, head_dim] from the projections' [..., heads*head_dim].

    ``qk_norm``: the order above (None: no norms); ``norms``: the (q_norm, k_norm) modules; ``rope``:
    (q, k) -> rotated (q, k), or None in a layer that does not rotate; ``stash``: the running layer's
    ``LayerStash`` where the core may be stashed."""

    def step(name: str, q, k):
        if name == "heads":
            return q.reshape(heads_shape), k.reshape(heads_shape)
        if name == "transpose":
            return q.transpose(1, 2), k.transpose(1, 2)
        return (q, k) if rope is None else rope(q, k)

    if qk_norm is None:
        for name in _NO_NORMS:
            q, k = step(name, q, k)
        return q, k
    for name in _BEFORE_NORMS[qk_norm]:
        q, k = step(name, q, k)

    def from_norms(q, k):
        q, k = norms[0](q), norms[1](k)
        for name in _AFTER_NORMS[qk_norm]:
            q, k = step(name, q, k)
        return q, k

    out = from_norms(q, k)
    if stash is not None:
        stash.remakes((q, k), out, _remake(from_norms))
    return out


def _remake(from_norms: Callable) -> Callable:
    """``from_norms`` in backward: without autograd, on the training path (no decode-step shortcut)."""

    def remake(q, k):
        with torch.no_grad(), graphless_training():
            return from_norms(q, k)

    return remake


__all__ = ["attention_qk"]
