"""Fused linear log-probabilities: log softmax(z/T)[label] per row (and the entropy), without the
[N, V] logits. For TRL's DPO/GRPO/KTO-style losses, whose upstream gradients are per token.

Forward, per row with label y (labels < 0 read as 0: the caller masks those rows), x = h·Wᵀ + b,
s = logit_scale, c = softcap, T = temperature:

    z   = c·tanh(s·x/c)   (z = s·x without soft-cap)        t_j = z_j / T
    lse = log Σ_j e^{t_j}           log p_j = t_j − lse      p_j = e^{t_j − lse}
    logp = t_y − lse                H = −Σ_j p_j log p_j = lse − Σ_j p_j t_j

Hand-derived gradient, with upstream per-row gradients g (of logp) and e (of H):

    ∂logp/∂t_j = [j == y] − p_j
    ∂H/∂t_j    = −p_j (log p_j + H)
    dX_j = (g·([j == y] − p_j) − e·p_j·(log p_j + H)) · slope_j / T,   slope_j = s·(1 − (z_j/c)²)
    dH = dX W,   dW = dXᵀ H,   db = Σ_rows dX

Forward is one online pass per row (max, Σe, Σ e·t for H) over chunks of cuBLAS logits in a
workspace of at most ``workspace_mib``; it saves lse and H per row. Backward recomputes each chunk's
logits and writes dX in place in one pass from the saved lse/H (upstream gradients are per row,
so nothing can be precomputed), then the products (dW accumulated in fp32). fp32, bf16, fp16
(see ``_lce_common`` for the fp16 gradient pre-scaling); outputs are float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference
from ._backend import use_triton
from ._lce_common import (GradScaling, _is_real, _logit_slope, _logits, _online_softmax, block_config,
                          check_head_inputs, check_transform, finish_grad, first_order_only, head_chunks,
                          label_summary, rounded_to, transform_args)

__all__ = ["fused_linear_logprobs"]


@triton.jit
def _logprobs_kernel(
    x_ptr,  # raw products x = h·Wᵀ + b [rows, n_vocab], rows stride_x apart; fp32/bf16/fp16 (dX written over it)
    labels_ptr,  # labels [rows], integer (< 0 reads as 0)
    logp_ptr,  # out: log-probability of the label per row [rows], fp32 (ONLINE only)
    lse_ptr,  # lse of z/T per row [rows], fp32: written when ONLINE, read when WRITE_GRAD
    ent_ptr,  # entropy per row [rows], fp32: written when ONLINE, read when WRITE_GRAD (ENTROPY only)
    g_ptr,  # upstream gradient of logp per row [rows], fp32 (WRITE_GRAD only)
    e_ptr,  # upstream gradient of the entropy per row [rows], fp32 (WRITE_GRAD and ENTROPY only)
    scale_ptr,  # gradient factor c [1], fp32 (WRITE_GRAD only; _lce_common.GradScaling)
    n_vocab, logit_scale, softcap, inv_softcap, inv_temp,
    stride_x,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, ONLINE: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y = tl.load(labels_ptr + row)
    y = tl.where((y >= 0) & (y < n_vocab), y, 0).to(tl.int32)  # < 0 reads as 0; ≥ V was rejected on the host
    if ONLINE:
        m, s, zsum, ez, best = _online_softmax(x_row, n_vocab, logit_scale, softcap, inv_softcap, inv_temp,
                                               HAS_SOFTCAP, False, ENTROPY, False, BLOCK_V)
        lse = m + tl.log(s)
        t_y = _logits(tl.load(x_row + y).to(tl.float32), logit_scale, softcap, inv_softcap, HAS_SOFTCAP)
        t_y = t_y * inv_temp
        tl.store(logp_ptr + row, t_y - lse)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(ent_ptr + row, tl.log(s) - ez / s)
    if WRITE_GRAD:
        lse = tl.load(lse_ptr + row)
        c = tl.load(scale_ptr)
        g = tl.load(g_ptr + row) * c
        if ENTROPY:
            h = tl.load(ent_ptr + row)
            e = tl.load(e_ptr + row) * c
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_vocab
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            z = _logits(x, logit_scale, softcap, inv_softcap, HAS_SOFTCAP)
            logp = z * inv_temp - lse
            p = tl.exp(logp)
            d = g * (tl.where(cols == y, 1.0, 0.0) - p)
            if ENTROPY:
                d -= e * p * (logp + h)
            d = d * inv_temp * _logit_slope(z, logit_scale, inv_softcap, HAS_SOFTCAP)
            tl.store(x_row + cols, d.to(x_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Options:
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float | None = None
    entropy: bool = False
    workspace_mib: float | None = None


def _launch(opts: _Options, x, labels, lse, ent, *, logp=None, g=None, e=None, scale=None) -> None:
    """One program per row of x: the online pass when ``logp`` is given, dX in place when ``g`` is."""
    rows, V = x.shape
    if rows == 0:
        return
    block, warps = block_config(V)
    logit_scale, softcap, inv_softcap = transform_args(opts.logit_scale, opts.softcap)
    _logprobs_kernel[(rows,)](
        x, labels, logp if logp is not None else lse, lse, ent if ent is not None else lse,
        g if g is not None else lse, e if e is not None else lse, scale if scale is not None else lse,
        n_vocab=V, logit_scale=logit_scale, softcap=softcap, inv_softcap=inv_softcap,
        inv_temp=1.0 / float(opts.temperature), stride_x=x.stride(0),
        HAS_SOFTCAP=opts.softcap is not None, ENTROPY=ent is not None, ONLINE=logp is not None,
        WRITE_GRAD=g is not None, BLOCK_V=block, num_warps=warps,
    )


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """Autograd node of ``fused_linear_logprobs`` (Triton path): returns logp, or (logp, entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts: _Options, need):
        N = hidden.shape[0]
        f32 = dict(device=hidden.device, dtype=torch.float32)
        # head_chunks covers rows [0, N) in chunks and the pass stores each row's values.
        logp, lse = torch.empty(N, **f32), torch.empty(N, **f32)
        ent = torch.empty(N, **f32) if opts.entropy else None

        def run_pass(x, s, e):
            _launch(opts, x, labels[s:e], lse[s:e], None if ent is None else ent[s:e], logp=logp[s:e])

        with torch.autocast(hidden.device.type, enabled=False):
            head_chunks(hidden, weight, bias, None, opts.workspace_mib, run_pass)
        ctx.opts, ctx.need = opts, need
        if any(need):
            ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        return (logp, ent) if opts.entropy else logp

    @staticmethod
    @first_order_only
    def backward(ctx, *grads):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.need
        g = grads[0].float().contiguous()
        e = grads[1].float().contiguous() if ctx.opts.entropy else None
        scaling = GradScaling(hidden.dtype, torch.ones(1, device=hidden.device), (g, e))

        def run_pass(x, s, t):
            _launch(ctx.opts, x, labels[s:t], lse[s:t], None if ent is None else ent[s:t], g=g[s:t],
                    e=None if e is None else e[s:t], scale=scaling.c)

        with torch.autocast(hidden.device.type, enabled=False):
            dh, dw32, db32 = head_chunks(hidden, weight, bias, None, ctx.opts.workspace_mib, run_pass,
                                         need_h=need_h, need_w=need_w, need_b=need_b, post=scaling.post)
        return (dh, finish_grad(dw32, weight.dtype, scaling.post) if need_w else None,
                finish_grad(db32, bias.dtype, scaling.post) if need_b else None, None, None, None)


def fused_linear_logprobs(hidden, weight, labels, bias=None, *, temperature=1.0, softcap=None,
                          logit_scale=None, return_entropy=False, workspace_mib=None):
    """log softmax(z / temperature)[label] per row, z = soft-capped ``(hidden @ weight.T + bias)·logit_scale``,
    without materialising the [N, V] logits. Differentiable in hidden, weight and bias.

    Args:
        hidden: [N, D] fp32/bf16/fp16.
        weight: [V, D], hidden's dtype, or float32 with bf16/fp16 hidden (fp32 master weights under
            autocast: the products read its half-precision values, its gradient stays fp32, unrounded);
            frozen (requires_grad=False) means no dW work.
        labels: [N] integers < V; labels < 0 are read as index 0 (mask those rows yourself).
        bias: optional [V], weight's dtype.
        temperature: T > 0 dividing the (soft-capped) logits.
        softcap: c > 0: logits become c·tanh(z/c) before the temperature.
        logit_scale: multiplies the logits before the soft-cap.
        return_entropy: also return the entropy of softmax(z/T) per row (differentiable).
        workspace_mib: bound of the per-chunk logit workspace in MiB (at least 16 rows); None:
            1024 with a trainable weight, else what 1,024 rows take, at least 256.

    Returns:
        float32 [N] log-probabilities, or (log-probabilities, entropy).
    """
    check_head_inputs(hidden, weight, labels, bias, workspace_mib)
    if not (_is_real(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    check_transform(softcap, logit_scale)
    V = weight.shape[0]
    label_summary(labels, V, None)
    if not use_triton(hidden, weight, labels, bias):
        weight, bias = rounded_to(weight, hidden.dtype), rounded_to(bias, hidden.dtype)  # a master weight
        mib = 1024 if workspace_mib is None else workspace_mib
        return reference.fused_linear_logprobs(
            hidden, weight, labels, bias, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
            return_entropy=return_entropy, chunk_rows=max(1, int(mib * 2 ** 20 // (4 * V))))
    opts = _Options(float(temperature), softcap, logit_scale, bool(return_entropy), workspace_mib)
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    return FusedLinearLogprobsFunction.apply(hidden, weight, bias, labels.contiguous(), opts, need)
