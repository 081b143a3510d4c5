"""A stacked expert weight with spare rank columns: LoRA's B rides in the grouped product.

An expert projection with LoRA computes, per row of expert e, y = z Wₑᵀ + (s·z Aₑᵀ) Bₑᵀ. As
separate products (``grouped_mlp``'s plain path) the rank-r term is an extra grouped product
writing [rows, out] and an add over it: two memory-bound passes over the output (~0.3 ms per
Qwen3-30B-A3B gate/up call at 8,192 tokens × 8 slots). Appending the rank columns to the
contraction puts it inside the base product:

    y = [z | s·z Aₑᵀ | 0] · [Wₑ | Bₑ | 0]ᵀ          (K = in + R, R ≥ r)

The weight side is never copied per call: ``WideExperts`` owns a buffer whose first ``in``
columns of the input axis are the frozen base weight itself (the parameter is re-homed as a view
of them, ``model_patches/moe_widen.py``) and whose tail receives B on every call (an optimizer
step changes B in place); the tail columns past r stay zero. The backward does not read the tail:
dY [Wₑ | Bₑ] in one product would leave dX a strided column view, slower to add to (docs/FACTS.md).

Layouts (``transposed`` as in ``moe_reference.ExpertProjection``):
    False (Qwen3-MoE, Mixtral): W [E, out, in] = buf[:, :, :in] of buf [E, out, in + R];
    True (gpt-oss):            W [E, in, out] = buf[:, :in, :] of buf [E, in + R, out].

With B = 0 (a fresh adapter) or no adapter (a zero tail) the tail products are exact zeros.
"""

from __future__ import annotations

import torch

__all__ = ["WideExperts", "RANK_MULTIPLE"]

RANK_MULTIPLE = 16  # tails padded to 16 columns: 16-bit rows stay 32-byte aligned (torch's grouped GEMM needs 16)


class WideExperts:
    """A frozen stacked expert weight stored inside a buffer with ``extra`` spare input columns.

    Args:
        buf: contiguous [E, out, in + R] (``transposed`` False) or [E, in + R, out] (True), R ≥ 1.
        in_features: in.
        transposed: the weight's layout.

    Not copied by ``copy.deepcopy`` (a deep-copied model's weights are plain tensors).
    """

    __slots__ = ("buf", "in_features", "transposed", "_rank")

    def __init__(self, buf: torch.Tensor, in_features: int, transposed: bool):
        axis = 1 if transposed else 2
        if buf.dim() != 3 or not buf.is_contiguous() or not 0 < in_features < buf.shape[axis]:
            raise ValueError(f"buf must be a contiguous 3-D tensor with more than in_features={in_features} "
                             f"columns on axis {axis}, got {tuple(buf.shape)}")
        self.buf, self.in_features, self.transposed = buf, in_features, bool(transposed)
        self._rank = -1  # columns of B in the tail at the last load (-1: never loaded; the tail is zero)

    @property
    def extra(self) -> int:
        """R, the tail width."""
        return self.buf.shape[1 if self.transposed else 2] - self.in_features

    def weight_view(self) -> torch.Tensor:
        """The weight as the model's parameter holds it."""
        return self.buf[:, : self.in_features] if self.transposed else self.buf[:, :, : self.in_features]

    def holds(self, weight: torch.Tensor) -> bool:
        """``weight`` is still the view of this buffer (a ``.to()`` or a sharder re-homes it)."""
        view = self.weight_view()
        return (weight.data_ptr() == view.data_ptr() and weight.dtype == view.dtype and weight.device == view.device
                and weight.shape == view.shape and weight.stride() == view.stride())

    def kn(self) -> torch.Tensor:
        """[E, in + R, out]: the rows' product z_wide @ kn[e]."""
        return self.buf if self.transposed else self.buf.transpose(1, 2)

    def load(self, b: torch.Tensor | None) -> None:
        """Put B [E, out, r] in the tail (None: a zero tail); the columns past r stay zero."""
        rank = 0 if b is None else b.shape[2]
        if rank > self.extra:
            raise ValueError(f"B has rank {rank}, the tail holds {self.extra} columns")
        tail = self.buf[:, self.in_features:] if self.transposed else self.buf[:, :, self.in_features:]
        with torch.no_grad():
            if rank < self._rank:  # a smaller rank than last time (or none): clear the stale columns
                tail.zero_()
            self._rank = rank
            if b is not None:
                if self.transposed:
                    tail[:, :rank].copy_(b.transpose(1, 2))
                else:
                    tail[:, :, :rank].copy_(b)

    def __deepcopy__(self, memo):
        return None
