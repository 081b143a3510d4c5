"""Each token's sum over its k expert rows, in one pass.

The expert MLP computes one row per (token, slot) pair, sorted by expert; ``inverse[t·k + j]`` is
the row of token t's slot j. The token's output (and, in backward, its input gradient) is

    out[t] = Σ_j rows[inverse[t·k + j]]        (fp32 accumulation in slot order, one rounding)

In plain torch that is a gather of all S = T·k rows into a new [S, N] tensor, a sum over k in fp32
and a cast: the S rows are written once and read twice more. The kernel reads each row once and
writes [T, N]: one program per (token, column block), the k row indices loaded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import cdiv, check_float, check_same_device, next_power_of_2, use_triton

MAX_BLOCK = 1024


@triton.jit
def _combine_kernel(
    rows_ptr,  # [S, N] float32/float16/bfloat16, unit column stride
    inverse_ptr,  # [S] int64/int32: row of token t's slot j at t·K + j
    out_ptr,  # [T, N] any float dtype, unit column stride
    n_cols, stride_r, stride_o,
    K: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inverse_ptr + t * K + j).to(tl.int64)
        acc += tl.load(rows_ptr + r * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reference_combine(rows: torch.Tensor, inverse: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The same in plain torch (gather, fp32 sum over the k slots, cast)."""
    return rows[inverse].view(inverse.numel() // k, k, -1).sum(dim=1, dtype=torch.float32).to(dtype)


def combine_rows(rows: torch.Tensor, inverse: torch.Tensor, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, N] sums of each token's k rows (module docstring), in ``dtype`` (default: rows' dtype).

    Args:
        rows: [S, N] float32/float16/bfloat16 with unit column stride, S = T·k.
        inverse: [S] int64/int32, a permutation of the rows: inverse[t·k + j] is token t's slot j.
        k: slots per token (≥ 1).
        dtype: of the output.

    Raises:
        ValueError naming the argument for shapes that do not fit.
    """
    check_float("rows", rows)
    dtype = rows.dtype if dtype is None else dtype
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int ≥ 1, got {k!r}")
    if rows.dim() != 2 or rows.stride(-1) != 1:
        raise ValueError(f"rows must be [S, N] with unit column stride, got {tuple(rows.shape)} {rows.stride()}")
    if inverse.dim() != 1 or inverse.numel() != rows.shape[0] or inverse.numel() % k:
        raise ValueError(f"inverse must be [S = {rows.shape[0]}] with S a multiple of k = {k}, got "
                         f"{tuple(inverse.shape)}")
    if inverse.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"inverse must be int64 or int32, got {inverse.dtype}")
    check_same_device(rows=rows, inverse=inverse)
    if not use_triton(rows, inverse):
        return reference_combine(rows, inverse, k, dtype)
    T, n_cols = inverse.numel() // k, rows.shape[1]
    out = torch.empty(T, n_cols, dtype=dtype, device=rows.device)  # every element stored
    if out.numel():
        block = min(MAX_BLOCK, next_power_of_2(n_cols))
        _combine_kernel[(T, cdiv(n_cols, block))](rows, inverse, out, n_cols, rows.stride(0), out.stride(0),
                                                 K=k, BLOCK=block)
    return out


__all__ = ["combine_rows", "reference_combine"]
