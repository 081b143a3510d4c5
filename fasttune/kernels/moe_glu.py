"""The gated activation between the two expert products, with the router weight folded in.

Each row r of ``gate_up`` [S, 2I] is one (token, expert) pair; w[r] its router weight:

    h[r] = w[r] · a(g) · u                           (g, u = the row's gate and up halves)

Layouts and activations (``moe_reference.GLU_KINDS``): "silu" / "gelu_tanh" / "gelu" with gate
= columns [0, I), up = [I, 2I) (Qwen3-MoE, Mixtral, ...), a(g)·u as ``swiglu.py`` computes it;
"clamped_swiglu" (gpt-oss) with gate = even columns, up = odd columns:

    ĝ = min(g, L),  û = clamp(u, −L, L),  σ = sigmoid(α·ĝ),  h = w·(û + 1)·ĝ·σ

Folding w into h lets the down projection weight each row for free: (w·h) Wᵈ = w·(h Wᵈ).

Backward, given dh = ∂L/∂h [S, I] (the gradient of the *weighted* h):

    v = a(g)·u (the unweighted activation),  dw[r] = Σ_j dh[r, j] · v[r, j]
    silu & co:       dg = dh·w·u·a'(g),  du = dh·w·a(g)
    clamped_swiglu:  dg = dh·w·(û + 1)·(σ + α·ĝ·σ·(1 − σ)) where g ≤ L (0 elsewhere),
                     du = dh·w·ĝ·σ where −L ≤ u ≤ L (0 elsewhere)   (torch.clamp's gradient mask)
                     On exactly g = L or u = ±L the mask follows the installed torch's scalar
                     clamp (as stock gpt-oss does): inclusive (gradient 1) up to torch 2.14,
                     strict (gradient 0, the minimum-norm subgradient) from 2.15 on.

The backward also returns h (recomputed, weighted) on request, which the down projection's weight
gradient needs, so neither h nor v is kept between forward and backward (a caller that wants h's
buffer gone before dgate_up's exists computes it by ``moe_glu`` first, bit for bit the same).
dgate_up is written over the saved gate_up buffer when the caller allows it (every element is
loaded before its own store).

One program per block of rows, a loop over column blocks (the row sums of dw stay in registers). fp32 math,
one rounding at the store; dw is fp32. Dtypes float32, float16, bfloat16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import moe_reference as reference
from ._backend import cdiv, check_float, check_same_device, interpreter_on, next_power_of_2, use_triton
from .moe_reference import GLU_KINDS, ExpertGLU
from .swiglu import _act_and_grad

__all__ = ["moe_glu", "moe_glu_backward"]

_BLOCK = 1024


@functools.cache
def _strict_clamp_grad() -> bool:
    """Whether torch's scalar clamp gives gradient 0 exactly on its bound (torch >= 2.15, pytorch
    issue #184572) rather than 1 (earlier): probed once so the kernel matches stock gpt-oss."""
    with torch.enable_grad():  # first called from inside a backward, where grad mode is off
        x = torch.ones((), requires_grad=True)
        return torch.autograd.grad(x.clamp(max=1.0), x)[0].item() == 0.0


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _glu_cols(
    gu_ptr,  # gate_up [S, 2I], rows stride_gu apart; fp32/bf16/fp16
    rows, cols, mask, n_cols, stride_gu,
    INTERLEAVED: tl.constexpr,
):
    """(gate, up) of a [ROWS, BLOCK] tile, upcast to fp32."""
    at = gu_ptr + rows[:, None] * stride_gu
    if INTERLEAVED:
        g = tl.load(at + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(at + 2 * cols[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(at + n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _glu_value_and_grads(g, u, alpha, limit, KIND: tl.constexpr, STRICT: tl.constexpr):
    """(v = a(g)·u, ∂v/∂g, ∂v/∂u) in fp32; KIND 0 silu, 1 gelu tanh, 2 gelu erf, 3 clamped swiglu."""
    if KIND == 3:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.sigmoid(alpha * gc)
        a = gc * sig
        if STRICT:  # torch >= 2.15: 0 on the bound
            g_in = g < limit
            u_in = (u > -limit) & (u < limit)
        else:
            g_in = g <= limit
            u_in = (u >= -limit) & (u <= limit)
        da = tl.where(g_in, sig + alpha * gc * sig * (1.0 - sig), 0.0)
        v = (uc + 1.0) * a
        dvg = (uc + 1.0) * da
        dvu = tl.where(u_in, a, 0.0)
    else:
        a, da = _act_and_grad(g, KIND)
        v = a * u
        dvg = u * da
        dvu = a
    return v, dvg, dvu


@triton.jit
def _moe_glu_fwd_kernel(
    gu_ptr,  # [S, 2I] gate_up rows
    w_ptr,  # [S] router weight per row (unused without HAS_W)
    h_ptr,  # [S, I] output
    n_rows, n_cols, alpha, limit,
    stride_gu, stride_h,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_W: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    if HAS_W:
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        w = tl.full((ROWS,), 1.0, tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        g, u = _glu_cols(gu_ptr, rows, cols, mask, n_cols, stride_gu, INTERLEAVED)
        v, _, _ = _glu_value_and_grads(g, u, alpha, limit, KIND, False)
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], (w[:, None] * v).to(h_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _moe_glu_bwd_kernel(
    gu_ptr,  # [S, 2I] gate_up rows (saved by forward)
    dh_ptr,  # [S, I] gradient of the weighted h
    w_ptr,  # [S] router weight per row (unused without HAS_W)
    dgu_ptr,  # [S, 2I] output: gradient of gate_up (may be gu_ptr itself)
    h_ptr,  # [S, I] output: the weighted h, recomputed (unused without WRITE_H)
    dw_ptr,  # [S] fp32 output: gradient of w (unused without HAS_W)
    n_rows, n_cols, alpha, limit,
    stride_gu, stride_dh, stride_dgu, stride_h,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_W: tl.constexpr, WRITE_H: tl.constexpr, STRICT: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    if HAS_W:
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        w = tl.full((ROWS,), 1.0, tl.float32)
    dw = tl.zeros((ROWS,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        g, u = _glu_cols(gu_ptr, rows, cols, mask, n_cols, stride_gu, INTERLEAVED)
        dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v, dvg, dvu = _glu_value_and_grads(g, u, alpha, limit, KIND, STRICT)
        dw += tl.sum(dh * v, axis=1)
        if WRITE_H:
            tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], (w[:, None] * v).to(h_ptr.dtype.element_ty),
                     mask=mask)
        dgu_at = dgu_ptr + rows[:, None] * stride_dgu
        if INTERLEAVED:
            g_at, u_at = dgu_at + 2 * cols[None, :], dgu_at + 2 * cols[None, :] + 1
        else:
            g_at, u_at = dgu_at + cols[None, :], dgu_at + n_cols + cols[None, :]
        dhw = dh * w[:, None]
        tl.store(g_at, (dhw * dvg).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(u_at, (dhw * dvu).to(dgu_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(dw_ptr + rows, dw, mask=row_ok)


# --------------------------------------------------------------------------------------------
# launchers and public functions
# --------------------------------------------------------------------------------------------


def _kind(glu: ExpertGLU) -> int:
    if glu.kind not in GLU_KINDS:
        raise ValueError(f"glu.kind must be one of {', '.join(GLU_KINDS)}, got {glu.kind!r}")
    return GLU_KINDS.index(glu.kind)


def _check(gate_up: torch.Tensor, weights: torch.Tensor | None, glu: ExpertGLU) -> None:
    _kind(glu)
    check_float("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [S, 2I] with unit column stride, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != gate_up.shape[0]):
        raise ValueError(f"weights must be [S] = [{gate_up.shape[0]}], got {tuple(weights.shape)}")
    check_same_device(gate_up=gate_up, weights=weights)


def _tiles(n_rows: int, n_cols: int) -> tuple[tuple[int], int, int]:
    """(grid, rows per program, column block). The interpreter's cost is per program: few, wide ones."""
    block = min(_BLOCK, next_power_of_2(max(n_cols, 1)))
    rows = 64 if interpreter_on() else max(1, min(16, 4096 // block))
    return (cdiv(n_rows, rows),), rows, block


def moe_glu(gate_up: torch.Tensor, weights: torch.Tensor | None, glu: ExpertGLU = ExpertGLU(),
            out: torch.Tensor | None = None) -> torch.Tensor:
    """h = weights[:, None] · a(gate) · up (module docstring), [S, I] in gate_up's dtype. Not
    differentiable by itself (``grouped_mlp``'s Function calls ``moe_glu_backward``).

    Args:
        gate_up: [S, 2I] float32/float16/bfloat16, unit column stride.
        weights: [S] router weight per row, or None (weight 1).
        glu: the activation and layout (``moe_reference.ExpertGLU``).
        out: [S, I] of gate_up's dtype with unit column stride to write h into (any row stride:
            the columns of a wider buffer), or None.
    """
    _check(gate_up, weights, glu)
    S, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    if out is not None and (out.shape != (S, n_cols) or out.stride(-1) != 1 or out.dtype != gate_up.dtype
                            or out.device != gate_up.device):
        raise ValueError(f"out must be [{S}, {n_cols}] {gate_up.dtype} on {gate_up.device} with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if not use_triton(gate_up, weights):
        h = reference.moe_glu(gate_up, weights, glu)
        return h if out is None else out.copy_(h)
    h = torch.empty(S, n_cols, dtype=gate_up.dtype, device=gate_up.device) if out is None else out  # all stored
    if h.numel():
        grid, rows, block = _tiles(S, n_cols)
        _moe_glu_fwd_kernel[grid](
            gate_up, weights if weights is not None else gate_up, h, S, n_cols, float(glu.alpha), float(glu.limit),
            gate_up.stride(0), h.stride(0),
            ROWS=rows, BLOCK=block, KIND=_kind(glu), INTERLEAVED=glu.kind == "clamped_swiglu",
            HAS_W=weights is not None,
        )
    return h


def moe_glu_backward(gate_up: torch.Tensor, dh: torch.Tensor, weights: torch.Tensor | None,
                     glu: ExpertGLU = ExpertGLU(), overwrite: bool = False, out: torch.Tensor | None = None,
                     with_h: bool = True):
    """(dgate_up [S, 2I], h [S, I] the weighted forward output or None, dweights [S] fp32 or None).

    Args:
        gate_up: the forward's input.
        dh: [S, I] gradient of the forward's output, unit column stride.
        weights: the forward's weights, or None.
        glu: the forward's activation.
        overwrite: write dgate_up into gate_up's buffer (the caller no longer needs it).
        out: [S, 2I] of gate_up's dtype with unit column stride to write dgate_up into (any row
            stride: the columns of a wider buffer), or None; not with ``overwrite``.
        with_h: also return h (False: h is neither allocated nor written; the caller has it or needs none).
    """
    _check(gate_up, weights, glu)
    n_cols = gate_up.shape[1] // 2
    if dh.shape != (gate_up.shape[0], n_cols) or dh.stride(-1) != 1:
        raise ValueError(f"dh must be [{gate_up.shape[0]}, {n_cols}] with unit column stride, got {tuple(dh.shape)}")
    if out is not None and (overwrite or out.shape != gate_up.shape or out.stride(-1) != 1
                            or out.dtype != gate_up.dtype or out.device != gate_up.device):
        raise ValueError(f"out must be {tuple(gate_up.shape)} {gate_up.dtype} on {gate_up.device} with unit column "
                         f"stride, and not given with overwrite; got {out.dtype} {tuple(out.shape)} strides "
                         f"{out.stride()}, overwrite={overwrite}")
    if not use_triton(gate_up, dh, weights):
        dgu, h, dw = _reference_backward(gate_up, dh, weights, glu)
        return (dgu if out is None else out.copy_(dgu)), (h if with_h else None), dw
    S = gate_up.shape[0]
    dgu = gate_up if overwrite else out if out is not None else torch.empty_like(gate_up)  # every element stored
    h = torch.empty(S, n_cols, dtype=gate_up.dtype, device=gate_up.device) if with_h else None
    dw = torch.empty(S, dtype=torch.float32, device=gate_up.device) if weights is not None else None
    if S * n_cols:
        grid, rows, block = _tiles(S, n_cols)
        _moe_glu_bwd_kernel[grid](
            gate_up, dh, weights if weights is not None else gate_up, dgu, h if with_h else dgu,
            dw if dw is not None else dgu,
            S, n_cols, float(glu.alpha), float(glu.limit),
            gate_up.stride(0), dh.stride(0), dgu.stride(0), h.stride(0) if with_h else 0,
            ROWS=rows, BLOCK=block, KIND=_kind(glu), INTERLEAVED=glu.kind == "clamped_swiglu",
            HAS_W=weights is not None, WRITE_H=with_h, STRICT=_strict_clamp_grad(),
        )
    elif dw is not None:
        dw.zero_()
    if overwrite:
        torch.autograd.graph.increment_version(gate_up)  # it holds its gradient now: reads must fail
    return dgu, h, dw


def _reference_backward(gate_up, dh, weights, glu):
    """The same three outputs through autograd of the reference (the CPU path without Triton)."""
    with torch.enable_grad():
        gu = gate_up.detach().requires_grad_(True)
        w = weights.detach().float().requires_grad_(True) if weights is not None else None
        h = reference.moe_glu(gu, w, glu)
        grads = torch.autograd.grad(h, [gu] + ([w] if w is not None else []), dh.to(h.dtype))
    return grads[0], h.detach(), grads[1] if w is not None else None
