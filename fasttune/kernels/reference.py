"""Plain-PyTorch versions of every fasttune op.

Two jobs: the oracle the Triton kernels are tested against, and the path taken when a tensor is
on a device Triton cannot run on (CPU without ``TRITON_INTERPRET=1``). Each function here has the
same signature and semantics as its public twin in ``kernels/<stem>.py``; autograd derives the
gradients, so nothing here is hand-derived. Imports torch only.

Conventions shared with the kernels:
- Math is done in float32 (or float64 when the inputs are float64) and the result is cast to the
  output dtype once, at the end, like the Hugging Face modules the kernels replace.
- ``ignore_index`` rows contribute nothing: zero loss, zero gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "fused_linear_cross_entropy",
    "cross_entropy",
    "fused_linear_logprobs",
    "rms_norm",
    "rms_norm_add",
    "apply_rope",
    "swiglu",
    "geglu",
    "dequantize_nf4",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
    "NF4_CODE",
    "quantize_rows_fp8",
    "fp8_scaled_product",
]

# Default rows per chunk of the bounded-memory reference loss (the kernels size their own chunks).
REFERENCE_CHUNK_ROWS = 1024


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# --------------------------------------------------------------------------------------------
# cross_entropy
# --------------------------------------------------------------------------------------------


def _logits(hidden, weight, bias, logit_scale, softcap):
    """Logits z of one chunk in the compute dtype: (h Wᵀ + b)·scale, then softcap·tanh(z/softcap)."""
    dt = _compute_dtype(hidden, weight)
    z = hidden.to(dt) @ weight.to(dt).t()
    if bias is not None:
        z = z + bias.to(dt)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def _chunk_token_loss(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap,
                      logit_scale, z_loss):
    z = _logits(hidden, weight, bias, logit_scale, softcap)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, safe[:, None]).squeeze(1)
    loss = (1.0 - label_smoothing) * (lse - z_y)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z.mean(dim=-1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss))


def _chunk_stats(hidden, weight, bias, labels, ignore_index, softcap, logit_scale):
    with torch.no_grad():
        z = _logits(hidden, weight, bias, logit_scale, softcap).float()
        logp = torch.log_softmax(z, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        valid = labels != ignore_index
        correct = (z.argmax(-1) == labels) & valid
        return torch.where(valid, entropy, torch.zeros_like(entropy)), correct


def _check_loss_args(hidden, weight, labels, reduction):
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError("hidden must be [N, D], weight [V, D] and labels [N]")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    z_loss: float = 0.0,
    return_stats: bool = False,
    chunk_rows: int = REFERENCE_CHUNK_ROWS,
):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without holding [N, V].

    Per token: (1-ε)(lse − z_y) + ε(lse − mean_j z_j) + z_loss·lse², 0 where ignored. Each chunk of
    ``chunk_rows`` rows is checkpointed, so peak memory is one chunk of logits in forward and in
    backward. "mean" divides by the count of non-ignored tokens (a batch with none gives 0, not
    NaN); ``num_items_in_batch`` divides the sum by it instead. The loss is float32 (float64 for
    float64 inputs). ``return_stats`` adds ``{"entropy": float32 [N], "correct": bool [N]}``,
    both zero/False on ignored rows.
    """
    _check_loss_args(hidden, weight, labels, reduction)
    parts = []
    for s in range(0, hidden.shape[0], chunk_rows):
        args = (hidden[s:s + chunk_rows], weight, bias, labels[s:s + chunk_rows], ignore_index,
                label_smoothing, softcap, logit_scale, z_loss)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_chunk_token_loss, *args, use_reentrant=False))
        else:
            parts.append(_chunk_token_loss(*args))
    dt = _compute_dtype(hidden, weight)
    per_token = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=dt)
    if reduction == "none":
        loss = per_token
    elif num_items_in_batch is not None:
        # 0 reads as 1: a micro-batch with nothing to learn gives 0, never NaN.
        loss = per_token.sum() / torch.as_tensor(num_items_in_batch, device=per_token.device, dtype=dt).clamp(min=1)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / (labels != ignore_index).sum().clamp(min=1).to(dt)
    if not return_stats:
        return loss
    ent, cor = [], []
    for s in range(0, hidden.shape[0], chunk_rows):
        e, c = _chunk_stats(hidden[s:s + chunk_rows], weight, bias, labels[s:s + chunk_rows],
                            ignore_index, softcap, logit_scale)
        ent.append(e)
        cor.append(c)
    stats = {
        "entropy": torch.cat(ent) if ent else hidden.new_zeros(0, dtype=torch.float32),
        "correct": torch.cat(cor) if cor else torch.zeros(0, dtype=torch.bool, device=hidden.device),
    }
    return loss, stats


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", num_items_in_batch=None, label_smoothing: float = 0.0,
                  softcap: float | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """Cross-entropy on given logits [N, V]: per row, with z = softcap·tanh(logits/softcap) in
    float32, (1−ε)(lse − z_y) + z_loss·lse² + ε(lse − mean_j z_j), 0 where ignored. "mean" divides
    by the count of non-ignored rows (at least 1); ``num_items_in_batch`` (a number or a 1-element
    tensor; 0 reads as 1) divides the sum instead. Returns a float32 loss (0-d, or [N] for "none").
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, torch.where(valid, labels, 0).long()[:, None]).squeeze(1)
    loss = (1.0 - label_smoothing) * (lse - z_y) + z_loss * lse * lse
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z.mean(dim=-1))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if num_items_in_batch is not None:
        num = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=loss.device).detach().reshape(())
        return loss.sum() / torch.where(num == 0, torch.ones_like(num), num)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


def _chunk_logprobs(hidden, weight, bias, labels, temperature, softcap, logit_scale):
    z = _logits(hidden, weight, bias, logit_scale, softcap) / temperature
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) - lse


def _chunk_entropy(hidden, weight, bias, temperature, softcap, logit_scale):
    z = _logits(hidden, weight, bias, logit_scale, softcap) / temperature
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    return_entropy: bool = False,
    chunk_rows: int = REFERENCE_CHUNK_ROWS,
):
    """log softmax(z / temperature)[label] per row, z as in ``fused_linear_cross_entropy``.

    Labels < 0 are read as index 0 (the caller masks those rows). ``return_entropy`` also returns
    the entropy of softmax(z / temperature) per row, differentiable. Bounded memory as above.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_loss_args(hidden, weight, labels, "none")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lp, ent = [], []
    for s in range(0, hidden.shape[0], chunk_rows):
        h, y = hidden[s:s + chunk_rows], labels[s:s + chunk_rows]
        fn = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if grad else (lambda f, *a: f(*a))
        lp.append(fn(_chunk_logprobs, h, weight, bias, y, temperature, softcap, logit_scale))
        if return_entropy:
            ent.append(fn(_chunk_entropy, h, weight, bias, temperature, softcap, logit_scale))
    dt = _compute_dtype(hidden, weight)
    logp = torch.cat(lp) if lp else hidden.new_zeros(0, dtype=dt)
    if not return_entropy:
        return logp
    return logp, (torch.cat(ent) if ent else hidden.new_zeros(0, dtype=dt))


# --------------------------------------------------------------------------------------------
# rms_norm
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0,
             casting: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dimension.

    casting="llama": y = (offset + w) * (x·r).to(x.dtype), output dtype promote(x, w)
                     (LlamaRMSNorm, Qwen2/3, Mistral, Phi3, Granite).
    casting="gemma": y = ((x·r) * (offset + w)).to(x.dtype), all in fp32
                     (Gemma/Gemma2/Gemma3 with offset=1, OLMo2 with offset=0).
    r = 1/sqrt(mean(x²) + eps), computed in fp32.
    """
    if casting not in ("llama", "gemma"):
        raise ValueError(f"casting must be 'llama' or 'gemma', got {casting!r}")
    dt = _compute_dtype(x, weight)
    xf = x.to(dt)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        w = weight + offset if offset else weight
        return w * normed.to(x.dtype)
    return (normed * (weight.to(dt) + offset)).to(x.dtype)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 offset: float = 0.0, casting: str = "llama"):
    """(rms_norm(x + residual), x + residual): the residual add fused with the next norm."""
    s = x + residual
    return rms_norm(s, weight, eps, offset=offset, casting=casting), s


# --------------------------------------------------------------------------------------------
# rope
# --------------------------------------------------------------------------------------------


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None = None):
    """Rotary embedding in Hugging Face's rotate-half layout, q [B, Hq, S, Dh], k [B, Hk, S, Dh].

    cos/sin are [B, S, Dr] (already gathered per position, as HF's rotary module returns them)
    or, with ``position_ids`` [B, S], tables [P, Dr] indexed by position (packed sequences restart
    positions per document). Dr ≤ Dh: the first Dr dims rotate, the rest pass through (partial
    rotary). Returns new (q, k); the kernel works in place.
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dr = cos.shape[-1]

    def rot(x):
        xr, xp = x[..., :dr], x[..., dr:]
        out = xr * cos + _rotate_half(xr) * sin
        return torch.cat((out.to(x.dtype), xp), dim=-1)

    return rot(q), rot(k)


# --------------------------------------------------------------------------------------------
# swiglu / geglu
# --------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32, cast to gate's dtype."""
    dt = _compute_dtype(gate, up)
    return (F.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up (tanh approximation or exact erf), computed in fp32, cast to gate's dtype."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    dt = _compute_dtype(gate, up)
    return (F.gelu(gate.to(dt), approximate=approximate) * up.to(dt)).to(gate.dtype)


# --------------------------------------------------------------------------------------------
# nf4
# --------------------------------------------------------------------------------------------

# The 16 NF4 levels bitsandbytes uses (quantiles of N(0,1), normalised to [-1, 1]).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def dequantize_nf4(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes NF4 weight → dense tensor of ``quant_state.dtype`` and ``quant_state.shape``.

    ``packed`` holds two 4-bit codes per byte, high nibble first. Block b of ``blocksize`` values
    is scaled by absmax[b]; with double quantisation (``quant_state.nested``) absmax itself is
    uint8 codes into ``state2.code`` scaled per ``state2.blocksize`` block by ``state2.absmax``,
    plus ``quant_state.offset``. Duck-typed on bitsandbytes' QuantState; no bitsandbytes import.
    """
    if getattr(quant_state, "quant_type", "nf4") != "nf4":
        raise ValueError(f"only nf4 is supported, got quant_type={quant_state.quant_type!r}")
    flat = packed.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    codes = torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=-1).reshape(-1).long()
    if quant_state.nested:
        s2 = quant_state.state2
        a = quant_state.absmax.reshape(-1).long()
        absmax = s2.code.float()[a].reshape(-1, s2.blocksize) if a.numel() % s2.blocksize == 0 else None
        if absmax is None:
            idx = torch.arange(a.numel(), device=a.device) // s2.blocksize
            absmax = s2.code.float()[a] * s2.absmax.float()[idx]
        else:
            absmax = (absmax * s2.absmax.float()[:, None]).reshape(-1)
        absmax = absmax + float(quant_state.offset)
    else:
        absmax = quant_state.absmax.float().reshape(-1)
    n = math.prod(quant_state.shape)
    table = torch.tensor(NF4_CODE, dtype=torch.float32, device=flat.device)
    vals = table[codes[:n]]
    block = torch.arange(n, device=flat.device) // quant_state.blocksize
    return (vals * absmax[block]).to(quant_state.dtype).reshape(quant_state.shape)


# --------------------------------------------------------------------------------------------
# lora
# --------------------------------------------------------------------------------------------


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ bias) + scaling · (x Aᵀ) Bᵀ, W [out, in] dense (dequantise NF4 first),
    A [r, in], B [out, r]; PEFT's LoRA forward with dropout 0."""
    y = x @ weight.t()
    if bias is not None:
        y = y + bias
    return y + scaling * ((x @ lora_a.t()) @ lora_b.t())


def lora_mlp(x, gate, up, down, activation: str = "silu"):
    """down(act(gate(x)) * up(x)) with each projection a ``(W, A, B, scaling)`` tuple.

    activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU). A is None for a projection
    without an adapter.
    """
    def proj(inp, p):
        w, a, b, s = p
        return inp @ w.t() if a is None else lora_linear(inp, w, a, b, s)

    g, u = proj(x, gate), proj(x, up)
    if activation == "silu":
        h = swiglu(g, u)
    elif activation in ("gelu_tanh", "gelu"):
        h = geglu(g, u, approximate="tanh" if activation == "gelu_tanh" else "none")
    else:
        raise ValueError(f"activation must be 'silu', 'gelu_tanh' or 'gelu', got {activation!r}")
    return proj(h, down)


def lora_qkv(x, q, k, v):
    """(q(x), k(x), v(x)) with each projection a ``(W, A, B, scaling)`` tuple (A None: no adapter)."""
    out = []
    for w, a, b, s in (q, k, v):
        out.append(x @ w.t() if a is None else lora_linear(x, w, a, b, s))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# fp8
# --------------------------------------------------------------------------------------------


def quantize_rows_fp8(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale): float8_e4m3fn codes [N, K] and a power-of-two float32 scale per row [N] with
    ``codes · scale = v`` up to the e4m3 rounding, where v = x (times ``col_scale`` per column, in
    float32). The scale is the smallest 2^e with max|v_row| ≤ 448·2^e (e clamped to [-126, 126],
    so both 2^e and 2^-e are normal floats): v·2^-e is exact and never exceeds 448."""
    v = x.float() if col_scale is None else x.float() * col_scale.float()
    amax = v.abs().amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])
    bits = amax.contiguous().view(torch.int32)
    # 448 = 1.75·2^8: M·2^E ≤ 448·2^e for e = E − 8 when the mantissa M ≤ 1.75, else E − 7.
    e = ((bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)).clamp(-126, 126)
    scale = ((e + 127) << 23).view(torch.float32)
    inv = ((127 - e) << 23).view(torch.float32)
    return (v * inv[:, None]).to(torch.float8_e4m3fn), scale


def fp8_scaled_product(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """diag(a_scale) (A B) diag(b_scale) for float8 codes A [M, K], B [K, N] (any layout), in
    float32, rounded once to ``out_dtype``: what ``torch._scaled_mm`` computes with row-wise
    scales (products of e4m3 values are exact in float32; only the accumulation order differs)."""
    out = (a.float() @ b.float()) * a_scale.float()[:, None]
    if b_scale is not None:
        out = out * b_scale.float()[None, :]
    return out.to(out_dtype)
