"""The RMSNorm backward for rows too wide to hold in registers (``rms_norm.py``'s ``_MAX_BWD_BLOCK``).

Same math as ``rms_norm.py``'s backward (its module docstring), split in two launches that read
each row in column chunks of ``BLOCK_H``:

    step 1 (only when dx is needed)  c[row] = mean(g · x̂)            one program per row
    step 2                           dx = r · (g − x̂ · c) (+ ds),    program (p, j): column chunk j
                                     dw_part[p] = Σ_rows dy · x̂'     of p's rows

Nothing here is public: ``rms_norm._bwd`` picks this path and sizes its grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import cdiv


@triton.jit
def _rms_norm_bwd_rowdot_kernel(
    dy_ptr,  # dy [rows, H], rows stride_dy apart; fp32/bf16/fp16
    x_ptr,  # the norm's input x (or s) [rows, H], rows stride_x apart
    w_ptr,  # weight [H], contiguous
    rstd_ptr,  # r [rows], fp32 (from the forward)
    c_ptr,  # out: c = mean(g · x̂) [rows], fp32
    n_cols, offset, stride_dy, stride_x,
    BLOCK_H: tl.constexpr,
):
    """Wide rows, step 1: c[row] = mean(g · x̂) over the row, chunk by chunk."""
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        acc += dy * w * x * rstd
    tl.store(c_ptr + row, tl.sum(acc, axis=0) / n_cols)


@triton.jit
def _rms_norm_bwd_chunked_kernel(
    dy_ptr,  # dy [n_rows, H], rows stride_dy apart; fp32/bf16/fp16
    ds_ptr,  # ds, the gradient added to dx [n_rows, H], rows stride_ds apart (HAS_DS only)
    x_ptr,  # the norm's input x (or s) [n_rows, H], rows stride_x apart
    w_ptr,  # weight [H], contiguous
    rstd_ptr,  # r [n_rows], fp32 (from the forward)
    c_ptr,  # c [n_rows], fp32 (from step 1; COMPUTE_DX only)
    dx_ptr,  # out: dx [n_rows, H], rows stride_dx apart; x's dtype (COMPUTE_DX only)
    dw_part_ptr,  # out: partial dw [programs, H], contiguous, fp32 (COMPUTE_DW only)
    n_rows, n_cols, rows_per_prog, offset,
    stride_dy, stride_ds, stride_x, stride_dx,
    BLOCK_H: tl.constexpr, HAS_DS: tl.constexpr, LLAMA: tl.constexpr,
    COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
):
    """Wide rows, step 2: program (p, j) does column chunk j of rows [p·R, (p+1)·R)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for row in range(row_start, row_end):  # int64 bounds: int64 row index
        rstd = tl.load(rstd_ptr + row)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = x * rstd
        if COMPUTE_DX:
            dx = (dy * w - xhat * tl.load(c_ptr + row)) * rstd
            if HAS_DS:
                dx += tl.load(ds_ptr + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if LLAMA:
                xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
            dw += dy * xhat
    if COMPUTE_DW:
        tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)


def bwd_wide_rows(dy2, ds2, x2, weight, rstd, dx, part, offset, llama, block_h, rows_per_prog):
    """Launch both steps over [n_rows, H] row tensors (unit column stride) with at least one row.

    dx: [n_rows, H] output or None (no dx); part: [programs, H] fp32 output or None (no dw), one
    row per program of ``rows_per_prog`` rows; ds2: the gradient added to dx, or None.
    """
    n_rows, n_cols = x2.shape
    need_dx, need_dw = dx is not None, part is not None
    grid = cdiv(n_rows, rows_per_prog)
    # Uninitialised is safe: step 2 reads c only when dx is needed, and then step 1 wrote every row.
    c = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if need_dx:
        _rms_norm_bwd_rowdot_kernel[(n_rows,)](
            dy2, x2, weight, rstd, c, n_cols, offset, dy2.stride(0), x2.stride(0),
            BLOCK_H=block_h, num_warps=8,
        )
    _rms_norm_bwd_chunked_kernel[(grid, cdiv(n_cols, block_h))](
        dy2, ds2, x2, weight, rstd, c, dx, part,
        n_rows, n_cols, rows_per_prog, offset,
        dy2.stride(0), ds2.stride(0) if ds2 is not None else 0, x2.stride(0), n_cols,
        BLOCK_H=block_h, HAS_DS=ds2 is not None, LLAMA=llama,
        COMPUTE_DX=need_dx, COMPUTE_DW=need_dw, num_warps=8,
    )
