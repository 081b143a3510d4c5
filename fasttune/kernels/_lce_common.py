"""Pieces shared by the fused linear loss heads (``cross_entropy.py``, ``logprobs.py``).

Both heads compute logits z = T((h Wᵀ + b)·scale) chunk by chunk, where T is the optional soft-cap
c·tanh(·/c), and never hold [N, V]. Per chunk of tokens: one cuBLAS product into a bounded
workspace, one Triton pass over the workspace (the caller's kernel, which may overwrite the logits
with their gradient dX in place), then the gradient products dH = dX W, dW += dXᵀ H, db += Σ_rows dX.

Shared here: the jit helpers every pass uses (logit transform and its slope, the online softmax of
one row), the chunk planner and driver, the fp32-accumulated products, input validation.

fp16 note: dX is stored in the input dtype. Unscaled, a mean-reduced logit gradient (p_j / n_tokens)
underflows fp16, and a GradScaler's factor arrives only in backward, too late to rescue it. So for
fp16 the kernels write dX·c with c = FP16_GRAD_SCALE / max|row weight| and the products are
unscaled by ``post`` = w/c in fp32 (see ``GradScaling``). bf16 and fp32 need none of this (c = w).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._backend import check_float, check_same_device, interpreter_on, next_power_of_2
from .label_summary import LabelSummary
from .scratch_pool import scratch

DEFAULT_WORKSPACE_MIB = 1024  # W trainable: every chunk read-modify-writes the fp32 dW, so fewer is faster
# W frozen there is nothing to amortise: chunks of ~1k rows run the products as fast as 4k (bench_loss_chunks.py,
# RESULTS.md), so the workspace shrinks to what 1,024 rows need, at least 256 MiB (0.75 GiB less at an 8B head).
FROZEN_WORKSPACE_MIB = 256
FROZEN_MIN_ROWS = 1024
MIN_CHUNK_ROWS = 16
FP16_GRAD_SCALE = 2.0 ** 11  # |dX| ≤ ~|logit_scale|·(1 + 2λ·lse): 2^11 leaves 32× headroom below 65504

# ------------------------------------------------------------------------------------------------
# jit helpers
# ------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # No libdevice (docs/FACTS.md, Triton interpreter). exp form for |x| ≥ 1/8, odd Taylor series
    # below (keeps fp32 relative precision near 0, where 1 - e^{-2|x|} would cancel).
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    r = tl.where(ax < 0.125, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _logits(x, logit_scale, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr):
    """z from the raw product x = h·w + b (fp32). Multiplying by 1/c instead of dividing by c saves
    an SFU op per element, the scarce unit on Gemma's 256K-wide soft-capped rows."""
    z = x * logit_scale
    if HAS_SOFTCAP:
        z = softcap * _tanh(z * inv_softcap)
    return z


@triton.jit
def _logit_slope(z, logit_scale, inv_softcap, HAS_SOFTCAP: tl.constexpr):
    """dz/dx = scale · (1 − (z/c)²) (the soft-cap factor only when soft-capped)."""
    if HAS_SOFTCAP:
        r = z * inv_softcap
        slope = logit_scale * (1.0 - r * r)
    else:
        slope = logit_scale
    return slope


@triton.jit
def _online_softmax(row_ptr,  # one row of raw products x = h·Wᵀ + b [n_vocab], contiguous; fp32/bf16/fp16
                    n_vocab, logit_scale, softcap, inv_softcap, inv_temp,
                    HAS_SOFTCAP: tl.constexpr, SUM_Z: tl.constexpr, SUM_PZ: tl.constexpr,
                    ARGMAX: tl.constexpr, BLOCK_V: tl.constexpr):
    """One read of a row of raw products. Returns, for zt = z·inv_temp:
    m = max zt, s = Σ e^{zt−m}, zsum = Σ zt (SUM_Z), ez = Σ e^{zt−m}(zt−m) (SUM_PZ; entropy is
    log s − ez/s, kept relative to m to avoid cancellation), best = first argmax (ARGMAX)."""
    m = float("-inf")
    s = 0.0
    zsum = 0.0
    ez = 0.0
    best = 0
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_vocab
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = _logits(x, logit_scale, softcap, inv_softcap, HAS_SOFTCAP) * inv_temp
        z = tl.where(mask, z, float("-inf"))
        bmax = tl.max(z, axis=0)
        m_new = tl.maximum(m, bmax)
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        if SUM_PZ:
            # Re-centre the old sum on m_new: Σ e'(z − m_new) = α(ez + (m − m_new)·s).
            shift = tl.where(s > 0, m - m_new, 0.0) * s
            ez = alpha * (ez + shift) + tl.sum(e * tl.where(mask, z - m_new, 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        if SUM_Z:
            zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        if ARGMAX:
            best = tl.where(bmax > m, tl.argmax(z, axis=0) + start, best)
        m = m_new
    return m, s, zsum, ez, best


def transform_args(logit_scale, softcap) -> tuple[float, float, float]:
    """(logit_scale, c, 1/c) as the kernels take them (1.0 where unused)."""
    c = 1.0 if softcap is None else float(softcap)
    return 1.0 if logit_scale is None else float(logit_scale), c, 1.0 / c


def block_config(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a one-row-per-program pass over V columns."""
    if interpreter_on():
        # The interpreter's cost is per op, not per element: few, wide blocks, but two when V > 128
        # so that tests exercise the cross-block online merge and the masked tail.
        return max(128, min(next_power_of_2(max(1, -(-V // 2))), 65536)), 4
    block = min(next_power_of_2(V), 8192)
    return block, (16 if block >= 8192 else 8 if block >= 2048 else 4)


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_head_inputs(hidden, weight, labels, bias, workspace_mib) -> None:
    """Shapes, dtypes and devices of a linear head's inputs; raises naming the argument."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, D], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, D], got shape {tuple(weight.shape)}")
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D [N], got shape {tuple(labels.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} disagree on D")
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels has {labels.shape[0]} entries but hidden has {hidden.shape[0]} rows")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V ≥ 1)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dtype != weight.dtype and not master_weight(hidden, weight):
        raise TypeError(f"hidden and weight must share a dtype (or weight float32 with bf16/fp16 hidden), "
                        f"got {hidden.dtype} and {weight.dtype}")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
    check_labels_dtype(labels)
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    check_workspace(workspace_mib)


def master_weight(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """True for an fp32 weight under bf16/fp16 hidden states: autocast over fp32 master weights. The
    products read a half-precision copy of it (autocast's cast); its gradient stays fp32, unrounded."""
    return weight.dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16)


def rounded_to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t``'s values rounded to ``dtype``, kept in t's dtype, with an identity gradient: what the
    products of a master weight see, for the plain-PyTorch references (t + (r − t) is exactly r)."""
    if t is None or t.dtype == dtype:
        return t
    return t + (t.detach().to(dtype).to(t.dtype) - t.detach())


def check_labels_dtype(labels) -> None:
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")


def check_workspace(workspace_mib) -> None:
    if workspace_mib is not None and not (_is_real(workspace_mib) and workspace_mib > 0):
        raise ValueError(f"workspace_mib must be a number > 0 or None, got {workspace_mib!r}")


def check_transform(softcap, logit_scale) -> None:
    if softcap is not None and not (_is_real(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a number > 0 or None, got {softcap!r}")
    if logit_scale is not None and not _is_real(logit_scale):
        raise ValueError(f"logit_scale must be a finite number or None, got {logit_scale!r}")


def label_summary(labels: torch.Tensor, V: int, ignore_index: int | None, started=None) -> int:
    """Count of the rows that are not ``ignore_index``; raises ValueError if one is outside [0, V).

    One host sync (count, min and max come back together). The Triton path needs the count on
    the host anyway (it sizes the compacted products), so the range check rides on that sync and
    fails here, clearly, instead of as a device-side assert. ``ignore_index=None``: labels < 0
    are read as 0 (log-probs), only the upper bound is checked. ``started``: a ``LabelSummary`` of
    these labels begun earlier, whose copy has long landed: no new sync.
    """
    if started is None:
        return LabelSummary(labels, ignore_index).count(V)
    if not isinstance(started, LabelSummary) or not started.matches(labels, ignore_index):
        raise ValueError("label_stats must be a LabelSummary started for these labels (the same tensor, "
                         f"unchanged since, ignore_index={ignore_index}); got {started!r}")
    return started.count(V)


def first_order_only(backward):
    """Decorate an autograd.Function backward: raise on double backward (create_graph=True), whose
    second-order terms these hand-written gradients do not provide, instead of letting them
    silently vanish; run the body without recording a graph."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__.removesuffix('Backward')}: double backward (create_graph=True) is not "
                "supported; its gradients are first-order only")
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper


# ------------------------------------------------------------------------------------------------
# chunking and products
# ------------------------------------------------------------------------------------------------


def default_workspace_mib(V: int, elem_size: int, trainable: bool) -> float:
    """The workspace bound when the caller gives none: DEFAULT_WORKSPACE_MIB with a dW to accumulate,
    else what FROZEN_MIN_ROWS rows take, at least FROZEN_WORKSPACE_MIB (never more than the default)."""
    if trainable:
        return DEFAULT_WORKSPACE_MIB
    return min(DEFAULT_WORKSPACE_MIB, max(FROZEN_WORKSPACE_MIB, FROZEN_MIN_ROWS * V * elem_size / 2 ** 20))


def plan_chunk_rows(n: int, V: int, elem_size: int, workspace_mib, trainable: bool = True) -> int:
    """Rows per chunk so the [rows, V] workspace stays within ``workspace_mib`` (None:
    ``default_workspace_mib``; at least MIN_CHUNK_ROWS rows); chunks are balanced and rounded to
    multiples of 16 rows. ``trainable``: a dW is accumulated chunk by chunk."""
    mib = default_workspace_mib(V, elem_size, trainable) if workspace_mib is None else workspace_mib
    budget = mib * 2 ** 20
    cap = max(MIN_CHUNK_ROWS, int(budget // (V * elem_size)))
    if n <= cap:
        return max(n, 1)
    chunks = -(-n // cap)
    rows = -(-n // chunks)
    return min(cap, -(-rows // 16) * 16)


_FP32_MODE: dict = {}


def _fp32_mode(device: torch.device, dtype: torch.dtype) -> str:
    """How to get fp32-output products of half-precision operands on this device, probed once:
    "addmm" (cuBLAS accumulates into an fp32 C: torch.addmm(..., out_dtype=fp32, out=C)),
    "mm" (fp32-output product per slab, then added), or "upcast" (fp32 operands per slab; CPU)."""
    key = (device.type, device.index, dtype)
    if key not in _FP32_MODE:
        mode = "upcast"
        if device.type == "cuda":
            # Small integers: every product and sum is exact, so the check is an equality.
            a = ((torch.arange(24 * 32, device=device) % 7) - 3).reshape(24, 32).to(dtype).t()
            b = ((torch.arange(24 * 40, device=device) % 5) - 2).reshape(24, 40).to(dtype)
            want = 2 * (a.float() @ b.float())
            for cand in ("addmm", "mm"):
                acc = torch.full((32, 40), float("nan"), device=device)  # beta=0 must not read it
                try:
                    _accumulate(cand, acc, a, b, 0.0)
                    _accumulate(cand, acc, a, b, 1.0)
                except (RuntimeError, TypeError):
                    continue
                if torch.equal(acc, want):
                    mode = cand
                    break
        _FP32_MODE[key] = mode
    return _FP32_MODE[key]


def _accumulate(mode: str, acc, a, b, beta: float) -> None:
    if mode == "addmm":
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
        return
    slab = max(1, (256 * 2 ** 20) // (4 * max(1, b.shape[1] + (a.shape[1] if mode == "upcast" else 0))))
    bf = b.float() if mode == "upcast" else b
    for r in range(0, a.shape[0], slab):
        part = a[r:r + slab]
        prod = part.float() @ bf if mode == "upcast" else torch.mm(part, b, out_dtype=torch.float32)
        if beta == 0:
            acc[r:r + slab].copy_(prod)
        else:
            acc[r:r + slab].add_(prod)


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """acc = beta·acc + a @ b with acc float32 and the product accumulated in fp32 (beta 0 or 1)."""
    if a.dtype == torch.float32:
        if beta == 0:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    _accumulate(_fp32_mode(acc.device, a.dtype), acc, a, b, beta)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as float32 (fp32 accumulation for half-precision operands)."""
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32)  # beta = 0: written, never read
    addmm_fp32_(out, a, b, beta=0.0)
    return out


class GradScaling:
    """The factor c the kernel folds into dX (a 1-element fp32 device tensor) and the factor
    ``post`` (device tensor, or None when 1) that turns products of dX into true gradients.

    True logit gradient G = w·r_i·u (w: reduction weight, r_i: per-row upstream weight, u: the
    unit gradient); the kernel writes dX = c·r_i·u, so G = (w/c)·dX. bf16/fp32: c = w, post None.
    fp16: c = FP16_GRAD_SCALE / max|r|, post = w/c, applied in fp32 after the products.
    """

    def __init__(self, dtype: torch.dtype, w: torch.Tensor, row_weights=()):
        w = w.reshape(1).float()
        if dtype != torch.float16:
            self.c, self.post = w, None
            return
        peak = None
        for r in row_weights:
            if r is not None and r.numel():
                m = r.abs().amax().float()
                peak = m if peak is None else torch.maximum(peak, m)
        c = torch.full((1,), FP16_GRAD_SCALE, device=w.device)
        self.c = c if peak is None else c / peak.clamp_min(1e-30)
        self.post = w / self.c


def head_chunks(hidden, weight, bias, rows, workspace_mib, run_pass, *, need_h=False, need_w=False,
                need_b=False, post=None):
    """Drive one pass over all (selected) rows of the head, chunk by chunk.

    rows: int64 indices of the rows of ``hidden`` to process (compaction), or None for all rows.
    run_pass(x, s, e): launches the Triton pass on the chunk's raw products x = [e−s, V] (positions
    s:e of the processed rows); when any gradient is needed it must leave dX in x.
    Returns (dh [N, D] in hidden's dtype with post applied and zero on unprocessed rows,
    dw32 [V, D] fp32, db32 [V] fp32) — None where not needed; dw32/db32 still carry ``post``.
    A master weight (``master_weight``) and its bias enter the products as hidden's dtype, copied here:
    the copy lives for this call only, and dw32 is then the fp32 gradient itself (``finish_grad``).
    """
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    N, D = hidden.shape
    V = weight.shape[0]
    n = N if rows is None else rows.numel()
    chunk = plan_chunk_rows(n, V, hidden.element_size(), workspace_mib, trainable=need_w)
    f32 = dict(device=hidden.device, dtype=torch.float32)
    dh = dw32 = db32 = None
    if need_h:
        # All rows are written chunk by chunk; with compaction, unprocessed rows must read as zero.
        dh = (torch.empty if rows is None else torch.zeros)(N, D, device=hidden.device, dtype=hidden.dtype)
    if need_w:
        dw32 = (torch.zeros if n == 0 else torch.empty)(V, D, **f32)  # the first chunk writes it with beta = 0
    if need_b:
        db32 = torch.zeros(V, **f32)
    if n == 0:
        return dh, dw32, db32
    # The workspace and each chunk's temporaries die in this call: under ``scratch_pool`` (the head of a model
    # whose layers replay CUDA graphs) they take the graphs' idle pool, not the main pool's peak.
    with scratch(hidden.device):
        # Workspace: each chunk's product writes ws[:e - s] before anything reads it.
        ws = torch.empty(min(chunk, n), V, device=hidden.device, dtype=hidden.dtype)
        wt = weight.t()
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e] if rows is None else hidden.index_select(0, rows[s:e])
            x = ws[: e - s]
            if bias is None:
                torch.mm(h, wt, out=x)
            else:
                torch.addmm(bias, h, wt, out=x)
            run_pass(x, s, e)
            if need_h:
                if post is None and rows is None:
                    torch.mm(x, weight, out=dh[s:e])
                else:
                    part = torch.mm(x, weight) if post is None else mm_fp32(x, weight).mul_(post)
                    if rows is None:
                        dh[s:e].copy_(part)
                    else:
                        dh.index_copy_(0, rows[s:e], part.to(dh.dtype))
            if need_w:
                addmm_fp32_(dw32, x.t(), h, beta=0.0 if s == 0 else 1.0)
            if need_b:
                db32.add_(x.sum(0, dtype=torch.float32))
    return dh, dw32, db32


def finish_grad(acc32: torch.Tensor | None, dtype: torch.dtype, factor=None):
    """acc32·factor as ``dtype`` (in place when that is float32); factor: device tensor or None."""
    if acc32 is None:
        return None
    if factor is None:
        return acc32.to(dtype)
    if dtype == torch.float32:
        return acc32.mul_(factor)
    # One pass: the product is formed in fp32 and rounded once, on the store.
    return torch.mul(acc32, factor, out=torch.empty(acc32.shape, device=acc32.device, dtype=dtype))  # out only
