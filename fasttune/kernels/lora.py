"""Fused LoRA projections with hand-written backward: y = x Wᵀ (+ b) + s·(x Aᵀ) Bᵀ.

Shapes: x [..., in] (flattened to X [N, in]); frozen base W [out, in], dense or bitsandbytes NF4
(dequantised on the fly, see ``BaseWeight``); optional frozen bias b [out]; adapter A [r, in],
B [out, r]; scaling s a Python number (PEFT's ``lora_alpha / r``).

Forward (matrix products through torch, i.e. cuBLAS on the GPU, in x's dtype):

    XA = X Aᵀ                      [N, r]
    Y  = s · XA Bᵀ (+ b) + X Wᵀ     [N, out]

Backward from dY [N, out]; W and b are frozen and get no gradient:

    dYB = s · dY B                 [N, r]
    dX  = dYB A + dY W             [N, in]
    dA  = dYBᵀ X                   [r, in]
    dB  = s · dYᵀ XA               [out, r]

Y starts as the stock layer's own product (``F.linear(X, W, b)``, the same cuBLAS call) and the
rank-r term is added onto it, so a fresh adapter (B = 0) gives bitwise the base layer's output: a
DPO policy at step 0 equals its reference (adapters disabled) exactly, as in stock PEFT. In dX the
rank-r term is written first and the base product accumulates onto it (cuBLAS's beta = 1).

Saved for backward: X and XA (r columns) only; not Y, and never a dequantised W: an NF4 W is
dequantised again in backward into a scratch buffer that dies with the call, unless a checkpointed
layer's recompute just did (``kept_weights.py``). dX is skipped when x needs no gradient. A
recompute given its forward's Y (``known_output``) saves the same and runs no product.

``lora_qkv`` runs three projections of one X as one Function: the three adapters' A matrices
are stacked, so XA = X [A_q; A_k; A_v]ᵀ is one product and one saved [N, r_q+r_k+r_v] tensor,
and backward sums dX = Σ_p dY_p W_p + [dYB_q dYB_k dYB_v] [A_q; A_k; A_v] in one buffer. A
projection whose A is None has no adapter (only q and v targeted, say). ``lora_o`` is
``lora_linear``. The gated MLP lives in ``lora_glu.py`` (``lora_mlp``).

FP8 bases (``BaseWeight(codes, fp8_scale=...)``, ``FastConfig.base_dtype="fp8"``): the two base
products X Wᵀ and dY W run through ``fp8.py`` (X quantised once per group of projections that
share it); the rank-r terms, dA and dB are computed as above, in x's dtype. Never widened.

Dtypes: x is float32, float16 or bfloat16 and sets the compute dtype. A dense W must have x's dtype;
an NF4 W is read as bitsandbytes' ``matmul_4bit`` reads it: dequantised straight to x's dtype in the
forward (``gemm_4bit``), rounded to its QuantState dtype first for dX, so QLoRA with an fp32 compute
dtype over a bf16-loaded checkpoint is exact against PEFT + bitsandbytes. A and B may be x's dtype or
float32 (PEFT's default); they are used in x's dtype, as under torch.autocast, and their gradients
come back in their own dtype. A bias is cast to x's dtype (as bitsandbytes does). Under an active
torch.autocast, x (and a dense W of another dtype) are first cast to the autocast dtype.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from . import forward_reuse
from ._backend import check_float, check_same_device
from .fp8 import Fp8Weight, forward_product, grad_input_product, quantize_rows
from .kept_weights import KeptWeights, current, keeps, recording_for
from .lora_adapters import adapters_of, b_as, cast_b, stack_a, stacked_xa
from .lora_wide import project_wide, wide_columns, wide_grad_input
from .nf4 import dequantize_nf4

__all__ = ["BaseWeight", "lora_linear", "lora_o", "lora_qkv"]


class BaseWeight:
    """A frozen base-layer weight [out, in]: a dense tensor, an NF4 ``(packed, quant_state)`` or
    FP8 codes with their row scales (``fp8.Fp8Weight``).

    Args:
        weight: the dense weight, or the packed NF4 codes (``Params4bit.data``) with ``quant_state``.
        quant_state: the bitsandbytes ``QuantState`` of an NF4 weight (duck-typed), else None.
        bias: optional frozen bias [out].
        wide: a ``lora_wide.WideWeight`` whose buffer holds this dense weight, or a ``BorderedNf4``
            of these codes (then the rank-r term rides in the base product, ``lora_wide.py``), else None.
        fp8_scale: the float32 row scales [out] when ``weight`` holds FP8 codes ([out, in]), else None.

    Raises ValueError when the weight or bias requires grad (the fused Functions give it none).
    """

    __slots__ = ("weight", "quant_state", "bias", "wide", "fp8")

    def __init__(self, weight: torch.Tensor, quant_state=None, bias: torch.Tensor | None = None, wide=None,
                 fp8_scale: torch.Tensor | None = None):
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        self.fp8 = None
        if fp8_scale is not None:
            if quant_state is not None or wide is not None:
                raise ValueError("an FP8 base weight takes no quant_state and no wide buffer")
            self.fp8 = Fp8Weight(weight, fp8_scale)
        elif quant_state is None:
            if weight.dim() != 2 or not weight.is_floating_point():
                raise ValueError(f"a dense base weight must be a 2-D float tensor, got {weight.dim()}-D {weight.dtype}")
        elif len(getattr(quant_state, "shape", ())) != 2:
            raise ValueError("quant_state.shape must be [out_features, in_features]")
        if weight.requires_grad:
            raise ValueError("the base weight requires grad, but fused LoRA gives the frozen base weight no "
                             "gradient: freeze it (requires_grad_(False)) or keep this layer on the stock path")
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or bias.shape != (self._shape(weight, quant_state)[0],):
                raise ValueError(f"bias must be a tensor of shape [{self._shape(weight, quant_state)[0]}]")
            if bias.requires_grad:
                raise ValueError("the base bias requires grad, but fused LoRA gives it no gradient: freeze it")
        if wide is not None and not wide.holds(weight, quant_state):
            raise ValueError("wide must be the WideWeight holding this dense weight or the BorderedNf4 of these codes")
        self.weight, self.quant_state, self.bias, self.wide = weight, quant_state, bias, wide

    @staticmethod
    def _shape(weight, quant_state) -> tuple[int, int]:
        return tuple(weight.shape) if quant_state is None else tuple(quant_state.shape)

    @classmethod
    def of(cls, base) -> BaseWeight:
        """Coerce a BaseWeight, a dense tensor, a ``(packed, quant_state)`` pair or an ``Fp8Weight``."""
        if isinstance(base, BaseWeight):
            return base
        if isinstance(base, Fp8Weight):
            return cls(base.codes, fp8_scale=base.scale)
        if isinstance(base, torch.Tensor):
            return cls(base)
        if isinstance(base, (tuple, list)) and len(base) == 2:
            return cls(base[0], base[1])
        raise TypeError(f"base must be a tensor, a (packed, quant_state) pair or a BaseWeight, got {type(base).__name__}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self._shape(self.weight, self.quant_state)

    @property
    def is_nf4(self) -> bool:
        return self.quant_state is not None

    @property
    def is_fp8(self) -> bool:
        return self.fp8 is not None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def materialize(self, out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                    for_grad_input: bool = False) -> torch.Tensor:
        """The full-precision weight [out, in].

        Dense: the tensor itself (a cast copy when ``dtype`` differs). NF4: dequantised into ``out`` (a
        contiguous buffer of at least ``numel`` elements; its dtype wins) or a new tensor of ``dtype``
        (default: the QuantState's) as bitsandbytes' ``matmul_4bit`` reads it: straight to the compute
        dtype forward (``gemm_4bit``), rounded to the QuantState's dtype first with ``for_grad_input``
        (its backward, ``dequantize_4bit(...).to(dy.dtype)``). FP8: the dequantised codes (unused by
        the fused paths, which multiply the codes, ``fp8.py``).
        """
        if self.is_fp8:
            return self.fp8.dequantize(dtype or torch.float32)
        if not self.is_nf4:
            return self.weight if dtype in (None, self.weight.dtype) else self.weight.to(dtype)
        if out is not None:
            if not out.is_contiguous() or out.numel() < self.numel:
                raise ValueError(f"out must be contiguous with at least {self.numel} elements")
            out = out.view(-1)[: self.numel].view(self.shape)
        elif dtype is not None:
            out = torch.empty(self.shape, dtype=dtype, device=self.weight.device)  # dequantised over whole
        return dequantize_nf4(self.weight, self.quant_state, out=out, round_to_state=for_grad_input)


def scratch_for(bases, dtype: torch.dtype, device) -> torch.Tensor | None:
    """One buffer big enough for the largest NF4 weight among ``bases`` (None when all dense):
    each projection is dequantised into it in turn, so one layer never holds two weights."""
    sizes = [b.numel for b in bases if b.is_nf4 and b.wide is None]  # bordered ones get their own
    # Uninitialised is safe: each weight is dequantised over the prefix it then reads.
    return torch.empty(max(sizes), dtype=dtype, device=device) if sizes else None


def autocast_input(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x cast to the active autocast dtype of its device (differentiably), and whether autocast is on."""
    dev = x.device.type
    if dev in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return (x if x.dtype == dt else x.to(dt)), True
    return x, False


def check_projection(name: str, spec, x: torch.Tensor, autocast: bool):
    """Validate one ``(base, lora_a, lora_b, scaling)`` spec against x; returns it normalised."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 4:
        raise TypeError(f"{name} must be a (base, lora_a, lora_b, scaling) tuple")
    base, a, b, s = spec
    base = BaseWeight.of(base)
    out_f, in_f = base.shape
    if x.shape[-1] != in_f:
        raise ValueError(f"{name}: x has {x.shape[-1]} features, the base weight expects {in_f}")
    check_same_device(x=x, **{f"{name}_weight": base.weight, f"{name}_bias": base.bias})
    if not base.is_nf4 and not base.is_fp8 and base.weight.dtype != x.dtype and not autocast:
        raise TypeError(f"{name}: base weight is {base.weight.dtype} but x is {x.dtype}")
    if (a is None) != (b is None):
        raise ValueError(f"{name}: lora_a and lora_b must both be tensors or both be None")
    if a is None:
        return base, None, None, 0.0
    for arg, t in (("lora_a", a), ("lora_b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: {arg} must be a 2-D tensor")
    if a.shape[1] != in_f:
        raise ValueError(f"{name}: lora_a is {tuple(a.shape)}, expected [r, {in_f}]")
    if b.shape[0] != out_f:
        raise ValueError(f"{name}: lora_b is {tuple(b.shape)}, expected [{out_f}, r]")
    if b.shape[1] != a.shape[0]:
        raise ValueError(f"{name}: rank mismatch, lora_a has r={a.shape[0]} rows, lora_b r={b.shape[1]} columns")
    if a.dtype != b.dtype or a.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{name}: lora_a/lora_b are {a.dtype}/{b.dtype}; both must be x's dtype ({x.dtype}) or float32")
    check_same_device(x=x, **{f"{name}_lora_a": a, f"{name}_lora_b": b})
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise TypeError(f"{name}: scaling must be a Python number, got {type(s).__name__}")
    return base, a, b, float(s)


def grad_as(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A gradient in its parameter's dtype (float32 adapters get their computed-in-x-dtype grad cast)."""
    return g if g.dtype == like.dtype else g.to(like.dtype)


def _scaled_(t: torch.Tensor, s: float) -> torch.Tensor:
    """t·s in place; no kernel at all for PEFT's common s = 1 (alpha = r): x·1 is x, bit for bit."""
    return t if s == 1 else t.mul_(s)


def project(x2: torch.Tensor, bases, adapters, xa: torch.Tensor | None, scratch,
            xcat: torch.Tensor | None = None, rank_terms: bool = True, b_cast=None,
            kept: KeptWeights | None = None) -> list[torch.Tensor]:
    """Y_p = X W_pᵀ (+ b_p) + s_p·XA_p B_pᵀ for each projection p of one input.

    Widened bases (``lora_wide.py``): one product per projection over [X | s·XA]. Otherwise the
    base product first, exactly as the stock layer computes it, then the rank-r term added in
    one pass (module docstring: with B = 0 the output is bitwise the base layer's). ``xcat``: a
    widened input already holding X (the GLU kernel writes H there), used when the bases are widened.
    ``rank_terms=False``: base products only where not widened (``lora_glu`` adds the terms in its pass).
    ``b_cast``: ``cast_b``'s B per projection, or None (cast here). ``kept``: a recompute's
    ``KeptWeights``: NF4 weights it may keep are dequantised into buffers of their own and put there.
    """
    dt = x2.dtype
    cols = wide_columns(bases, adapters, dt)
    if cols is not None:
        return project_wide(x2, bases, adapters, xa, cols, xcat, kept)
    ys, col, xq = [], 0, None
    for p, (base, ad) in enumerate(zip(bases, adapters)):
        if base.is_fp8:
            if xq is None:  # one quantisation of X for every FP8 projection of it
                xq = quantize_rows(x2)
            y = forward_product(x2, base.fp8, xq)
            if base.bias is not None:
                y.add_(base.bias.to(dt))
        elif kept is not None and keeps(base, dt):
            w = base.materialize(dtype=dt)
            kept.put(base, w)
            y = F.linear(x2, w, None if base.bias is None else base.bias.to(dt))
        else:
            w = base.materialize(out=scratch, dtype=dt)
            y = F.linear(x2, w, None if base.bias is None else base.bias.to(dt))
        if ad is not None and rank_terms:
            r = ad[0].shape[0]
            y.addmm_(xa[:, col:col + r], b_as(ad, None if b_cast is None else b_cast[p], dt).t(), alpha=ad[2])
            col += r
        ys.append(y)
    return ys


def adapter_dyb(dys, adapters, a_stacked: torch.Tensor | None = None,
                b_cast=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dYB = [s_p dY_p B_p]_p stacked by columns [N, Σr], and the matching stacked [A_p] [Σr, in]
    (``a_stacked`` when the forward kept it, else cast and stacked here; B from ``b_cast`` likewise)."""
    b_cast = b_cast or [None] * len(adapters)
    parts = [_scaled_(torch.mm(dy, b_as(ad, bc, dy.dtype)), ad[2])
             for dy, ad, bc in zip(dys, adapters, b_cast) if ad is not None]
    if not parts:
        return None, None
    if a_stacked is None:
        a_stacked = stack_a(adapters, dys[0].dtype)
    return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]), a_stacked


def grad_input(dys, bases, dyb: torch.Tensor | None, a_stacked: torch.Tensor | None, scratch,
               kept: KeptWeights | None = None) -> torch.Tensor:
    """dX = dYB [A_p] + Σ_p dY_p W_p; the rank-r term first so each base product accumulates in
    the epilogue. NF4 weights are dequantised again, one at a time, into ``scratch``. FP8 ones are
    multiplied as codes (``fp8.grad_input_product``) into buffers of their own (an FP8 product
    does not accumulate): they come first, the first one's buffer becomes dX and the rank-r term
    is accumulated onto it by a small product (one pass over dX instead of a write and an add).
    ``kept``: the layer call's ``KeptWeights``; an NF4 weight its recompute kept is taken from there."""
    dx = None
    for dy, base in zip(dys, bases):
        if base.is_fp8:
            part = grad_input_product(dy, base.fp8)
            dx = part if dx is None else dx.add_(part)
    if dyb is not None:
        dx = torch.mm(dyb, a_stacked) if dx is None else dx.addmm_(dyb, a_stacked)
    for dy, base in zip(dys, bases):
        if not base.is_fp8:
            w = kept.take(base, dy.dtype) if kept is not None and keeps(base, dy.dtype) else None
            if w is None:
                w = base.materialize(out=scratch, dtype=dy.dtype, for_grad_input=True)
            dx = torch.mm(dy, w) if dx is None else dx.addmm_(dy, w)
    return dx


def adapter_grads(x2, dys, xa, dyb, adapters, need_a, need_b):
    """dA = dYBᵀ X split by rows (one product for all p); dB_p = s_p dY_pᵀ XA_p. None where unneeded."""
    n = len(adapters)
    da, db = [None] * n, [None] * n
    da_all = dyb.t() @ x2 if dyb is not None and any(need_a) else None
    col = 0
    for p, ad in enumerate(adapters):
        if ad is None:
            continue
        a, b, s = ad
        r = a.shape[0]
        if need_a[p]:
            da[p] = grad_as(da_all[col:col + r], a)
        if need_b[p]:
            db[p] = grad_as(_scaled_(torch.mm(dys[p].t(), xa[:, col:col + r]), s), b)
        col += r
    return da, db


def group_backward(x2, dys, xa, bases, adapters, need, scratch, a_stacked=None, b_cast=None, kept=None, token=None):
    """(dX or None, [dA_p], [dB_p]) for projections p of one input X; ``need`` = (x, A's, B's);
    ``a_stacked``: the forward's stacked A (``stacked_xa``), or None; ``b_cast``: its ``cast_b``, or None.
    A widened group that needs dX takes its dYB from the tails of its base products (``lora_wide.wide_grad_input``).
    ``kept``: the layer call's ``KeptWeights`` (``grad_input``), or None; ``token``: its ``ForwardReuse``
    (``lora_wide.WideWeight.load``), or None."""
    need_x, need_a, need_b = need
    cols = wide_columns(bases, adapters, dys[0].dtype) if need_x and any(ad is not None for ad in adapters) else None
    if cols is not None:
        if a_stacked is None:
            a_stacked = stack_a(adapters, dys[0].dtype)
        dx, dyb = wide_grad_input(dys, bases, adapters, cols, a_stacked, kept, token)
    else:
        dyb, a_stacked = adapter_dyb(dys, adapters, a_stacked, b_cast) if (need_x or any(need_a)) else (None, None)
        dx = grad_input(dys, bases, dyb, a_stacked, scratch, kept) if need_x else None
    da, db = adapter_grads(x2, dys, xa, dyb, adapters, need_a, need_b)
    return dx, da, db


class LoRALinearFunction(torch.autograd.Function):
    """y = x Wᵀ (+ b) + s·(x Aᵀ) Bᵀ; gradients for x, A and B (module docstring)."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, base: BaseWeight, scaling: float, known_output=None):
        out_f, in_f = base.shape
        x2 = x.reshape(-1, in_f)
        adapters = adapters_of((lora_a, lora_b), (scaling,))
        xa, a_stacked = stacked_xa(x2, adapters)
        b_cast = cast_b((base,), adapters, x2.dtype)
        if known_output is None:
            (y,) = project(x2, (base,), adapters, xa, None, b_cast=b_cast, kept=recording_for(ctx))
        else:  # a recompute whose forward's output came back from the host: no product, the same saved tensors
            y = known_output
        # The casts are saved tensors (not ctx attributes): a checkpointed layer does not hold them
        # from its forward to its backward; its recompute takes them back (forward_reuse.py).
        ctx.save_for_backward(x, xa, lora_a, lora_b, a_stacked, *b_cast)
        ctx.base, ctx.scaling, ctx.kept, ctx.reuse = base, scaling, current(), forward_reuse.active()
        # Not a view of an internal buffer: callers (RoPE, in place) may modify outputs in place.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], out_f))

    @staticmethod
    def backward(ctx, dy):
        x, xa, lora_a, lora_b, a_stacked, b_cast = ctx.saved_tensors
        base = ctx.base
        x2, dy2 = x.reshape(-1, base.shape[1]), dy.reshape(-1, base.shape[0])
        need = ctx.needs_input_grad
        dx, (da,), (db,) = group_backward(x2, (dy2,), xa, (base,), adapters_of((lora_a, lora_b), (ctx.scaling,)),
                                          (need[0], need[1:2], need[2:3]), None, a_stacked, [b_cast], ctx.kept,
                                          ctx.reuse)
        return (None if dx is None else dx.view(x.shape)), da, db, None, None, None


def checked_input(x) -> tuple[torch.Tensor, bool]:
    """x checked (a float tensor) and cast as under autocast (``autocast_input``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float("x", x)
    return autocast_input(x)


def _prepare_linear(x, base, lora_a, lora_b, scaling, bias, name="base"):
    x, autocast = checked_input(x)
    base = BaseWeight.of(base)
    if bias is not None:
        if base.bias is not None:
            raise ValueError("bias given twice: as bias= and on the BaseWeight")
        base = BaseWeight(base.weight, base.quant_state, bias, fp8_scale=None if base.fp8 is None else base.fp8.scale)
    return (x, *check_projection(name, (base, lora_a, lora_b, scaling), x, autocast))


def lora_linear(x: torch.Tensor, base, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                scaling: float, bias: torch.Tensor | None = None,
                known_output: torch.Tensor | None = None) -> torch.Tensor:
    """A LoRA linear layer ``x Wᵀ (+ bias) + scaling·(x Aᵀ) Bᵀ`` with a hand-written backward.

    Args:
        x: input [..., in], float32/float16/bfloat16.
        base: the frozen weight: a dense [out, in] tensor, an NF4 ``(packed, quant_state)`` pair,
            or a ``BaseWeight`` (which may carry the bias).
        lora_a, lora_b: A [r, in] and B [out, r], both x's dtype or float32, or both None (no adapter).
        scaling: the adapter's scale (PEFT's ``scaling[adapter]``); bias: optional frozen bias [out].
        known_output: this call's output computed before (a recompute whose forward's output was kept,
            ``model_patches/output_stash.py``): returned, no product run, the same tensors saved.

    Returns:
        [..., out] in x's dtype (the autocast dtype under torch.autocast). Gradients flow to x,
        lora_a and lora_b; the base weight and bias must not require grad.
    """
    x, base, a, b, s = _prepare_linear(x, base, lora_a, lora_b, scaling, bias)
    shape = (*x.shape[:-1], base.shape[0])
    if known_output is not None and (known_output.shape != shape or known_output.dtype != x.dtype):
        raise ValueError(f"known_output must be this call's output, {shape} in {x.dtype}")
    return LoRALinearFunction.apply(x, a, b, base, s, known_output)


lora_o = lora_linear


class LoRAQKVFunction(torch.autograd.Function):
    """(Q, K, V) = three LoRA projections of one x; see the module docstring."""

    @staticmethod
    def forward(ctx, x, aq, bq, ak, bk, av, bv, bases, scalings):
        x2 = x.reshape(-1, bases[0].shape[1])
        adapters = adapters_of((aq, bq, ak, bk, av, bv), scalings)
        xa, a_stacked = stacked_xa(x2, adapters)
        b_cast = cast_b(bases, adapters, x2.dtype)
        kept = recording_for(ctx)
        scratch = None if kept is not None else scratch_for(bases, x.dtype, x.device)  # kept: a buffer each
        ys = project(x2, bases, adapters, xa, scratch, b_cast=b_cast, kept=kept)
        ctx.save_for_backward(x, xa, aq, bq, ak, bk, av, bv, a_stacked, *b_cast)
        ctx.bases, ctx.scalings, ctx.kept, ctx.reuse = bases, scalings, current(), forward_reuse.active()
        # Not views of internal buffers: RoPE rotates q/k in place right after.
        return tuple(torch.ops.aten._unsafe_view(y, (*x.shape[:-1], base.shape[0])) for y, base in zip(ys, bases))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, xa, *ab = ctx.saved_tensors
        ab, a_stacked, b_cast = ab[:6], ab[6], ab[7:]
        bases = ctx.bases
        x2 = x.reshape(-1, bases[0].shape[1])
        need = ctx.needs_input_grad
        dys = [g.reshape(-1, base.shape[0]) for g, base in zip((dq, dk, dv), bases)]
        scratch = scratch_for(bases, x.dtype, x.device) if need[0] else None
        dx, da, db = group_backward(x2, dys, xa, bases, adapters_of(ab, ctx.scalings),
                                    (need[0], need[1:7:2], need[2:7:2]), scratch, a_stacked, b_cast, ctx.kept,
                                    ctx.reuse)
        grads = [g for pair in zip(da, db) for g in pair]
        return (None if dx is None else dx.view(x.shape), *grads, None, None)


def lora_qkv(x: torch.Tensor, q, k, v):
    """Query, key and value LoRA projections of one input, as one autograd Function.

    Args:
        x: hidden states [..., D], float32/float16/bfloat16.
        q, k, v: each a ``(base, lora_a, lora_b, scaling)`` tuple as in ``lora_linear``
            (``base`` a dense tensor, an NF4 ``(packed, quant_state)`` pair or a ``BaseWeight``
            carrying an optional bias); ``lora_a = lora_b = None`` for a projection without an
            adapter. Output widths may differ (GQA).

    Returns:
        (Q, K, V), each [..., out_p] in x's dtype.
    """
    x, autocast = checked_input(x)
    specs = [check_projection(name, spec, x, autocast) for name, spec in (("q", q), ("k", k), ("v", v))]
    bases = tuple(sp[0] for sp in specs)
    scalings = tuple(sp[3] for sp in specs)
    tensors = [t for sp in specs for t in sp[1:3]]
    return LoRAQKVFunction.apply(x, *tensors, bases, scalings)
