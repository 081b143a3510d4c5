"""A transposed contiguous copy of a 2-D one-byte tensor (FP8 codes): out[j, i] = x[i, j].

Why a kernel: the FP8 dX product (``fp8.grad_input_product``) needs the weight's codes with the
reduction dimension contiguous, i.e. Q_Wᵀ, made per call and freed at once (``fp8.py``).
``codes.t().contiguous()`` runs torch's generic strided copy, which moves one byte per thread
with uncoalesced writes: 180 µs for a 14,336 × 4,096 weight on an H200, ~40 ms of an 8B LoRA
step (benchmarks/RESULTS.md, FP8 profile). Tiles read and written row-contiguous run at the
memory's rate instead.

Runs the Triton kernel where ``_backend.use_triton`` allows, else ``t().contiguous()`` (the
same bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import cdiv, use_triton

__all__ = ["transpose_bytes"]

_TILE = 64


@triton.jit
def _transpose_kernel(x_ptr,  # [n_rows, n_cols] uint8 in, rows stride_x apart, unit column stride
                      out_ptr,  # [n_cols, n_rows] uint8 out, contiguous
                      n_rows, n_cols, stride_x,
                      BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                   mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0)
    tl.store(out_ptr + cols[:, None] * n_rows + rows[None, :], tl.trans(tile),
             mask=(cols < n_cols)[:, None] & (rows < n_rows)[None, :])


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous [cols, rows] tensor holding x [rows, cols] transposed (x's dtype, one byte
    per element: uint8, int8 or a float8 type)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.element_size() != 1:
        raise ValueError("x must be a 2-D tensor of one-byte elements (uint8, int8, float8)")
    rows, cols = x.shape
    if not use_triton(x) or x.numel() == 0:
        return x.t().contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)  # every element stored
    grid = (cdiv(rows, _TILE), cdiv(cols, _TILE))
    _transpose_kernel[grid](x.view(torch.uint8), out.view(torch.uint8), rows, cols, x.stride(0),
                            BLOCK=_TILE, num_warps=4)
    return out
