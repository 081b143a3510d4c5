"""A stacked expert weight bordered by its LoRA factors: the rank-r terms ride in the grouped products.

An expert projection with LoRA computes, per row of expert e, y = z Wₑᵀ + s·(z Aₑᵀ) Bₑᵀ, and its
input gradient is dz = dY Wₑ + s·(dY Bₑ) Aₑ. As separate products (``grouped_mlp``'s plain path)
each rank-r term is an extra grouped product writing a full-width output and an add over it: two
memory-bound passes (~0.3 ms per Qwen3-30B-A3B gate/up call at 8,192 tokens × 8 slots, forward and
again backward). ``WideExperts`` owns, per expert, the bordered matrix

    Mₑ = [[ Wₑ   s·Bₑ  0 ]      [out + R, in + R], R ≥ r (``RANK_MULTIPLE`` columns)
          [ Aₑ   0     0 ]
          [ 0    0     0 ]]

so that both directions are one product each, with one fp32 accumulation:

    forward:   [z | z Aₑᵀ | 0] · Mₑ[:out]ᵀ = y
    backward:  [dY | s·dY Bₑ | 0] · Mₑ[:, :in] = dz

The frozen base weight is never copied per call: the parameter is re-homed as the view Mₑ[:out, :in]
(``model_patches/moe_widen.py``). A and s·B are copied in at every call (``load``: an optimizer
step changes them in place), cast to the weight's dtype; the rows and columns past r stay zero.
With B = 0 (a fresh adapter) or no adapter (``load(None, None)``) the border products are exact
zeros.

Layouts (``transposed`` as in ``moe_reference.ExpertProjection``):
    False (Qwen3-MoE, Mixtral): buf [E, out + R, in + R] = Mₑ, W [E, out, in] = buf[:, :out, :in];
    True (gpt-oss):            buf [E, in + R, out + R] = Mₑᵀ, W [E, in, out] = buf[:, :in, :out].
"""

from __future__ import annotations

import torch

__all__ = ["WideExperts", "RANK_MULTIPLE"]

RANK_MULTIPLE = 16  # borders padded to 16: 16-bit rows stay 32-byte aligned (torch's grouped GEMM needs 16)


class WideExperts:
    """A frozen stacked expert weight stored inside a bordered buffer (module docstring).

    Args:
        buf: contiguous [E, out + R, in + R] (``transposed`` False) or [E, in + R, out + R] (True), R ≥ 1.
        in_features, out_features: the weight's.
        transposed: the weight's layout.

    Not copied by ``copy.deepcopy`` (a deep-copied model's weights are plain tensors).
    """

    __slots__ = ("buf", "in_features", "out_features", "transposed", "rank", "scaling")

    def __init__(self, buf: torch.Tensor, in_features: int, out_features: int, transposed: bool):
        rows, cols = (in_features, out_features) if transposed else (out_features, in_features)
        if (buf.dim() != 3 or not buf.is_contiguous() or min(in_features, out_features) < 1
                or buf.shape[1] - rows != buf.shape[2] - cols or buf.shape[1] <= rows):
            raise ValueError(f"buf must be a contiguous [E, {rows} + R, {cols} + R] tensor with R ≥ 1 "
                             f"(in_features={in_features}, out_features={out_features}, transposed={transposed}), "
                             f"got {tuple(buf.shape)}")
        self.buf, self.in_features, self.out_features = buf, in_features, out_features
        self.transposed = bool(transposed)
        self.rank = -1  # rows/columns of A and B in the border at the last load (-1: never loaded; all zero)
        self.scaling = 0.0

    @property
    def extra(self) -> int:
        """R, the border's width."""
        return self.buf.shape[2] - (self.out_features if self.transposed else self.in_features)

    def weight_view(self) -> torch.Tensor:
        """W, as the model's parameter holds it."""
        n_in, n_out = self.in_features, self.out_features
        return self.buf[:, :n_in, :n_out] if self.transposed else self.buf[:, :n_out, :n_in]

    def holds(self, weight: torch.Tensor) -> bool:
        """``weight`` is still the view of this buffer (a ``.to()`` or a sharder re-homes it)."""
        view = self.weight_view()
        return (weight.data_ptr() == view.data_ptr() and weight.dtype == view.dtype and weight.device == view.device
                and weight.shape == view.shape and weight.stride() == view.stride())

    def forward_weight(self) -> torch.Tensor:
        """[E, in + R, out] (Mₑ[:out]ᵀ): the rows' forward product [z | z Aᵀ | 0] @ it."""
        n_out = self.out_features
        return self.buf[:, :, :n_out] if self.transposed else self.buf[:, :n_out].transpose(1, 2)

    def backward_weight(self) -> torch.Tensor:
        """[E, out + R, in] (Mₑ[:, :in]): the rows' input gradient [dY | s·dY B | 0] @ it."""
        n_in = self.in_features
        return self.buf[:, :n_in, :].transpose(1, 2) if self.transposed else self.buf[:, :, :n_in]

    def lora_a(self) -> torch.Tensor:
        """A [E, r, in] as loaded (a view of the border)."""
        n_in, n_out, r = self.in_features, self.out_features, max(self.rank, 0)
        return self.buf[:, :n_in, n_out:n_out + r].transpose(1, 2) if self.transposed else \
            self.buf[:, n_out:n_out + r, :n_in]

    def scaled_lora_b(self) -> torch.Tensor:
        """s·B [E, out, r] as loaded (a view of the border)."""
        n_in, n_out, r = self.in_features, self.out_features, max(self.rank, 0)
        return self.buf[:, n_in:n_in + r, :n_out].transpose(1, 2) if self.transposed else \
            self.buf[:, :n_out, n_in:n_in + r]

    def load(self, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float = 1.0) -> None:
        """Put A [E, r, in] and s·B (B [E, out, r]) in the border (None, None: a zero border); the rows
        and columns past r stay zero."""
        if (a is None) != (b is None):
            raise ValueError("lora_a and lora_b come together")
        rank = 0 if a is None else a.shape[1]
        if rank > self.extra:
            raise ValueError(f"the adapter has rank {rank}, the border holds {self.extra}")
        n_in, n_out = self.in_features, self.out_features
        with torch.no_grad():
            if rank < self.rank:  # a smaller rank than last time (or none): clear the stale rows and columns
                if self.transposed:
                    self.buf[:, n_in:].zero_()
                    self.buf[:, :, n_out:].zero_()
                else:
                    self.buf[:, n_out:].zero_()
                    self.buf[:, :, n_in:].zero_()
            self.rank, self.scaling = rank, float(scaling)
            if a is not None:
                self.lora_a().copy_(a)
                torch.mul(b, self.scaling, out=self.scaled_lora_b())

    def __deepcopy__(self, memo):
        return None
