"""The LoRA rank-r term folded into the base product: Y = [X | s·XA] [W | B]ᵀ.

A LoRA projection computes Y = X Wᵀ + s·(X Aᵀ) Bᵀ. As two products (``lora.project``), the
rank-r term is an extra memory-bound pass over Y (read and write [N, out]): ~0.19 ms per
14,336-wide gate/up output of an 8B layer at N = 8,192, next to the 1.2 ms base product.
Appending the rank columns to the contraction puts it inside the base product:

    Y_p = [X | s_1·XA_1 | s_2·XA_2 | … | 0] · [W_p | 0 … B_p … 0]ᵀ      (K = in + R)

for the projections p of one input X (q/k/v, or gate/up), where projection p owns tail columns
[c_p, c_p + r_p) (c_p = the ranks of the adapters before it) and R ≥ Σ r_p (model_patches pads it to
``TAIL_MULTIPLE`` columns; the unused ones are zero on both sides). The price: R more multiply-adds
per output, and a copy of X into the widened input unless X's producer wrote it there: the GLU
kernel writes H into the down projection's, and the RMSNorm kernel leaves spare columns after
its rows on request (``spare_columns.py``), so X from a patched norm is not copied from the
second call on.

Backward reads the same buffers: Σ_p dY_p [W_p | tail_p] = [Σ_p dY_p W_p | dY_p B_p in p's tail
columns], so the rank-r products dY_p B_p (memory-bound passes over each dY_p, ~60 µs per
14,336-wide gate/up gradient of an 8B layer) come out of the base products for R more output
columns, and dX = (that) + s·dYB [A_p; …] is one more pass over dX (``wide_grad_input``; used
for q/k/v and gate/up, not for the down projection, whose dX [N, I] is 3.5× wider than its dY).
The tails are reloaded first: a forward with the adapters off in between (DPO's reference pass)
zeroed them.

The weight side is never copied per call: a ``WideWeight`` owns a buffer [out, in + R] whose first
``in`` columns are the frozen base weight itself (the parameter is re-homed as a view of them,
``model_patches/lora_widen.py``) and whose tail receives the projection's B, cast to the compute
dtype, on every call (but the recompute and backward of a checkpointed layer call whose forward
loaded it, ``WideWeight.load``); the rest of the tail stays zero.

NF4 bases (``BorderedNf4``) have no buffer to re-home: each product dequantises W into the first
``in`` columns of a fresh [out, in + R] buffer (the dequantiser writes rows that far apart) and
writes the tail there, a buffer that dies with the product unless a checkpointed layer's recompute
keeps it for the backward (``kept_weights.py``). The same R columns per dequantisation replace the
rank-r passes over Y and dY (and the GLU kernel's rank-r path, ``lora_glu.py``).

Rounding: one fp32 accumulation of base and rank-r terms and one rounding, where the two-product
path rounds the base product first. With B = 0 the tail products are exact zeros, so a fresh
adapter's output is bitwise this path's output with the adapters disabled (zero tail), which is
what DPO's policy/reference comparison at step 0 needs.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from . import forward_reuse
from .kept_weights import keeps
from .nf4 import dequantize_nf4
from .spare_columns import spare_input

__all__ = ["BorderedNf4", "WideWeight", "wide_columns", "widened_input", "project_wide", "wide_grad_input",
           "TAIL_MULTIPLE"]

TAIL_MULTIPLE = 64  # tails padded to 64 columns: rows of a 16-bit buffer stay 128-byte aligned for cuBLAS


class WideWeight:
    """A frozen weight [out, in] stored as the first ``in`` columns of a buffer [out, in + R].

    Args:
        buf: the buffer, contiguous [out, in + R], R ≥ 1.
        in_features: in.

    ``weight_view()`` is the [out, in] view the model's parameter holds; ``holds(t)`` says
    whether ``t`` is still that view (a ``.to()`` or FSDP re-homes parameters and leaves the
    buffer stale). Not copied by ``copy.deepcopy`` (a deep-copied model gets contiguous weights
    and no buffer).
    """

    __slots__ = ("buf", "in_features", "_layout", "_loaded")

    def __init__(self, buf: torch.Tensor, in_features: int):
        if buf.dim() != 2 or not buf.is_contiguous() or not 0 < in_features < buf.shape[1]:
            raise ValueError(f"buf must be a contiguous [out, in + R] tensor with R >= 1, got {tuple(buf.shape)} "
                             f"for in_features={in_features}")
        self.buf, self.in_features, self._layout = buf, in_features, None
        self._loaded = None  # (layer call, B, B's version) of the last load made for a layer call

    @property
    def extra(self) -> int:
        """R, the tail width."""
        return self.buf.shape[1] - self.in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.buf.dtype

    def weight_view(self) -> torch.Tensor:
        return self.buf[:, : self.in_features]

    def holds(self, weight: torch.Tensor, quant_state=None) -> bool:
        buf = self.buf
        return (quant_state is None and weight.data_ptr() == buf.data_ptr() and weight.dtype == buf.dtype
                and weight.device == buf.device and tuple(weight.shape) == (buf.shape[0], self.in_features)
                and weight.stride() == buf.stride())

    def load(self, col: int | None, b: torch.Tensor | None, token=None) -> None:
        """Put B [out, r] in tail columns [col, col + r) and zeros elsewhere (None: an all-zero tail).

        The tail is zeroed only when the layout differs from the last call's. B is written on every
        call (an optimizer step changes it in place), except when the buffer holds this B at the same
        version, loaded for the same checkpointed layer call ``token`` (``forward_reuse.active()``):
        that call's recompute and backward follow its forward with no optimizer step between."""
        layout = None if b is None else (col, b.shape[1])
        if layout != self._layout:
            self.buf[:, self.in_features:].zero_()
            self._layout, self._loaded = layout, None
        if b is None:
            return
        held = self._loaded
        if token is not None and held is not None and held[0]() is token and held[1]() is b and held[2] == b._version:
            return
        self.buf[:, self.in_features + col:self.in_features + col + b.shape[1]].copy_(b)
        self._loaded = None if token is None else (weakref.ref(token), weakref.ref(b), b._version)

    def fill(self, col: int | None, b: torch.Tensor | None, for_grad_input: bool = False,
             buf: torch.Tensor | None = None, token=None) -> torch.Tensor:
        """``load`` and the buffer: [W | tail] for one product."""
        self.load(col, b, token)
        return self.buf

    def __deepcopy__(self, memo):
        return None


class BorderedNf4:
    """An NF4 weight [out, in] (packed codes and ``QuantState``) multiplied in the widened layout with a
    tail of R columns, dequantised per product (module docstring); ``dtype`` is the compute dtype.

    ``holds(packed, quant_state)`` says whether the layer still has these codes. Not copied by
    ``copy.deepcopy``.
    """

    __slots__ = ("packed", "quant_state", "in_features", "extra", "dtype")

    def __init__(self, packed: torch.Tensor, quant_state, extra: int, dtype: torch.dtype):
        if extra < 1:
            raise ValueError(f"extra must be >= 1, got {extra}")
        self.packed, self.quant_state, self.dtype = packed, quant_state, dtype
        self.in_features, self.extra = int(quant_state.shape[1]), int(extra)

    def holds(self, weight: torch.Tensor, quant_state=None) -> bool:
        p = self.packed
        return ((quant_state is None or quant_state is self.quant_state) and weight.data_ptr() == p.data_ptr()
                and weight.dtype == p.dtype and tuple(weight.shape) == tuple(p.shape) and weight.device == p.device)

    def fill(self, col: int | None, b: torch.Tensor | None, for_grad_input: bool = False,
             buf: torch.Tensor | None = None, token=None) -> torch.Tensor:
        """A buffer [W | tail] for one product: W dequantised as the forward (or, ``for_grad_input``, dX)
        reads it, unless ``buf`` (kept from a recompute) holds it already; B in tail columns [col, col + r).
        ``token`` is ``WideWeight.fill``'s, unused: each buffer here is made for one product."""
        in_f, shape = self.in_features, (self.quant_state.shape[0], self.in_features + self.extra)
        if buf is None:
            buf = torch.empty(shape, dtype=self.dtype, device=self.packed.device)
            dequantize_nf4(self.packed, self.quant_state, out=buf[:, :in_f], round_to_state=for_grad_input)
        elif tuple(buf.shape) != shape or buf.dtype != self.dtype:
            raise ValueError(f"buf must be {self.dtype} {list(shape)} (W | tail), got {buf.dtype} {list(buf.shape)}")
        tail = buf[:, in_f:]
        if b is None:
            tail.zero_()
            return buf
        lo, hi = col, col + b.shape[1]  # only the columns B does not cover are zeroed
        tail[:, lo:hi].copy_(b)
        if lo:
            tail[:, :lo].zero_()
        if hi < self.extra:
            tail[:, hi:].zero_()
        return buf

    def __deepcopy__(self, memo):
        return None


def wide_columns(bases, adapters, dtype: torch.dtype) -> list[int | None] | None:
    """Each projection's first tail column (None where it has no adapter), or None when the group
    cannot run widened: a base without a ``WideWeight``, a buffer of another dtype, unequal tail
    widths, or more rank columns than the tail holds."""
    widths = {base.wide and (base.wide.extra, base.wide.dtype) for base in bases}
    if len(widths) != 1 or None in widths:
        return None
    ((extra, buf_dtype),) = widths
    if buf_dtype != dtype:
        return None
    cols, col = [], 0
    for ad in adapters:
        cols.append(None if ad is None else col)
        col += 0 if ad is None else ad[0].shape[0]
    return cols if col <= extra else None


def widened_input(x2: torch.Tensor, extra: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A [N, in + extra] buffer whose first ``in`` columns hold X (copied unless ``out`` already
    holds it there, as the GLU kernel leaves H); the tail is filled by ``project_wide``."""
    if out is not None:
        return out
    # X copied in now; project_wide writes the whole tail before the widened products read it.
    xcat = x2.new_empty((x2.shape[0], x2.shape[1] + extra))
    xcat[:, : x2.shape[1]].copy_(x2)
    return xcat


def project_wide(x2: torch.Tensor, bases, adapters, xa: torch.Tensor | None, cols: list[int | None],
                 xcat: torch.Tensor | None = None, kept=None) -> list[torch.Tensor]:
    """Y_p = X W_pᵀ (+ b_p) + s_p·XA_p B_pᵀ for each projection p, one product each (module docstring).

    Args:
        x2: X [N, in].
        bases: the projections' ``BaseWeight``s, each with a ``WideWeight`` of tail width R.
        adapters: per projection (A, B, s) or None, in the column order of ``xa``.
        xa: X [A_p; …]ᵀ [N, Σ r_p] over the projections with an adapter, or None.
        cols: ``wide_columns(bases, adapters, dtype)``.
        xcat: a [N, in + R] buffer already holding X in its first ``in`` columns, or None (then
            X's own spare columns, ``spare_columns.spare_input``, or a copy of X).
        kept: a recompute's ``KeptWeights``: the NF4 buffers it may keep are put there.
    """
    dt, in_f = x2.dtype, x2.shape[1]
    extra = bases[0].wide.extra
    if xcat is not None and tuple(xcat.shape) != (x2.shape[0], in_f + extra):
        xcat = None  # a buffer for another tail width: copy X into a fitting one
    if xcat is None:  # X written by a producer that left spare columns after it (the RMSNorm kernel)
        xcat = spare_input(x2, extra)
    xcat = widened_input(x2, extra, xcat)
    tail = xcat[:, in_f:]
    used = 0 if xa is None else xa.shape[1]
    scales = {ad[2] for ad in adapters if ad is not None}
    if len(scales) == 1:  # one launch for the whole group (PEFT gives every adapter the same alpha / r)
        torch.mul(xa, scales.pop(), out=tail[:, :used])
    else:
        for ad, col in zip(adapters, cols):
            if ad is not None:
                torch.mul(xa[:, col:col + ad[0].shape[0]], ad[2], out=tail[:, col:col + ad[0].shape[0]])
    if used < extra:
        tail[:, used:].zero_()
    ys, token = [], forward_reuse.active()
    for base, ad, col in zip(bases, adapters, cols):
        buf = base.wide.fill(col, None if ad is None else ad[1], token=token)  # copy_ casts to the buffer's dtype
        ys.append(F.linear(xcat, buf, None if base.bias is None else base.bias.to(dt)))
        if kept is not None and keeps(base, dt):
            kept.put(base, buf)
        del buf  # an NF4 buffer goes before the next one is made (stream order keeps the product's read safe)
    return ys


def wide_grad_input(dys, bases, adapters, cols: list[int | None], a_stacked: torch.Tensor, kept=None, token=None):
    """(dX, dYB) of a widened group (module docstring): dX [N, in] and dYB = [s_p dY_p B_p]_p
    [N, Σ r_p] are column ranges of one [N, in + R] product sum (row stride in + R).

    Args:
        dys: dY_p [N, out_p] per projection, in the compute dtype.
        bases, adapters, cols: as in ``project_wide``; at least one adapter.
        a_stacked: [A_p; …] [Σ r_p, in] in the compute dtype (``lora_adapters.stacked_xa``).
        kept: the layer call's ``KeptWeights``: an NF4 buffer its recompute kept is taken from there.
        token: the layer call's ``ForwardReuse`` (``WideWeight.load``), or None.
    """
    dxw = None
    for dy, base, ad, col in zip(dys, bases, adapters, cols):  # one buffer at a time (NF4: each a new one)
        held = kept.take(base, dy.dtype, whole=True) if kept is not None and keeps(base, dy.dtype) else None
        buf = base.wide.fill(col, None if ad is None else ad[1], for_grad_input=True, buf=held, token=token)
        dxw = torch.mm(dy, buf) if dxw is None else dxw.addmm_(dy, buf)
        del buf, held
    in_f = bases[0].wide.in_features
    dyb = dxw[:, in_f:in_f + a_stacked.shape[0]]
    scales = {ad[2] for ad in adapters if ad is not None}
    if len(scales) > 1:
        for ad, col in zip(adapters, cols):
            if ad is not None and ad[2] != 1:
                dyb[:, col:col + ad[0].shape[0]].mul_(ad[2])
    elif (s := scales.pop()) != 1:  # PEFT's alpha = r gives s = 1: no launch
        dyb.mul_(s)
    return dxw[:, :in_f].addmm_(dyb, a_stacked), dyb
