"""RMSNorm, RMSNorm fused with the residual add before it, and RMSNorm passing its input through
for the residual add after it (``rms_norm_keep``: its backward adds that add's gradient), with
hand-written backward.

Forward, per row x of width H (for ``rms_norm_add`` x is s = x + residual, rounded to x's dtype):

    r     = 1 / sqrt(mean(x²) + eps)                      fp32, saved per row
    x̂     = x · r                                         fp32
    llama: y = (offset + w) · round(x̂, x.dtype)           dtype promote(x, w)  (LlamaRMSNorm)
    gemma: y = round(x̂ · (offset + w), x.dtype)           all fp32              (Gemma, OLMo2)

Backward, dy the gradient of y, all in fp32:

    g     = dy · (offset + w)                             gradient reaching x̂ (llama: the cast of
                                                          x̂ to x.dtype passes the gradient through,
                                                          as autograd does)
    c     = mean(g · x̂)                                   one scalar per row
    dx    = r · (g − x̂ · c)                               (+ ds: the gradient of s for rms_norm_add,
                                                          of the passed-through x for rms_norm_keep)
    dw    = Σ_rows dy · x̂'                                x̂' = round(x̂, x.dtype) for llama, x̂ for gemma

The column sum dw is done without atomics: each program loops over its own slice of rows, keeps
an fp32 partial sum in registers and writes one row of an fp32 [programs, H] buffer; a torch sum
over that small buffer finishes it. ``rms_norm_add`` returns the same tensor as the gradient of x
and of residual (both equal d s), as Liger does; autograd copies before accumulating into it.

Saved for backward: the norm's input (x, or s) and r; nothing of size [rows, H] is kept beyond the
input. A frozen weight (requires_grad False) skips the dw work entirely.

Dtypes: x, residual and weight in float32, bfloat16 or float16 (x and residual alike). Any leading
shape; rows are flattened, and a tensor whose rows are not a single stride apart (or whose last
dim is strided) is copied to contiguous first. Rows wider than ``_MAX_FWD_BLOCK`` /
``_MAX_BWD_BLOCK`` elements take a slower chunked path that reads the row twice (the backward's
is in ``_rms_norm_wide.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import reference
from ._backend import cdiv, check_float, check_same_device, next_power_of_2, use_triton
from ._rms_norm_wide import bwd_wide_rows
from .spare_columns import SpareColumns, output_rows

__all__ = ["rms_norm", "rms_norm_add", "rms_norm_keep", "RMSNormFunction", "RMSNormAddFunction", "RMSNormKeepFunction"]

_MAX_FWD_BLOCK = 16384  # widest row the forward keeps in registers; wider rows loop over chunks
_MAX_BWD_BLOCK = 8192  # the backward keeps ~5 row-sized fp32 values per element: narrower limit
_CHUNK = 4096  # chunk width of the looped paths
_TILE = 4096  # elements per forward tile (narrow rows are stacked up to this)
_BWD_TILE = 4096  # elements per backward step of one program
_BWD_PROGRAMS_PER_SM = 2  # backward programs per SM: each writes one fp32 row of partial dw


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_norm_input(x_ptr,  # x [rows, H], rows stride_x apart; fp32/bf16/fp16
                     res_ptr,  # residual [rows, H], x's dtype (read when HAS_RES)
                     s_ptr,  # s = x + residual [rows, H], x's dtype (written when STORE_S)
                     rows, cols, mask, stride_x, stride_res, stride_s,
                     HAS_RES: tl.constexpr, STORE_S: tl.constexpr):
    """The norm's input tile in fp32: x, or s = round(x + residual) (stored when STORE_S)."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        s = (x + res.to(tl.float32)).to(s_ptr.dtype.element_ty)
        if STORE_S:
            tl.store(s_ptr + rows[:, None] * stride_s + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # x [n_rows, H], rows stride_x apart; fp32/bf16/fp16
    res_ptr,  # residual [n_rows, H], x's dtype (HAS_RES only)
    w_ptr,  # weight [H], contiguous; fp32/bf16/fp16
    y_ptr,  # out: y [n_rows, H], rows stride_y apart; promote(x, w) (llama) or x's dtype (gemma)
    s_ptr,  # out: s = x + residual [n_rows, H], x's dtype (HAS_RES only)
    rstd_ptr,  # out: r [n_rows], fp32
    n_rows, n_cols, eps, offset,
    stride_x, stride_res, stride_y, stride_s,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr,
    LLAMA: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    if SINGLE_TILE:
        col_mask = offs < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_norm_input(x_ptr, res_ptr, s_ptr, rows, offs, mask, stride_x, stride_res, stride_s, HAS_RES, True)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        w = tl.load(w_ptr + offs, mask=col_mask, other=0.0).to(tl.float32) + offset
        xhat = x * rstd[:, None]
        if LLAMA:
            xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = xhat * w[None, :]
        tl.store(y_ptr + rows[:, None] * stride_y + offs[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Wide rows: pass 1 sums squares (and writes s), pass 2 recomputes s and writes y.
        acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK_H):
            cols = c0 + offs
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = _load_norm_input(x_ptr, res_ptr, s_ptr, rows, cols, mask, stride_x, stride_res, stride_s,
                                 HAS_RES, True)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        for c0 in range(0, n_cols, BLOCK_H):
            cols = c0 + offs
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_norm_input(x_ptr, res_ptr, s_ptr, rows, cols, mask, stride_x, stride_res, stride_s,
                                 HAS_RES, False)
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
            xhat = x * rstd[:, None]
            if LLAMA:
                xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
            y = xhat * w[None, :]
            tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_load_rows(dy_ptr,  # dy [n_rows, H], rows stride_dy apart; fp32/bf16/fp16
                   ds_ptr,  # ds [n_rows, H], rows stride_ds apart (HAS_DS only)
                   x_ptr,  # the norm's input x (or s) [n_rows, H], rows stride_x apart
                   rstd_ptr,  # r [n_rows], fp32
                   rb, n_rows, offs, col_mask, stride_dy, stride_ds, stride_x,
                   BLOCK_ROWS: tl.constexpr, HAS_DS: tl.constexpr):
    """Raw (not yet upcast) tiles of row block rb; rows past the end load nothing."""
    rows = rb * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + offs[None, :], mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    if HAS_DS:
        ds = tl.load(ds_ptr + rows[:, None] * stride_ds + offs[None, :], mask=mask, other=0.0)
    else:
        ds = x  # placeholder, unused
    return x, dy, ds, rstd


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # dy [n_rows, H], rows stride_dy apart; fp32/bf16/fp16
    ds_ptr,  # ds, the gradient added to dx [n_rows, H], rows stride_ds apart (HAS_DS only)
    x_ptr,  # the norm's input x (or s) [n_rows, H], rows stride_x apart
    w_ptr,  # weight [H], contiguous
    rstd_ptr,  # r [n_rows], fp32 (from the forward)
    dx_ptr,  # out: dx [n_rows, H], rows stride_dx apart; x's dtype (COMPUTE_DX only)
    dw_part_ptr,  # out: partial dw [programs, H], contiguous, fp32 (COMPUTE_DW only)
    n_rows, n_cols, offset,
    stride_dy, stride_ds, stride_x, stride_dx,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DS: tl.constexpr, LLAMA: tl.constexpr,
    COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
):
    """Whole rows in registers; program p takes row blocks p, p + P, ... and writes dw_part[p].

    The next block's loads are issued before the current block's math (software pipelining by
    hand), so each program keeps memory requests in flight while it reduces and stores.
    """
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_H)
    col_mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
    x_n, dy_n, ds_n, rstd_n = _bwd_load_rows(dy_ptr, ds_ptr, x_ptr, rstd_ptr, pid, n_rows, offs, col_mask,
                                             stride_dy, stride_ds, stride_x, BLOCK_ROWS, HAS_DS)
    for rb in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), n_progs):
        x = x_n.to(tl.float32)
        dy = dy_n.to(tl.float32)
        ds = ds_n
        rstd = rstd_n
        x_n, dy_n, ds_n, rstd_n = _bwd_load_rows(dy_ptr, ds_ptr, x_ptr, rstd_ptr, rb + n_progs, n_rows, offs,
                                                 col_mask, stride_dy, stride_ds, stride_x, BLOCK_ROWS, HAS_DS)
        rows = rb * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        xhat = x * rstd[:, None]
        if COMPUTE_DX:
            g = dy * w[None, :]
            c = tl.sum(g * xhat, axis=1) / n_cols
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            if HAS_DS:
                dx += ds.to(tl.float32)
            tl.store(dx_ptr + rows[:, None] * stride_dx + offs[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if LLAMA:
                xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
            dw += dy * xhat
    if COMPUTE_DW:
        tl.store(dw_part_ptr + pid * n_cols + offs, tl.sum(dw, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[..., H] as [rows, H] with unit column stride: a view when the layout allows, else a copy."""
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_warps(elements: int) -> int:
    return max(1, min(16, elements // 512))


def _bwd_programs(device: torch.device, n_row_blocks: int, programs_per_sm: int) -> int:
    """Enough programs to fill the GPU, few enough that the [programs, H] partials stay small."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return max(1, min(n_row_blocks, sms * programs_per_sm))
    return max(1, min(n_row_blocks, 2))  # interpreter: two programs, each looping over rows


def _fwd(x, residual, weight, eps, offset, casting, spare=None):
    n_cols = x.shape[-1]
    weight = weight.contiguous()
    x2 = _as_rows(x, n_cols)
    res2 = _as_rows(residual, n_cols) if residual is not None else None
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if casting == "llama" else x.dtype
    # Rows of y may be longer than H: spare columns a widened LoRA group fills (spare_columns.py).
    y, y_row = output_rows(x.shape, out_dtype, x.device, spare)
    # The forward kernel stores every element of s (pass 1) and every row's rstd.
    s = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block_h = next_power_of_2(n_cols)
        single = block_h <= _MAX_FWD_BLOCK
        if not single:
            block_h = _CHUNK
        block_rows = max(1, min(16, _TILE // block_h)) if single else 1
        _rms_norm_fwd_kernel[(cdiv(n_rows, block_rows),)](
            x2, res2, weight, y, s, rstd,
            n_rows, n_cols, eps, offset,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, y_row,
            s.stride(0) if s is not None else 0,
            BLOCK_ROWS=block_rows, BLOCK_H=block_h, HAS_RES=residual is not None,
            LLAMA=casting == "llama", SINGLE_TILE=single, num_warps=_num_warps(block_rows * block_h),
        )
    return y, (s.view(x.shape) if s is not None else None), rstd


def _bwd(dy, ds, x, weight, rstd, offset, casting, need_dx, need_dw):
    """(dx, dw) of the norm whose input was x (s for rms_norm_add); ds adds to dx."""
    n_cols = x.shape[-1]
    if dy is None:  # the normed output was not used: only the pass-through gradient remains
        dx = (ds if ds is not None else torch.zeros_like(x)) if need_dx else None
        return dx, (torch.zeros_like(weight) if need_dw else None)
    x2, dy2, weight = _as_rows(x, n_cols), _as_rows(dy, n_cols), weight.contiguous()
    ds2 = _as_rows(ds, n_cols) if ds is not None else None
    n_rows = x2.shape[0]
    # Uninitialised is safe: dx gets every element; each program stores its whole row of the
    # dw partials (every program of the grid has rows, _bwd_programs).
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) if need_dx else None
    llama = casting == "llama"
    block_h = next_power_of_2(n_cols)
    if block_h <= _MAX_BWD_BLOCK:
        # Rows stacked up to ~_BWD_TILE elements a step; a few resident programs per SM keep
        # enough loads in flight, and the fp32 partials stay small (2·SMs·H·4 B = 4 MiB at H=4096).
        block_rows = max(1, min(16, _BWD_TILE // block_h))
        grid = _bwd_programs(x.device, cdiv(n_rows, block_rows), _BWD_PROGRAMS_PER_SM) if n_rows else 0
        part = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device) if need_dw else None
        if n_rows:
            _rms_norm_bwd_kernel[(grid,)](
                dy2, ds2, x2, weight, rstd, dx, part,
                n_rows, n_cols, offset,
                dy2.stride(0), ds2.stride(0) if ds2 is not None else 0, x2.stride(0), n_cols,
                BLOCK_ROWS=block_rows, BLOCK_H=block_h, HAS_DS=ds is not None, LLAMA=llama,
                COMPUTE_DX=need_dx, COMPUTE_DW=need_dw, num_warps=_num_warps(block_rows * block_h),
            )
    else:
        block_h = _CHUNK
        grid = _bwd_programs(x.device, n_rows, _BWD_PROGRAMS_PER_SM) if n_rows else 0
        rows_per_prog = cdiv(n_rows, grid) if grid else 0
        grid = cdiv(n_rows, rows_per_prog) if grid else 0
        part = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device) if need_dw else None
        if n_rows:
            bwd_wide_rows(dy2, ds2, x2, weight, rstd, dx, part, offset, llama, block_h, rows_per_prog)
    dw = part.sum(dim=0).to(weight.dtype) if need_dw else None
    return (dx.view(x.shape) if need_dx else None), dw


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


def _norm_forward(ctx, x, weight, eps, offset, casting, spare):
    """y of a norm of x (no residual), with x and r saved for ``_norm_backward``."""
    y, _, rstd = _fwd(x, None, weight, eps, offset, casting, spare)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset, ctx.casting = offset, casting
    ctx.set_materialize_grads(False)
    return y


def _norm_backward(ctx, dy, d_through):
    """(dx, dw, None × 4) for (x, weight, eps, offset, casting, spare); ``d_through`` adds to dx."""
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _bwd(dy, d_through, x, weight, rstd, ctx.offset, ctx.casting, need_dx, need_dw)
    return dx, dw, None, None, None, None


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x, weight); saves x and r, returns dx and dw."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting, spare=None):
        return _norm_forward(ctx, x, weight, eps, offset, casting, spare)

    @staticmethod
    def backward(ctx, dy):
        return _norm_backward(ctx, dy, None)


class RMSNormKeepFunction(torch.autograd.Function):
    """(y, x) = (rms_norm(x), x): the input passed through, so that its second use (the residual)
    sends its gradient here and dx = norm backward + that gradient is one pass (no autograd add)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting, spare=None):
        # x returned as is: autograd makes it a view whose gradient comes back here
        return _norm_forward(ctx, x, weight, eps, offset, casting, spare), x

    @staticmethod
    def backward(ctx, dy, dx_through):
        return _norm_backward(ctx, dy, dx_through)


class RMSNormAddFunction(torch.autograd.Function):
    """(y, s) = (rms_norm(x + residual), x + residual); saves s and r."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting, spare=None):
        y, s, rstd = _fwd(x, residual, weight, eps, offset, casting, spare)
        ctx.save_for_backward(s, weight, rstd)
        ctx.offset, ctx.casting = offset, casting
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        need_ds = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dsum, dw = _bwd(dy, ds, s, weight, rstd, ctx.offset, ctx.casting, need_ds, ctx.needs_input_grad[2])
        dx = dsum if ctx.needs_input_grad[0] else None
        dres = dsum if ctx.needs_input_grad[1] else None
        return dx, dres, dw, None, None, None, None


# --------------------------------------------------------------------------------------------
# public
# --------------------------------------------------------------------------------------------


def _check(x, weight, eps, casting, residual=None):
    if casting not in ("llama", "gemma"):
        raise ValueError(f"casting must be 'llama' or 'gemma', got {casting!r}")
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}] to match x's last dim, got {tuple(weight.shape)}")
    if residual is not None:
        check_float("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual dtype {residual.dtype} must equal x dtype {x.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    check_same_device(x=x, weight=weight, residual=residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0,
             casting: str = "llama", spare: SpareColumns | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension, the same function as ``reference.rms_norm``.

    Args:
        x: [..., H] activations (float32, bfloat16 or float16).
        weight: [H] scale; its gradient is computed when it requires grad.
        eps: added to mean(x²) before the inverse square root.
        offset: added to the weight (1.0 for Gemma's ``1 + w``).
        casting: "llama" (round x̂ to x's dtype, then scale; output promote(x, w)) or "gemma"
            (scale in fp32, round once to x's dtype).
        spare: the caller's ``spare_columns.SpareColumns``: the output's rows are then that many
            columns longer than H (not part of the output; a widened LoRA group fills them).

    Returns:
        The normalised tensor, shape of x (rows ``spare.width`` elements apart).
    """
    _check(x, weight, eps, casting)
    _check_spare(spare)
    if not use_triton(x, weight):
        return reference.rms_norm(x, weight, eps, offset=offset, casting=casting)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), casting, spare)


def _check_spare(spare):
    if spare is not None and not isinstance(spare, SpareColumns):
        raise TypeError(f"spare must be a SpareColumns or None, got {type(spare).__name__}")


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 offset: float = 0.0, casting: str = "llama", spare: SpareColumns | None = None):
    """The residual add fused with the norm after it: ``(rms_norm(x + residual), x + residual)``.

    One pass reads x and residual and writes both the sum and its norm; the backward adds the
    sum's own gradient to the norm's and returns it for both x and residual.

    Args:
        x, residual: [..., H], same shape and dtype.
        weight, eps, offset, casting, spare: as in ``rms_norm`` (spare applies to the normed output).

    Returns:
        (normed, x + residual).
    """
    _check(x, weight, eps, casting, residual)
    _check_spare(spare)
    if not use_triton(x, residual, weight):
        return reference.rms_norm_add(x, residual, weight, eps, offset=offset, casting=casting)
    return RMSNormAddFunction.apply(x, residual, weight, float(eps), float(offset), casting, spare)


def rms_norm_keep(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0,
                  casting: str = "llama", spare: SpareColumns | None = None):
    """``(rms_norm(x), x)``: the norm of a residual-stream tensor and the tensor itself, for the
    residual add that also reads it. The backward adds that add's gradient to the norm's in the
    same pass, so autograd does not sum the two in a separate kernel.

    Args: as in ``rms_norm``.

    Returns:
        (normed, x): the second a view of x (use it, not x, for the residual add).
    """
    _check(x, weight, eps, casting)
    _check_spare(spare)
    if not use_triton(x, weight):
        return reference.rms_norm(x, weight, eps, offset=offset, casting=casting), x
    return RMSNormKeepFunction.apply(x, weight, float(eps), float(offset), casting, spare)
