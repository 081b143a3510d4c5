"""Rotary position embedding in Hugging Face's rotate-half layout, Q and K in one launch.

Per head vector x of width Dh, rotary width Dr ≤ Dh (even), half = Dr / 2, and per-token tables
c = cos[b, s], n = sin[b, s] (or cos[pos[b, s]] with ``position_ids``), split into halves
c₁ = c[:half], c₂ = c[half:Dr] (equal in HF's tables, not assumed here):

    forward   y₁ = x₁·c₁ − x₂·n₁        y₂ = x₂·c₂ + x₁·n₂        y[Dr:] = x[Dr:]
    backward  dx₁ = dy₁·c₁ + dy₂·n₂     dx₂ = dy₂·c₂ − dy₁·n₁     dx[Dr:] = dy[Dr:]

(the backward is the transpose of that 2×2 map: the same rotation with −sin when c₁ = c₂ and
n₁ = n₂). Math in fp32, one rounding at the store; HF rounds each bf16 product, so we are closer
to the exact result. cos/sin are constants: they get no gradient (HF's rotary buffers need none).

In place, and how autograd sees it. By default the forward overwrites q and k (the Dr rotated dims
only; the pass-through dims need no traffic) and returns tensors aliasing them. It does NOT use
``ctx.mark_dirty``: on q, a transposed view of the projection output, mark_dirty makes autograd
rebase the projection's history through CopySlices, whose backward clones the whole base gradient
and scatters through as_strided (several extra passes over q's gradient). Instead the forward bumps
q's and k's version counters, so any other node that saved the pre-rotation q/k for its backward
fails loudly ("modified by an inplace operation") instead of reading rotated values, and the
returned tensors get this Function as grad_fn. Contract: the caller must not use the pre-rotation
q/k objects afterwards (HF attention rebinds both names). Out-of-place (fresh outputs in q's
layout) is used instead when ``inplace=False``, when q/k (or the tensor they view) is a leaf that
requires grad, or when q/k have a zero stride. Gradients are always written to fresh tensors:
incoming gradients may be shared or expanded, and a fresh buffer moves the same bytes.

q [B, Hq, S, Dh], k [B, Hk, S, Dh] with any strides (any GQA ratio); cos/sin [B, S, Dr] or
[1, S, Dr], or tables [P, Dr] with ``position_ids`` [B, S] (or [1, S]) — packed sequences whose
positions restart per document. Positions must lie in [0, P) (not checked: no device sync).
Dtypes: q, k, cos, sin in float32, bfloat16 or float16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._backend import cdiv, check_float, check_same_device, next_power_of_2, use_triton

__all__ = ["apply_rope", "RopeFunction"]

_MAX_HEAD_BLOCK = 32  # heads per tile; more heads loop
# Rotated pairs per program and tensor (tokens are stacked up to this), forward (in place) and
# backward (out of place). H200 sweep, q [4,32,4096,128] k [4,8,4096,128] bf16 (bench_kernels.py
# --tune-rope): 4096 pairs at 1 warp forward (91% of copy bandwidth), 2048 at 1 warp backward
# (86%); 4 warps cost 10 points, and a tile of 8192 wants 2 warps.
_TILE_FWD = 4096
_TILE_BWD = 2048


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rope_heads(x_ptr,  # one of q/k [B, H, S, Dh], any strides; fp32/bf16/fp16
                xo_ptr,  # out: its rotation, same shape and dtype (x_ptr itself when INPLACE)
                tok_x, tok_o, t_mask, n_heads, half, rot_dim, head_dim, c1, c2, n1, n2,
                s_xh, s_xd, s_oh, s_od,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                BACKWARD: tl.constexpr, INPLACE: tl.constexpr):
    """Rotate every head of BLOCK_T tokens of one tensor, x → xo (the same memory when in place).

    tok_x/tok_o: [BLOCK_T, 1, 1] int64 element offsets of each token in x/xo; c*, n*: [BLOCK_T, 1,
    BLOCK_D] fp32 halves of cos/sin.
    """
    d = tl.arange(0, BLOCK_D)[None, None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H))[None, :, None]
        row_mask = t_mask & (h < n_heads)
        mask = row_mask & (d < half)
        x_at = x_ptr + tok_x + h.to(tl.int64) * s_xh + d * s_xd
        o_at = xo_ptr + tok_o + h.to(tl.int64) * s_oh + d * s_od
        x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + half * s_xd, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * n2
            y2 = x2 * c2 - x1 * n1
        else:
            y1 = x1 * c1 - x2 * n1
            y2 = x2 * c2 + x1 * n2
        tl.store(o_at, y1.to(xo_ptr.dtype.element_ty), mask=mask)
        tl.store(o_at + half * s_od, y2.to(xo_ptr.dtype.element_ty), mask=mask)
        if not INPLACE:  # copy the pass-through dims [Dr, Dh)
            p = rot_dim + tl.arange(0, BLOCK_P)[None, None, :]
            p_mask = row_mask & (p < head_dim)
            xp = tl.load(x_ptr + tok_x + h.to(tl.int64) * s_xh + p * s_xd, mask=p_mask)
            tl.store(xo_ptr + tok_o + h.to(tl.int64) * s_oh + p * s_od, xp.to(xo_ptr.dtype.element_ty), mask=p_mask)


@triton.jit
def _rope_kernel(
    q_ptr,  # q [B, Hq, S, Dh], strides s_q*; fp32/bf16/fp16 (dq in backward)
    k_ptr,  # k [B, Hk, S, Dh], strides s_k*; fp32/bf16/fp16 (dk in backward)
    qo_ptr,  # out: rotated q [B, Hq, S, Dh], strides s_qo*; q's dtype (q_ptr itself when INPLACE)
    ko_ptr,  # out: rotated k [B, Hk, S, Dh], strides s_ko*; k's dtype (k_ptr itself when INPLACE)
    cos_ptr,  # cos [B or 1, S, Dr] (strides s_cb, s_cs, s_cd), or a table [P, Dr] when HAS_POS; fp32/bf16/fp16
    sin_ptr,  # sin, cos's shape and strides
    pos_ptr,  # position_ids [B, S], int32/int64, strides s_pb, s_ps (HAS_POS only)
    n_tokens, seq_len, n_q_heads, n_k_heads, half, head_dim,
    s_qb, s_qh, s_qs, s_qd, s_qob, s_qoh, s_qos, s_qod,
    s_kb, s_kh, s_ks, s_kd, s_kob, s_koh, s_kos, s_kod,
    s_cb, s_cs, s_cd, s_pb, s_ps,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, INPLACE: tl.constexpr,
):
    """One program per BLOCK_T tokens (b, s): loads their cos/sin rows once, then every q and k head."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < n_tokens
    b = tok // seq_len
    s = tok % seq_len
    if HAS_POS:  # tables are [P, Dr]
        row = tl.load(pos_ptr + b * s_pb + s * s_ps, mask=t_mask, other=0).to(tl.int64) * s_cs
    else:
        row = b * s_cb + s * s_cs
    d = tl.arange(0, BLOCK_D)
    cmask = t_mask[:, None] & (d < half)[None, :]
    c_offs = row[:, None] + d[None, :] * s_cd
    c1 = tl.load(cos_ptr + c_offs, mask=cmask, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(cos_ptr + c_offs + half * s_cd, mask=cmask, other=0.0).to(tl.float32)[:, None, :]
    n1 = tl.load(sin_ptr + c_offs, mask=cmask, other=0.0).to(tl.float32)[:, None, :]
    n2 = tl.load(sin_ptr + c_offs + half * s_cd, mask=cmask, other=0.0).to(tl.float32)[:, None, :]
    t_mask = t_mask[:, None, None]
    b = b[:, None, None]
    s = s[:, None, None]
    _rope_heads(q_ptr, qo_ptr, b * s_qb + s * s_qs, b * s_qob + s * s_qos, t_mask, n_q_heads, half, 2 * half,
                head_dim, c1, c2, n1, n2, s_qh, s_qd, s_qoh, s_qod,
                BLOCK_HQ, BLOCK_D, BLOCK_P, BACKWARD, INPLACE)
    _rope_heads(k_ptr, ko_ptr, b * s_kb + s * s_ks, b * s_kob + s * s_kos, t_mask, n_k_heads, half, 2 * half,
                head_dim, c1, c2, n1, n2, s_kh, s_kd, s_koh, s_kod,
                BLOCK_HK, BLOCK_D, BLOCK_P, BACKWARD, INPLACE)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------


def _launch(q, k, qo, ko, cos, sin, position_ids, backward):
    """Rotate q → qo and k → ko (either pair may be None: that tensor is skipped)."""
    ref = q if q is not None else k
    batch, _, seq_len, head_dim = ref.shape
    n_tokens = batch * seq_len
    if n_tokens == 0:
        return
    if cos.stride() != sin.stride():  # the kernel indexes both tables with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    half = cos.shape[-1] // 2
    if position_ids is not None:
        pos = position_ids.expand(batch, seq_len)
        s_cb, s_cs, s_pb, s_ps = 0, cos.stride(0), pos.stride(0), pos.stride(1)
    else:
        pos = None
        c3 = cos.expand(batch, seq_len, cos.shape[-1])
        s_cb, s_cs, s_pb, s_ps = c3.stride(0), c3.stride(1), 0, 0
    nq = q.shape[1] if q is not None else 0
    nk = k.shape[1] if k is not None else 0
    q, qo = (q, qo) if q is not None else (ref, ref)  # dummies when absent: zero heads
    k, ko = (k, ko) if k is not None else (ref, ref)
    block_d = next_power_of_2(half)
    block_hq = min(next_power_of_2(max(nq, 1)), _MAX_HEAD_BLOCK)
    block_hk = min(next_power_of_2(max(nk, 1)), _MAX_HEAD_BLOCK)
    inplace = qo is q and ko is k
    block_p = next_power_of_2(max(head_dim - 2 * half, 1))
    # Tokens per program: one or two for wide tokens (32 heads × 64 pairs already fill a program),
    # more when heads are few or narrow, so each program still moves a few KiB.
    tile = _TILE_BWD if backward else _TILE_FWD
    block_t = max(1, min(16, tile // (block_hq * block_d)))
    warps = _num_warps(block_t * block_hq * block_d)
    _rope_kernel[(cdiv(n_tokens, block_t),)](
        q, k, qo, ko, cos, sin, pos,
        n_tokens, seq_len, nq, nk, half, head_dim,
        *q.stride(), *qo.stride(), *k.stride(), *ko.stride(),
        s_cb, s_cs, cos.stride(-1), s_pb, s_ps,
        BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, BLOCK_P=block_p,
        HAS_POS=pos is not None, BACKWARD=backward, INPLACE=inplace, num_warps=warps,
    )


def _num_warps(pairs: int) -> int:
    """One warp per 4096 rotated pairs of a program (sweep above), at least one, at most eight."""
    return max(1, min(8, pairs // 4096))


def _may_overwrite(t: torch.Tensor) -> bool:
    """Whether writing t's memory is allowed: not a grad-requiring leaf (or a view of one), no
    zero strides (expanded tensors alias their own elements)."""
    base = t._base if t._base is not None else t
    if base.requires_grad and base.is_leaf:
        return False
    return all(st != 0 or n <= 1 for st, n in zip(t.stride(), t.shape))


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class RopeFunction(torch.autograd.Function):
    """(q, k) → rotated (q, k); saves only cos, sin and position_ids."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, inplace):
        if inplace:
            qo, ko = q, k
        else:
            qo, ko = torch.empty_like(q), torch.empty_like(k)  # rotated and pass-through dims all stored
        _launch(q, k, qo, ko, cos, sin, position_ids, backward=False)
        if inplace:
            # Anyone who saved the pre-rotation q/k now fails its version check (see docstring).
            torch.autograd.graph.increment_version(q)
            torch.autograd.graph.increment_version(k)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.set_materialize_grads(False)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        # Out of place: the kernel stores the rotated and the pass-through dims of every head.
        dqi = torch.empty_like(dq) if dq is not None else None
        dki = torch.empty_like(dk) if dk is not None else None
        if dq is not None or dk is not None:
            _launch(dq, dk, dqi, dki, cos, sin, position_ids, backward=True)
        return dqi, dki, None, None, None, None


# --------------------------------------------------------------------------------------------
# public
# --------------------------------------------------------------------------------------------


def _check(q, k, cos, sin, position_ids):
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, S, Dh], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    batch, _, seq_len, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must share B, S and Dh with q {tuple(q.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    rot = cos.shape[-1] if cos.dim() else 0
    if rot == 0 or rot % 2 or rot > head_dim:
        raise ValueError(f"cos/sin last dim must be even and in [2, {head_dim}], got {rot}")
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
            raise ValueError(f"cos/sin must be [{batch} or 1, {seq_len}, Dr] without position_ids, "
                             f"got {tuple(cos.shape)}")
    else:
        if cos.dim() != 2:
            raise ValueError(f"with position_ids, cos/sin must be tables [P, Dr], got {tuple(cos.shape)}")
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"position_ids must be int32 or int64, got {position_ids.dtype}")
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
            raise ValueError(f"position_ids must be [{batch} or 1, {seq_len}], got {tuple(position_ids.shape)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if q.data_ptr() == k.data_ptr() and q.numel():
        raise ValueError("q and k must not share memory")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None = None, *, inplace: bool = True):
    """Rotary embedding (HF rotate-half), the same function as ``reference.apply_rope``.

    Args:
        q: [B, Hq, S, Dh], any strides (typically a transposed view of [B, S, Hq, Dh]).
        k: [B, Hk, S, Dh], any strides; Hq need not equal Hk.
        cos, sin: [B, S, Dr] or [1, S, Dr] per token, or [P, Dr] tables with ``position_ids``;
            Dr ≤ Dh, even. Constants for the kernel; if they require grad, the plain-PyTorch
            reference runs instead (out of place) so that they get one.
        position_ids: optional [B, S] (or [1, S]) int positions into the tables.
        inplace: overwrite q and k where that is safe (see the module docstring); False always
            returns new tensors and leaves q, k untouched.

    Returns:
        (q_rotated, k_rotated). When written in place they alias q and k: do not use the
        pre-rotation q, k afterwards.
    """
    _check(q, k, cos, sin, position_ids)
    if not use_triton(q, k, cos, sin, position_ids) or cos.requires_grad or sin.requires_grad:
        return reference.apply_rope(q, k, cos, sin, position_ids)
    inplace = bool(inplace) and _may_overwrite(q) and _may_overwrite(k)
    return RopeFunction.apply(q, k, cos, sin, position_ids, inplace)
