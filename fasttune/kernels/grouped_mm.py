"""Grouped matrix products of the expert MLP: every expert's rows times that expert's matrix, in one launch.

Rows sorted by group (expert), ``offs`` [E] int32 the inclusive end row of each group (a group may
be empty). Two products:

    grouped_mm(x [S, K], w [E, K, N], offs)         y[r] = x[r] @ w[g(r)]                 -> [S, N]
    grouped_mm_wgrad(a [S, M], b [S, N], offs, E)   out[g] = Σ_{r in g} a[r]ᵀ b[r]        -> [E, M, N]

(the forward/input-gradient product and the weight-gradient product; ``w`` may be any strided view,
e.g. ``weight.transpose(1, 2)``). An empty group contributes no rows to ``grouped_mm`` and a zero
matrix to ``grouped_mm_wgrad``.

Where each runs (first that fits): ``torch._grouped_mm`` (CUDA, bf16, 16-byte aligned rows: the
CUTLASS kernel, Hopper and newer); the Triton kernels below (CUDA, or CPU under
``TRITON_INTERPRET=1``); else ``moe_reference`` (a loop of plain products).

Triton kernels. ``_grouped_mm_kernel``: one program per (row tile of one group, column tile); the
row tiles of all groups are numbered one after another (``tile_ends`` = inclusive cumsum of
ceil(rows_g / BLOCK_M)), and a program finds its group by counting the ends ≤ its tile number —
no host sync. The grid holds ceil(S / BLOCK_M) + E row tiles, an upper bound; programs past the
last tile return (on CPU tensors the exact count is read: no dead programs in the interpreter).
``_grouped_wgrad_kernel``: one program per (group, M tile, N tile), a loop over
the group's rows (zero iterations for an empty group: it stores zeros). Products accumulate in
fp32 (fp32 operands: IEEE products, no TF32), one rounding at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe_reference as reference
from ._backend import cdiv, check_float, check_same_device, interpreter_on, next_power_of_2, use_triton

__all__ = ["grouped_mm", "grouped_mm_wgrad"]


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _grouped_mm_kernel(
    x_ptr,  # [S, K] rows sorted by group
    w_ptr,  # [E, K, N] any strides
    y_ptr,  # [S, N] output
    offs_ptr,  # [E] int32 inclusive row end of each group
    tile_ends_ptr,  # [E] int32 inclusive cumsum of each group's row tiles
    num_groups, size_k, size_n,
    stride_xs, stride_xk, stride_we, stride_wk, stride_wn, stride_ys, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS_POW2: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    gs = tl.arange(0, GROUPS_POW2)
    ends = tl.load(tile_ends_ptr + gs, mask=gs < num_groups, other=2147483647)
    g = tl.sum((ends <= tile).to(tl.int32), axis=0)  # the groups whose tiles all come before this one
    if g >= num_groups:
        return
    first_tile = tl.load(tile_ends_ptr + g - 1, mask=g > 0, other=0)
    row_lo = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    row_hi = tl.load(offs_ptr + g)
    rows = row_lo + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_hi
    col_ok = cols < size_n
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + g.to(tl.int64) * stride_we
    for k0 in range(0, size_k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < size_k
        a = tl.load(x_ptr + rows64[:, None] * stride_xs + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)  # 16-bit operands, fp32 accumulation
    tl.store(y_ptr + rows64[:, None] * stride_ys + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,  # [S, M] rows sorted by group
    b_ptr,  # [S, N] rows sorted by group
    out_ptr,  # [E, M, N] output
    offs_ptr,  # [E] int32 inclusive row end of each group
    size_m, size_n,
    stride_as, stride_am, stride_bs, stride_bn, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    row_lo = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    row_hi = tl.load(offs_ptr + g)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < size_m
    n_ok = ns < size_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_lo, row_hi, BLOCK_S):
        rs = r0 + tl.arange(0, BLOCK_S)
        r_ok = rs < row_hi
        rs64 = rs.to(tl.int64)
        at = tl.load(a_ptr + rs64[None, :] * stride_as + ms[:, None] * stride_am,
                     mask=m_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_S] = a_gᵀ tile
        b = tl.load(b_ptr + rs64[:, None] * stride_bs + ns[None, :] * stride_bn,
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(at.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(at, b, acc)
    out = out_ptr + g.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def _blocks(interpret: bool) -> tuple[int, int, int]:
    # The interpreter's cost is per program, nearly independent of the tile: keep programs few.
    return (64, 64, 64) if interpret else (64, 128, 32)


def _triton_mm(x, w, offs):
    S, K = x.shape
    E, _, N = w.shape
    y = torch.empty(S, N, dtype=x.dtype, device=x.device)  # every row belongs to a group: all stored
    if S == 0 or N == 0:
        return y
    bm, bn, bk = _blocks(interpreter_on())
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_ends = torch.cumsum((counts + bm - 1) // bm, 0, dtype=torch.int32)
    # An upper bound on the row tiles without a host sync; the exact count where reading it is free
    # (CPU tensors under the interpreter, whose cost is per program).
    n_tiles = int(tile_ends[-1]) if x.device.type == "cpu" else cdiv(S, bm) + E
    grid = (n_tiles, cdiv(N, bn))
    _grouped_mm_kernel[grid](
        x, w, y, offs, tile_ends, E, K, N,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUPS_POW2=next_power_of_2(E),
        IEEE=x.dtype == torch.float32 or interpreter_on(),
    )
    return y


def _triton_wgrad(a, b, offs, num_groups):
    M, N = a.shape[1], b.shape[1]
    out = torch.empty(num_groups, M, N, dtype=a.dtype, device=a.device)  # every element stored
    if out.numel() == 0:
        return out
    bm, bn, bs = _blocks(interpreter_on())
    grid = (num_groups, cdiv(M, bm), cdiv(N, bn))
    _grouped_wgrad_kernel[grid](
        a, b, out, offs, M, N,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_S=bs, IEEE=a.dtype == torch.float32 or interpreter_on(),
    )
    return out


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned start, a unit stride in one of the last two dims, the other a multiple of 16 bytes."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    inner = [t.stride(-1), t.stride(-2)]
    if 1 not in inner:
        return False
    other = inner[1] if inner[0] == 1 else inner[0]
    return (other * size) % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-2])


def _torch_grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


_MAJOR: dict[int, int] = {}  # compute capability major per CUDA device index (a query costs microseconds a call)


def _major(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _MAJOR.get(index)
    if major is None:
        major = _MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return major


def _torch_fits(*ts: torch.Tensor) -> bool:
    """torch's CUTLASS grouped GEMM takes these: CUDA, bf16, aligned, compute capability ≥ 9.0."""
    if _torch_grouped_mm() is None or not all(t.is_cuda and t.dtype == torch.bfloat16 for t in ts):
        return False
    if _major(ts[0].device) < 9:
        return False
    return all(_aligned(t) and t.shape[-1] % 8 == 0 for t in ts)


# --------------------------------------------------------------------------------------------
# public
# --------------------------------------------------------------------------------------------


def _check_offs(offs, num_groups):
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != num_groups:
        raise ValueError(f"offs must be int32 [{num_groups}] (inclusive row ends), got {offs.dtype} "
                         f"{tuple(offs.shape)}")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group g of ``x`` times ``w[g]`` (module docstring), in x's dtype. Not differentiable
    by itself: the expert MLP's autograd Function calls it in forward and backward.

    Args:
        x: [S, K] float32/float16/bfloat16, rows sorted by group; every row in some group.
        w: [E, K, N], same dtype (any strides).
        offs: [E] int32 inclusive row end of each group; ``offs[-1] == S``.
    """
    check_float("x", x)
    if w.dtype != x.dtype:
        raise TypeError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    if x.dim() != 2 or w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"x [S, K] and w [E, K, N] must agree, got {tuple(x.shape)} and {tuple(w.shape)}")
    _check_offs(offs, w.shape[0])
    check_same_device(x=x, w=w, offs=offs)
    if _torch_fits(x, w) and x.shape[0] > 0:
        return _torch_grouped_mm()(x, w, offs=offs)
    if use_triton(x, w, offs):
        return _triton_mm(x, w, offs)
    return reference.grouped_mm(x, w, offs)


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Σ over the rows r of group g of a[r]ᵀ b[r], per group (module docstring), in a's dtype.

    Args:
        a: [S, M] float32/float16/bfloat16, rows sorted by group.
        b: [S, N], same dtype.
        offs: [E] int32 inclusive row end of each group.
        num_groups: E.
    """
    check_float("a", a)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"a [S, M] and b [S, N] must agree, got {tuple(a.shape)} and {tuple(b.shape)}")
    _check_offs(offs, num_groups)
    check_same_device(a=a, b=b, offs=offs)
    if _torch_fits(a, b) and a.shape[0] > 0:
        return _torch_grouped_mm()(a.t(), b, offs=offs)
    if use_triton(a, b, offs):
        return _triton_wgrad(a, b, offs, num_groups)
    return reference.grouped_mm_wgrad(a, b, offs, num_groups)
