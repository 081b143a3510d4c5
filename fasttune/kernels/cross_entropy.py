"""Fused linear cross-entropy (the loss without the [N, V] logits) and plain cross-entropy on logits.

Forward, per row i with label y (x = raw product h·Wᵀ + b, c = softcap, s = logit_scale):

    u   = s·x                     z = c·tanh(u/c)  (z = u without softcap)
    lse = log Σ_j e^{z_j}         p_j = e^{z_j − lse}
    ℓ_i = (1−ε)(lse − z_y) + ε(lse − Σ_j z_j / V) + λ·lse²        (0 where y == ignore_index)

ε = label_smoothing, λ = z_loss. Reductions: "sum" Σℓ_i, "mean" Σℓ_i / count(non-ignored) (0 when
there are none), "none" the vector; ``num_items_in_batch`` divides the sum instead (0 reads as 1,
so an all-ignored batch gives 0, never NaN). Stats: entropy H = lse − Σ p_j z_j = log s' − Σ
e'_j(z_j − m)/s' (computed relative to the running max m), correct = (argmax z == y).

Hand-derived gradient (named as in the kernel):

    a      = 1 + 2λ·lse                                      (z-loss makes p_j weigh more)
    dℓ/dz_j = a·p_j − (1−ε)·[j == y] − ε/V
    slope_j = dz_j/dx_j = s·(1 − (z_j/c)²)                   (s without softcap)
    dX_ij  = w·r_i · dℓ/dz_j · slope_j                       (w: reduction weight, r_i: upstream row weight)
    dH = dX W,   dW = dXᵀ H,   db = Σ_i dX_i

The Triton pass is one program per row: pass 1 reads the row once (online max/sum, Σz, Σp·z,
argmax), pass 2 re-reads it and writes dX over it in place (two reads + one write of the
workspace, ~3–4% of the GEMM time at Llama-3 size). Computing dX in the forward pass means the
logits are made once: three GEMMs with a trainable W, two when it is frozen.

Fused path (``fused_linear_cross_entropy``): ignored rows are dropped first (every GEMM shrinks by
the masked fraction), then chunks of tokens go through a workspace of at most ``workspace_mib``
(default: 1024 MiB with W trainable; frozen, what 1,024 rows take, at least 256 MiB, see
``_lce_common.default_workspace_mib``): cuBLAS logits, the pass, dH_chunk = dX W (input dtype),
dW += dXᵀ H in fp32, db += column sums. Scalar reductions precompute every gradient in forward and scale them by the
upstream scalar in backward. reduction="none": dH rows scale per row, so with a frozen W (LoRA,
TRL log-probs) dH is precomputed and scaled by rows; with a trainable W (or bias) dW cannot be, so
backward recomputes the chunks with r_i = upstream gradient (four GEMMs). Gradients precomputed in
forward are handed over once: a second backward through the same graph raises; so does double
backward (``first_order_only``). One host sync per call returns the count of non-ignored labels
(the compaction sizes its products with it) together with their min/max, so an out-of-range label
raises a ValueError on the host. N = 0 and all-ignored batches give a zero loss and zero gradients.

Memory above the inputs (trainable W): workspace + dW fp32 accumulator [V, D] (2× the gradient of
a bf16 W) + dH; frozen W: workspace + dH. An fp32 W under bf16/fp16 hidden (autocast over fp32 master
weights) is copied to the hidden's dtype for the products while the chunks run (as autocast's cast
does), and the accumulator is its gradient: no second dW-sized buffer, and dW is not rounded to 16
bits (stock autocast rounds it to bf16, then upcasts it). dtypes: fp32, bf16, fp16 (matmuls in the
input dtype with fp32 accumulation, the pass in fp32, dW accumulated in fp32 then cast; fp16 dX is
pre-scaled, see ``_lce_common``). Loss is float32. Plain ``cross_entropy`` reads given logits (never writes them)
and writes dX into a new tensor in backward, from the lse saved in forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference
from ._backend import check_float, check_same_device, use_triton
from ._lce_common import (GradScaling, _logit_slope, _logits, _online_softmax, block_config,
                          check_head_inputs, check_labels_dtype, check_transform, finish_grad,
                          first_order_only, head_chunks, label_summary, master_weight, rounded_to,
                          transform_args)

__all__ = ["fused_linear_cross_entropy", "cross_entropy", "master_weight"]


@triton.jit
def _cross_entropy_kernel(
    x_ptr,  # raw products x = h·Wᵀ + b [rows, n_vocab], rows stride_x apart; fp32/bf16/fp16
    dx_ptr,  # out: dX [rows, n_vocab], rows stride_dx apart; x's dtype (may be x_ptr: in place; WRITE_GRAD only)
    labels_ptr,  # labels [rows], integer
    row_w_ptr,  # upstream weight r_i per row [rows], fp32 (HAS_ROW_WEIGHT only)
    scale_ptr,  # gradient factor c [1], fp32 (WRITE_GRAD only; _lce_common.GradScaling)
    loss_ptr,  # out: loss per row [rows], fp32 (ONLINE only)
    lse_ptr,  # lse per row [rows], fp32: written when ONLINE, else read
    ent_ptr,  # out: entropy per row [rows], fp32 (STATS only)
    correct_ptr,  # out: argmax == label per row [rows], int8 (STATS only)
    n_vocab, ignore_index, label_smoothing, z_loss, logit_scale, softcap, inv_softcap,
    stride_x, stride_dx,
    HAS_SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, ONLINE: tl.constexpr, STATS: tl.constexpr,
    WRITE_GRAD: tl.constexpr, HAS_ROW_WEIGHT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y = tl.load(labels_ptr + row)
    # Out-of-range labels were rejected on the host; treating them as ignored here only keeps every
    # load in bounds.
    valid = (y != ignore_index) & (y >= 0) & (y < n_vocab)
    y = tl.where(valid, y, 0).to(tl.int32)
    if ONLINE:
        m, s, zsum, ez, best = _online_softmax(x_row, n_vocab, logit_scale, softcap, inv_softcap, 1.0,
                                               HAS_SOFTCAP, SMOOTH, STATS, STATS, BLOCK_V)
        lse = m + tl.log(s)
        z_y = _logits(tl.load(x_row + y).to(tl.float32), logit_scale, softcap, inv_softcap, HAS_SOFTCAP)
        loss = (1.0 - label_smoothing) * (lse - z_y) + z_loss * lse * lse
        if SMOOTH:
            loss += label_smoothing * (lse - zsum / n_vocab)
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row, lse)
        if STATS:
            tl.store(ent_ptr + row, tl.where(valid, tl.log(s) - ez / s, 0.0))
            tl.store(correct_ptr + row, (valid & (best == y)).to(tl.int8))
    else:
        lse = tl.load(lse_ptr + row)
    if WRITE_GRAD:
        w = tl.load(scale_ptr)
        if HAS_ROW_WEIGHT:
            w = w * tl.load(row_w_ptr + row)
        w = tl.where(valid, w, 0.0)
        a = 1.0 + 2.0 * z_loss * lse
        off = label_smoothing / n_vocab
        hit = 1.0 - label_smoothing
        dx_row = dx_ptr + row * stride_dx
        n_blocks = tl.cdiv(n_vocab, BLOCK_V)
        for i in range(0, n_blocks):
            # Backwards: the row's tail, read last by pass 1, is the likeliest still in L2.
            cols = (n_blocks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
            mask = cols < n_vocab
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            z = _logits(x, logit_scale, softcap, inv_softcap, HAS_SOFTCAP)
            p = tl.exp(z - lse)
            g = a * p - off - tl.where(cols == y, hit, 0.0)
            g = g * _logit_slope(z, logit_scale, inv_softcap, HAS_SOFTCAP) * w
            tl.store(dx_row + cols, g.to(dx_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Options:
    ignore_index: int = -100
    label_smoothing: float = 0.0
    softcap: float | None = None
    logit_scale: float | None = None
    z_loss: float = 0.0
    reduction: str = "mean"
    return_stats: bool = False
    workspace_mib: float | None = None


def _launch(opts: _Options, x, labels, lse, *, dx=None, loss=None, ent=None, correct=None,
            row_w=None, scale=None) -> None:
    """One program per row of x. Online pass when ``loss`` is given (else reads ``lse``); writes
    dX into ``dx`` (which may be x) when given."""
    rows, V = x.shape
    if rows == 0:
        return
    block, warps = block_config(V)
    write = dx is not None
    stats = ent is not None
    dummy = lse
    logit_scale, softcap, inv_softcap = transform_args(opts.logit_scale, opts.softcap)
    _cross_entropy_kernel[(rows,)](
        x, dx if write else x, labels, row_w if row_w is not None else dummy,
        scale if scale is not None else dummy, loss if loss is not None else dummy, lse,
        ent if stats else dummy, correct if stats else dummy,
        n_vocab=V, ignore_index=opts.ignore_index, label_smoothing=float(opts.label_smoothing),
        z_loss=float(opts.z_loss), logit_scale=logit_scale, softcap=softcap, inv_softcap=inv_softcap,
        stride_x=x.stride(0), stride_dx=(dx if write else x).stride(0),
        HAS_SOFTCAP=opts.softcap is not None, SMOOTH=opts.label_smoothing != 0, ONLINE=loss is not None,
        STATS=stats, WRITE_GRAD=write, HAS_ROW_WEIGHT=row_w is not None, BLOCK_V=block, num_warps=warps,
    )


def _reduction_weight(opts: _Options, count: int, num_items, device) -> torch.Tensor:
    """w as a 1-element fp32 device tensor (no host sync for a tensor ``num_items``)."""
    if opts.reduction == "none":
        return torch.ones(1, device=device)
    if num_items is not None:
        return 1.0 / num_items.reshape(1)
    return torch.full((1,), 1.0 / max(count, 1) if opts.reduction == "mean" else 1.0, device=device)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd node of ``fused_linear_cross_entropy`` (Triton path). Returns (loss, entropy,
    correct); the last two are empty unless ``opts.return_stats``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts: _Options, count: int, num_items, need):
        N = hidden.shape[0]
        dev = hidden.device
        # The count is known on the host: a sized nonzero, which does not wait for the GPU as nonzero() does.
        rows = None if count == N else torch.nonzero_static(labels != opts.ignore_index, size=count).squeeze(1)
        y = (labels if rows is None else labels.index_select(0, rows)).contiguous()
        w = _reduction_weight(opts, count, num_items, dev)
        scalar = opts.reduction != "none"
        need_h, need_w, need_b = need
        recompute = not scalar and (need_w or need_b)
        grad_now = any(need) and not recompute
        f32 = dict(device=dev, dtype=torch.float32)
        # head_chunks covers the count processed rows in chunks; the pass stores every row.
        loss_c, lse_c = torch.empty(count, **f32), torch.empty(count, **f32)
        ent_c = torch.empty(count, **f32) if opts.return_stats else None
        cor_c = torch.empty(count, device=dev, dtype=torch.int8) if opts.return_stats else None
        scaling = GradScaling(hidden.dtype, w) if grad_now else None

        def run_pass(x, s, e):
            _launch(opts, x, y[s:e], lse_c[s:e], loss=loss_c[s:e], dx=x if grad_now else None,
                    ent=None if ent_c is None else ent_c[s:e], correct=None if cor_c is None else cor_c[s:e],
                    scale=None if scaling is None else scaling.c)

        with torch.autocast(dev.type, enabled=False):
            dh, dw32, db32 = head_chunks(hidden, weight, bias, rows, opts.workspace_mib, run_pass,
                                         need_h=grad_now and need_h, need_w=grad_now and need_w,
                                         need_b=grad_now and need_b,
                                         post=None if scaling is None else scaling.post)

        def spread(t, fill_dtype):
            if rows is None:
                return t
            return torch.zeros(N, device=dev, dtype=fill_dtype).index_copy_(0, rows, t)

        # A fresh 0-d tensor, not a view: the Trainer scales the loss in place (loss *= ...).
        loss = (loss_c.sum() * w[0]) if scalar else spread(loss_c, torch.float32)
        if opts.return_stats:
            ent, cor = spread(ent_c, torch.float32), spread(cor_c, torch.int8).view(torch.bool)
        else:
            ent, cor = loss.new_empty(0), torch.empty(0, device=dev, dtype=torch.bool)
        ctx.mark_non_differentiable(ent, cor)
        ctx.opts, ctx.rows, ctx.need, ctx.recompute, ctx.consumed = opts, rows, need, recompute, False
        if recompute:
            ctx.save_for_backward(hidden, weight, bias)
            ctx.y, ctx.lse = y, lse_c
        else:
            ctx.dh, ctx.dw32, ctx.db32 = dh, dw32, db32
            ctx.post = None if scaling is None else scaling.post
            ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return loss, ent, cor

    @staticmethod
    @first_order_only
    def backward(ctx, g_loss, _g_ent, _g_cor):
        need_h, need_w, need_b = ctx.need
        if ctx.recompute:
            gh, gw, gb = _recompute_grads(ctx, g_loss.float())
            return gh, gw, gb, None, None, None, None, None
        if ctx.consumed:
            raise RuntimeError(
                "fused_linear_cross_entropy: its gradients are precomputed in forward and handed over by "
                "the first backward; a second backward through the same graph is not supported "
                "(recompute the loss instead of retain_graph=True)")
        ctx.consumed = True
        dh, dw32, db32, post = ctx.dh, ctx.dw32, ctx.db32, ctx.post
        ctx.dh = ctx.dw32 = ctx.db32 = None  # hand over: nothing gradient-sized stays in the graph
        if ctx.opts.reduction == "none":  # frozen W: dH rows scale by the upstream row gradients
            return dh.mul_(g_loss.unsqueeze(1)) if need_h else None, None, None, None, None, None, None, None
        factor = g_loss.float() if post is None else post * g_loss.float()
        gh = dh.mul_(g_loss) if need_h else None
        gw = finish_grad(dw32, ctx.w_dtype, factor) if need_w else None
        gb = finish_grad(db32, ctx.b_dtype, factor) if need_b else None
        return gh, gw, gb, None, None, None, None, None


def _recompute_grads(ctx, g_rows: torch.Tensor):
    """reduction="none" with a trainable W or bias: rerun the chunks with r_i = upstream gradient."""
    hidden, weight, bias = ctx.saved_tensors
    need_h, need_w, need_b = ctx.need
    rows, y, lse = ctx.rows, ctx.y, ctx.lse
    r = (g_rows if rows is None else g_rows.index_select(0, rows)).contiguous()
    scaling = GradScaling(hidden.dtype, torch.ones(1, device=hidden.device), (r,))

    def run_pass(x, s, e):
        _launch(ctx.opts, x, y[s:e], lse[s:e], dx=x, row_w=r[s:e], scale=scaling.c)

    with torch.autocast(hidden.device.type, enabled=False):
        dh, dw32, db32 = head_chunks(hidden, weight, bias, rows, ctx.opts.workspace_mib, run_pass,
                                     need_h=need_h, need_w=need_w, need_b=need_b, post=scaling.post)
    return (dh, finish_grad(dw32, weight.dtype, scaling.post) if need_w else None,
            finish_grad(db32, bias.dtype, scaling.post) if need_b else None)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd node of ``cross_entropy`` on given logits (Triton path)."""

    @staticmethod
    def forward(ctx, logits, labels, opts: _Options, count: int, num_items):
        N = logits.shape[0]
        f32 = dict(device=logits.device, dtype=torch.float32)
        loss_rows, lse = torch.empty(N, **f32), torch.empty(N, **f32)  # one program per row stores both
        _launch(opts, logits, labels, lse, loss=loss_rows)
        w = _reduction_weight(opts, count, num_items, logits.device)
        ctx.save_for_backward(logits, labels, lse, w)
        ctx.opts = opts
        return (loss_rows.sum() * w[0]) if opts.reduction != "none" else loss_rows

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        logits, labels, lse, w = ctx.saved_tensors
        dx = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)  # every row, every column stored
        if ctx.opts.reduction == "none":
            _launch(ctx.opts, logits, labels, lse, dx=dx, row_w=g.float().contiguous(), scale=w)
        else:
            _launch(ctx.opts, logits, labels, lse, dx=dx, scale=(w * g.float()).reshape(1))
        return dx, None, None, None, None


# ------------------------------------------------------------------------------------------------
# public functions
# ------------------------------------------------------------------------------------------------


def _check_options(ignore_index, reduction, label_smoothing, softcap, z_loss, logit_scale=None):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not (isinstance(z_loss, (int, float)) and z_loss >= 0 and z_loss != float("inf")):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    check_transform(softcap, logit_scale)


def _num_items(num_items_in_batch, device):
    """The divisor as a 1-element fp32 device tensor, or None; 0 reads as 1 (no NaN on empty batches)."""
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a number or a 1-element tensor, "
                             f"got shape {tuple(num_items_in_batch.shape)}")
        t = num_items_in_batch.detach().to(device=device, dtype=torch.float32).reshape(1)
        return torch.where(t == 0, torch.ones_like(t), t)
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)) \
            or not num_items_in_batch >= 0:
        raise ValueError(f"num_items_in_batch must be a number >= 0 or a tensor, got {num_items_in_batch!r}")
    return torch.full((1,), float(num_items_in_batch) or 1.0, device=device)


def _reference_chunk_rows(workspace_mib, V: int) -> int:
    mib = 1024 if workspace_mib is None else workspace_mib
    return max(1, int(mib * 2 ** 20 // (4 * V)))  # the reference works in fp32


def fused_linear_cross_entropy(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
                               num_items_in_batch=None, label_smoothing=0.0, softcap=None, logit_scale=None,
                               z_loss=0.0, return_stats=False, workspace_mib=None, label_stats=None):
    """Cross-entropy of ``(hidden @ weight.T + bias)·logit_scale`` (soft-capped) against ``labels``,
    without materialising the [N, V] logits.

    Args:
        hidden: [N, D] fp32/bf16/fp16 (the last hidden states, already flattened).
        weight: [V, D] (the lm_head weight), hidden's dtype, or float32 with bf16/fp16 hidden (fp32 master
            weights under autocast: the products read its half-precision values, its gradient stays fp32,
            unrounded). Frozen (requires_grad=False): no dW work.
        labels: [N] integers, already shifted; ``ignore_index`` rows contribute nothing.
        bias: optional [V], weight's dtype.
        ignore_index: label value to skip.
        reduction: "mean" (over non-ignored rows; 0 when none), "sum" or "none" (float32 [N]).
        num_items_in_batch: int or 1-element tensor dividing the sum instead ("mean"/"sum"); 0 reads as 1.
        label_smoothing: ε in [0, 1]: (1−ε)·CE + ε·(lse − mean_j z_j).
        softcap: c > 0: logits become c·tanh(z/c) (Gemma-2).
        logit_scale: multiplies the logits before the soft-cap (e.g. 1/logits_scaling).
        z_loss: λ ≥ 0 adds λ·lse² per row.
        return_stats: also return {"entropy": float32 [N], "correct": bool [N]} (0/False where ignored).
        workspace_mib: bound of the per-chunk logit workspace in MiB (at least 16 rows); None:
            1024 with a trainable weight, else what 1,024 rows take, at least 256.
        label_stats: ``LabelSummary(labels, ignore_index)`` started earlier (the model patch starts it
            at the top of the forward): the head reads the count it needs on the host without a sync
            that would stall the launches until the GPU has run the whole forward.

    Returns:
        float32 loss (0-d, or [N] for "none"), and the stats dict when ``return_stats``.
        N = 0 or every row ignored gives a zero loss and zero gradients.
    """
    check_head_inputs(hidden, weight, labels, bias, workspace_mib)
    _check_options(ignore_index, reduction, label_smoothing, softcap, z_loss, logit_scale)
    V = weight.shape[0]
    count = label_summary(labels, V, ignore_index, label_stats)
    num = _num_items(num_items_in_batch, hidden.device)
    if not use_triton(hidden, weight, labels, bias):
        weight, bias = rounded_to(weight, hidden.dtype), rounded_to(bias, hidden.dtype)  # a master weight
        return reference.fused_linear_cross_entropy(
            hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
            num_items_in_batch=None if num is None else num.reshape(()), label_smoothing=label_smoothing,
            softcap=softcap,
            logit_scale=logit_scale, z_loss=z_loss, return_stats=return_stats,
            chunk_rows=_reference_chunk_rows(workspace_mib, V))
    opts = _Options(ignore_index, float(label_smoothing), softcap, logit_scale, float(z_loss), reduction,
                    bool(return_stats), workspace_mib)
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    loss, ent, cor = FusedLinearCrossEntropyFunction.apply(hidden, weight, bias, labels, opts, count, num, need)
    return (loss, {"entropy": ent, "correct": cor}) if return_stats else loss


def cross_entropy(logits, labels, *, ignore_index=-100, reduction="mean", num_items_in_batch=None,
                  label_smoothing=0.0, softcap=None, z_loss=0.0):
    """Cross-entropy on given logits [N, V] with the fused head's semantics (soft-cap, smoothing,
    z-loss, ``num_items_in_batch``). The logits are never written; their gradient is a new tensor
    of their dtype. Returns a float32 loss (0-d, or [N] for "none")."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be torch.Tensors")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    if labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"labels must be [N] = [{logits.shape[0]}], got shape {tuple(labels.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column (V ≥ 1)")
    check_float("logits", logits)
    check_labels_dtype(labels)
    check_same_device(logits=logits, labels=labels)
    _check_options(ignore_index, reduction, label_smoothing, softcap, z_loss)
    V = logits.shape[1]
    count = label_summary(labels, V, ignore_index)
    num = _num_items(num_items_in_batch, logits.device)
    if not use_triton(logits, labels):
        return reference.cross_entropy(
            logits, labels, ignore_index=ignore_index, reduction=reduction,
            num_items_in_batch=None if num is None else num.reshape(()), label_smoothing=label_smoothing,
            softcap=softcap, z_loss=z_loss)
    opts = _Options(ignore_index, float(label_smoothing), softcap, None, float(z_loss), reduction)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return CrossEntropyFunction.apply(logits, labels.contiguous(), opts, count, num)
