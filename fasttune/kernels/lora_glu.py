"""Fused LoRA gated MLP: y = down(act(gate(x)) · up(x)), one autograd Function.

Each projection p ∈ {gate, up, down} is a LoRA linear (``lora.py``): p(z) = z W_pᵀ (+ b_p)
+ s_p·(z A_pᵀ) B_pᵀ, with a frozen dense or NF4 W_p. X [N, D] is x flattened, I the
intermediate width, act one of silu (SwiGLU), gelu_tanh or gelu (GeGLU).

Forward (products through torch/cuBLAS in x's dtype, the elementwise step in Triton, fp32 math):

    G  = gate(X),  U = up(X)                [N, I]   (X [A_g; A_u]ᵀ is one product: XA)
    H  = act(G) · U                         [N, I]   (rounded once to x's dtype)
    Y  = down(H),  HA = H A_dᵀ              [N, r_d]

Backward from dY [N, D_out]; with a = act(G) and a' = act'(G):

    dYB_d = s_d · dY B_d ;  dH = dY W_d + dYB_d A_d
    dB_d  = s_d · dYᵀ HA ;  dA_d = dYB_dᵀ H            (H recomputed from G, U)
    dU = dH · a ;  dG = dH · U · a'                    (one Triton pass, see below)
    dX = dG W_g + dU W_u + [dYB_g dYB_u] [A_g; A_u],  dA_p, dB_p as in lora.py with dY_p = dG, dU

    silu:      a = g σ(g),                  a' = σ(g) (1 + g (1 − σ(g)))
    gelu_tanh: a = ½ g (1 + t), t = tanh(k (g + 0.044715 g³)), k = √(2/π),
               a' = ½ (1 + t) + ½ g (1 − t²) k (1 + 3·0.044715 g²)
    gelu:      a = ½ g (1 + erf(g/√2)),     a' = ½ (1 + erf(g/√2)) + g e^(−g²/2) / √(2π)

Saved: X, G, U and the rank-wide XA, HA; not H, not act(G). The backward elementwise kernel
reads G, U, dH once and writes dG over G, dU over U and H over dH (each program reads its
elements before writing them), so no [N, I] buffer is allocated in backward besides dH. This
consumes the saved G and U: backward runs once (retain_graph=True through it raises).

Dtypes and frozen-weight rules as in ``lora.py``; tanh is 2σ(2z) − 1 (no libdevice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import forward_reuse
from ._backend import cdiv, check_float, next_power_of_2, use_triton
from .lora import (BaseWeight, adapter_dyb, adapter_grads, autocast_input, check_projection, grad_input,
                   group_backward, project, scratch_for)
from .lora_adapters import adapters_of, b_as, cast_b, stacked_xa
from .kept_weights import current, recording_for
from .lora_wide import wide_columns
from .nf4 import cast_rne
from .swiglu import _act_and_grad  # shared activation and derivative (one definition)

__all__ = ["lora_mlp", "LoRAMLPFunction"]

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # the ACT codes of swiglu._act_and_grad
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_BLOCK = 2048


@triton.jit
def _glu_fwd_kernel(
    g_ptr,  # G = gate(X) [n_rows, I], contiguous; DTYPE
    u_ptr,  # U = up(X) [n_rows, I], contiguous; DTYPE
    h_ptr,  # out: H = act(G)·U [n_rows, I], rows stride_h apart, unit column stride; DTYPE
    n_rows, n_cols, stride_h,
    ACT: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # A [BLOCK_M, BLOCK_N] tile per program: G, U rows contiguous ([N, I]); H rows ``stride_h``
    # apart (the widened input of a widened down projection, lora_wide.py).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g = tl.load(g_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(h_ptr + rows * stride_h + cols, cast_rne(a * u, DTYPE), mask=mask)


@triton.jit
def _rank_term(
    xa_ptr,  # XA [n_rows, rank], rows stride_xa apart, unit column stride
    b_ptr,  # B [n_cols, rank], contiguous
    rows, cols, n_rows, n_cols, rank,
    stride_xa,
    R_PAD: tl.constexpr, FP32: tl.constexpr,
):
    """XA Bᵀ over one [rows, cols] tile, fp32: XA [n_rows, rank] rows stride_xa apart, B [n_cols, rank]
    contiguous; the rank padded to R_PAD (≥ 16, tl.dot's least K) with zeros."""
    k = tl.arange(0, R_PAD)
    xa = tl.load(xa_ptr + rows * stride_xa + k[None, :], mask=(rows < n_rows) & (k[None, :] < rank), other=0.0)
    bt = tl.load(b_ptr + cols * rank + k[:, None], mask=(cols < n_cols) & (k[:, None] < rank), other=0.0)
    if FP32:
        return tl.dot(xa.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
    return tl.dot(xa, bt)  # 16-bit operands, fp32 products and sums


@triton.jit
def _glu_rank_fwd_kernel(
    g_ptr,  # gate(X)'s base product X W_gᵀ [n_rows, I], contiguous; DTYPE; G is written over it
    u_ptr,  # up(X)'s base product X W_uᵀ [n_rows, I], contiguous; DTYPE; U is written over it
    h_ptr,  # out: H = act(G)·U [n_rows, I], rows stride_h apart, unit column stride; DTYPE
    xag_ptr,  # X A_gᵀ [n_rows, r_g], rows stride_xag apart; DTYPE (read when HAS_G)
    bg_ptr,  # B_g [I, r_g], contiguous; DTYPE (read when HAS_G)
    xau_ptr,  # X A_uᵀ [n_rows, r_u], rows stride_xau apart; DTYPE (read when HAS_U)
    bu_ptr,  # B_u [I, r_u], contiguous; DTYPE (read when HAS_U)
    n_rows, n_cols, r_g, r_u, s_g, s_u,
    stride_h, stride_xag, stride_xau,
    ACT: tl.constexpr, DTYPE: tl.constexpr, HAS_G: tl.constexpr, HAS_U: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # G = X W_gᵀ + s_g·XA_g B_gᵀ (likewise U), each rounded once to DTYPE as cuBLAS's addmm_ rounds
    # it, written back for backward; H from the rounded G and U, as glu_forward computes it.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g = tl.load(g_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_G:
        g = cast_rne(g + s_g * _rank_term(xag_ptr, bg_ptr, rows, cols, n_rows, n_cols, r_g, stride_xag, R_PAD,
                                          DTYPE == tl.float32), DTYPE)
        tl.store(g_ptr + rows * n_cols + cols, g, mask=mask)
        g = g.to(tl.float32)
    if HAS_U:
        u = cast_rne(u + s_u * _rank_term(xau_ptr, bu_ptr, rows, cols, n_rows, n_cols, r_u, stride_xau, R_PAD,
                                          DTYPE == tl.float32), DTYPE)
        tl.store(u_ptr + rows * n_cols + cols, u, mask=mask)
        u = u.to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(h_ptr + rows * stride_h + cols, cast_rne(a * u, DTYPE), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    g_ptr,  # G [n], contiguous; DTYPE; dG is written over it
    u_ptr,  # U [n], contiguous; DTYPE; dU is written over it
    dh_ptr,  # dH [n], contiguous; DTYPE; H is written over it when STORE_H
    n,
    ACT: tl.constexpr, STORE_H: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    # In place: dG over G, dU over U, H over dH.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    if STORE_H:
        tl.store(dh_ptr + offs, cast_rne(a * u, DTYPE), mask=mask)
    tl.store(g_ptr + offs, cast_rne(dh * u * da, DTYPE), mask=mask)
    tl.store(u_ptr + offs, cast_rne(dh * a, DTYPE), mask=mask)


def _act_torch(g: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(g), act'(g) in g's dtype (the fallback path passes float32)."""
    if act == "silu":
        sig = torch.sigmoid(g)
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    if act == "gelu_tanh":
        k = 0.7978845608028654
        t = torch.tanh(k * (g + 0.044715 * g ** 3))
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 0.134145 * g * g)
    cdf = 0.5 * (1.0 + torch.erf(g * 0.7071067811865476))
    return g * cdf, cdf + g * torch.exp(-0.5 * g * g) * 0.3989422804014327


def _check_flat(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def glu_forward(g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(G)·U, fp32 math, rounded to G's dtype (G, U contiguous [N, I]).

    ``out``: where to write H, an [N, I] tensor of G's dtype with unit column stride (rows may be
    further apart: the first columns of a widened input); default a new tensor."""
    _check_flat(gate=g, up=u)
    if out is None:
        out = torch.empty_like(g)  # every element stored
    elif out.shape != g.shape or out.dtype != g.dtype or out.stride(1) != 1 or out.device != g.device:
        raise ValueError(f"out must be a {tuple(g.shape)} {g.dtype} tensor on {g.device} with unit column stride")
    if use_triton(g, u):
        rows, cols = g.shape
        block_n = min(_BLOCK, next_power_of_2(cols))
        block_m = _BLOCK // block_n  # _BLOCK elements per program, as many rows as fit
        grid = (cdiv(rows, block_m), cdiv(cols, block_n))
        _glu_fwd_kernel[grid](g, u, out, rows, cols, out.stride(0), ACT=_ACTIVATIONS[act], DTYPE=_TL_DTYPE[g.dtype],
                              BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
        return out
    a, _ = _act_torch(g.float(), act)
    out.copy_(a * u.float())
    return out


def glu_forward_rank_(g: torch.Tensor, u: torch.Tensor, xa: torch.Tensor, adapters, act: str,
                      out: torch.Tensor | None = None, b_cast=None) -> torch.Tensor:
    """G ← G + s_g·XA_g B_gᵀ and U ← U + s_u·XA_u B_uᵀ in place (each rounded once to G's dtype),
    then H = act(G)·U as ``glu_forward`` computes it: the rank-r terms of a non-widened gate/up
    pair inside the GLU pass instead of one ``addmm_`` pass over each of G and U.

    ``xa``: the stacked [N, Σr] X [A_g; A_u]ᵀ (``lora_adapters.stacked_xa``); ``adapters``: [(A, B, s) or None]
    for gate and up, in that order (their columns of ``xa`` in that order); ``out`` as in ``glu_forward``;
    ``b_cast``: each B already in G's dtype (``lora_adapters.cast_b``), or None."""
    _check_flat(gate=g, up=u)
    if xa.stride(1) != 1:
        raise ValueError("xa must have unit column stride")
    if out is None:
        out = torch.empty_like(g)  # every element stored
    dt = g.dtype
    bs = [None if ad is None else b_as(ad, bc, dt) for ad, bc in zip(adapters, b_cast or (None, None))]
    if not use_triton(g, u, xa):
        col = 0
        for y, ad, b in zip((g, u), adapters, bs):
            if ad is not None:
                y.addmm_(xa[:, col:col + ad[0].shape[0]], b.t(), alpha=ad[2])
                col += ad[0].shape[0]
        return glu_forward(g, u, act, out=out)
    rows, cols = g.shape
    args, col, ranks = [], 0, []
    for ad, b in zip(adapters, bs):
        if ad is None:
            args += [xa, xa, 0, 0.0]  # never read (HAS_* False)
            ranks.append(0)
            continue
        r = ad[0].shape[0]
        args += [xa[:, col:col + r], b.contiguous(), r, float(ad[2])]
        ranks.append(r)
        col += r
    block_m, block_n = 64, min(128, next_power_of_2(max(cols, 16)))
    grid = (cdiv(rows, block_m), cdiv(cols, block_n))
    _glu_rank_fwd_kernel[grid](
        g, u, out, args[0], args[1], args[4], args[5], rows, cols, args[2], args[6], args[3], args[7],
        out.stride(0), xa.stride(0), xa.stride(0), ACT=_ACTIVATIONS[act], DTYPE=_TL_DTYPE[dt],
        HAS_G=adapters[0] is not None, HAS_U=adapters[1] is not None,
        R_PAD=max(16, next_power_of_2(max(ranks))), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
    return out


def glu_backward_(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: str, store_h: bool) -> None:
    """In place: G ← dH·U·act'(G), U ← dH·act(G), and dH ← act(G)·U when ``store_h``."""
    _check_flat(gate=g, up=u, grad_h=dh)
    if use_triton(g, u, dh):
        n = g.numel()
        _glu_bwd_kernel[(cdiv(n, _BLOCK),)](g, u, dh, n, ACT=_ACTIVATIONS[act], STORE_H=store_h,
                                                   DTYPE=_TL_DTYPE[g.dtype], BLOCK=_BLOCK, num_warps=8)
        return
    g32, u32, dh32 = g.float(), u.float(), dh.float()  # the tensors themselves when float32
    a, da = _act_torch(g32, act)
    h = a * u32 if store_h else None
    dg, du = dh32 * u32 * da, dh32 * a
    g.copy_(dg)
    u.copy_(du)
    if store_h:
        dh.copy_(h)


class LoRAMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) · up(x)) with LoRA on each projection; see the module docstring."""

    @staticmethod
    def forward(ctx, x, ag, bg, au, bu, ad, bd, bases, scalings, act, output_unused=False):
        gate, up, down = bases
        x2 = x.reshape(-1, gate.shape[1])
        kept = recording_for(ctx)  # a recompute keeps gate's and up's dequantised NF4 weights for backward
        scratch = scratch_for(bases if kept is None else () if output_unused else (down,), x.dtype, x.device)
        gu_adapters = adapters_of((ag, bg, au, bu), scalings[:2])
        xa, a_gu = stacked_xa(x2, gu_adapters)
        b_gu = cast_b((gate, up), gu_adapters, x2.dtype)
        # Not widened (NF4 and FP8 bases, lora_widen off): the rank-r terms join the GLU pass.
        rank_in_glu = xa is not None and use_triton(x2) and wide_columns((gate, up), gu_adapters, x.dtype) is None
        g, u = project(x2, (gate, up), gu_adapters, xa, scratch, rank_terms=not rank_in_glu, b_cast=b_gu, kept=kept)
        d_adapters = adapters_of((ad, bd), scalings[2:])
        b_d = cast_b((down,), d_adapters, x2.dtype)
        # A widened down projection (lora_wide.py) reads H from the first columns of its widened
        # input: the GLU kernel writes it there, no copy.
        hcat = None
        if not output_unused and wide_columns((down,), d_adapters, x.dtype) is not None:
            hcat = x2.new_empty((x2.shape[0], g.shape[1] + down.wide.extra))
            # H·A_dᵀ reads H before project_wide fills the tail, and a GEMM may read past a row's
            # end (spare_columns.output_rows): zeros there, never garbage.
            hcat[:, g.shape[1]:].zero_()
        h_out = None if hcat is None else hcat[:, : g.shape[1]]
        # A discarded recompute needs H only for H·A_dᵀ: with that from its forward (forward_reuse.py),
        # or no adapter on down, no GLU pass (unless it adds gate/up's rank-r terms to G and U).
        d_a = [ad[0] for ad in d_adapters if ad is not None]
        skip_h = output_unused and not rank_in_glu
        if skip_h and d_a:
            hit = forward_reuse.replayed("xa", d_a, ((x2.shape[0], g.shape[1]), x2.dtype))
            skip_h = hit is not None
        if skip_h:
            ha, a_d = hit if d_a else (None, None)
        else:
            h = (glu_forward_rank_(g, u, xa, gu_adapters, act, out=h_out, b_cast=b_gu) if rank_in_glu
                 else glu_forward(g, u, act, out=h_out))
            ha, a_d = stacked_xa(h, d_adapters)
        if output_unused:  # a discarded recompute: NaNs, so that a use of them could not go unnoticed
            y = torch.full((x2.shape[0], down.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
        else:
            (y,) = project(h, (down,), d_adapters, ha, scratch, xcat=hcat, b_cast=b_d, kept=kept)
        # The adapter casts are saved tensors, not ctx attributes: a checkpointed layer does not hold
        # them from its forward to its backward (its recompute takes them back, forward_reuse.py).
        ctx.save_for_backward(x, g, u, xa, ha, ag, bg, au, bu, ad, bd, a_gu, a_d, *b_gu, *b_d)
        ctx.bases, ctx.scalings, ctx.act, ctx.consumed, ctx.kept = bases, scalings, act, False, current()
        ctx.reuse = forward_reuse.active()
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], down.shape[0]))  # not a view: safe to modify in place

    @staticmethod
    def backward(ctx, dy):
        if ctx.consumed:
            raise RuntimeError("lora_mlp's backward overwrites its saved activations and can run only once; "
                               "do not backpropagate through it twice (retain_graph=True)")
        ctx.consumed = True
        x, g, u, xa, ha, ag, bg, au, bu, ad, bd, a_gu, a_d, *b_cast = ctx.saved_tensors
        gate, up, down = ctx.bases
        need = ctx.needs_input_grad
        x2, dy2 = x.reshape(-1, gate.shape[1]), dy.reshape(-1, down.shape[0])
        scratch = scratch_for(ctx.bases, x.dtype, x.device)

        # Down projection: dH = dYB_d A_d + dY W_d; H is recomputed over dH only if dA_d needs it.
        d_adapters = adapters_of((ad, bd), ctx.scalings[2:])
        dyb_d, a_d = adapter_dyb((dy2,), d_adapters, a_d, b_cast[2:])
        dh = grad_input((dy2,), (down,), dyb_d, a_d, scratch, ctx.kept)
        glu_backward_(g, u, dh, ctx.act, store_h=ad is not None and need[5])  # g ← dG, u ← dU, dh ← H
        (da_d,), (db_d,) = adapter_grads(dh, (dy2,), ha, dyb_d, d_adapters, need[5:6], need[6:7])
        del dh

        # Gate and up share X: dX = [dYB_g dYB_u] [A_g; A_u] + dG W_g + dU W_u.
        dx, da, db = group_backward(x2, (g, u), xa, (gate, up), adapters_of((ag, bg, au, bu), ctx.scalings[:2]),
                                    (need[0], need[1:5:2], need[2:5:2]), scratch, a_gu, b_cast[:2], ctx.kept,
                                    ctx.reuse)
        return (None if dx is None else dx.view(x.shape), da[0], db[0], da[1], db[1], da_d, db_d,
                None, None, None, None)


def lora_mlp(x: torch.Tensor, gate, up, down, activation: str = "silu", *, output_unused: bool = False) -> torch.Tensor:
    """Gated MLP ``down(act(gate(x)) * up(x))`` with LoRA adapters, one fused autograd Function.

    Args:
        x: hidden states [..., D], float32/float16/bfloat16.
        gate, up, down: each a ``(base, lora_a, lora_b, scaling)`` tuple as in
            ``lora.lora_linear`` (``base`` a dense tensor, an NF4 ``(packed, quant_state)`` pair
            or a ``BaseWeight``); ``lora_a = lora_b = None`` where a projection has no adapter.
            gate and up are [I, D], down is [D_out, I].
        activation: "silu" (SwiGLU: Llama, Mistral, Qwen), "gelu_tanh" (GeGLU: Gemma) or
            "gelu" (exact erf GeGLU).
        output_unused: the caller discards the output and only needs the backward state (a
            checkpoint recompute): the down projection is skipped and the output is all NaN.
            The saved state, and so every gradient, is the same as without it.

    Returns:
        [..., D_out] in x's dtype. Gradients flow to x and every lora_a/lora_b. Backward may
        run once only (it reuses the saved activations' memory).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu', 'gelu_tanh' or 'gelu', got {activation!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float("x", x)
    x, autocast = autocast_input(x)
    g_spec = check_projection("gate", gate, x, autocast)
    u_spec = check_projection("up", up, x, autocast)
    inter = g_spec[0].shape[0]
    if u_spec[0].shape[0] != inter:
        raise ValueError(f"gate has {inter} outputs but up has {u_spec[0].shape[0]}")
    if not isinstance(down, (tuple, list)) or len(down) != 4:
        raise TypeError("down must be a (base, lora_a, lora_b, scaling) tuple")
    d_base = BaseWeight.of(down[0])
    if d_base.shape[1] != inter:
        raise ValueError(f"down expects {d_base.shape[1]} inputs but gate/up give {inter}")
    # down's input is H (width I, x's dtype): validate it against a stand-in of that shape.
    h_like = x.new_empty((0, inter))
    d_spec = check_projection("down", (d_base, *down[1:]), h_like, autocast)
    specs = (g_spec, u_spec, d_spec)
    bases = tuple(sp[0] for sp in specs)
    scalings = tuple(sp[3] for sp in specs)
    tensors = [t for sp in specs for t in sp[1:3]]
    return LoRAMLPFunction.apply(x, *tensors, bases, scalings, activation, bool(output_unused))
