"""The routed expert MLP as one autograd Function: sort by expert, two grouped products, one GLU pass.

For T tokens x [T, H], each routed to k experts (``top_k_index`` [T, k], router weights
``top_k_weights`` [T, k]), with E experts of two projections (``moe_reference.ExpertProjection``:
stacked weights, optional biases, optional LoRA A/B per expert):

    out[t] = Σ_j w[t, j] · down_e( a(gate_up_e(x[t])) ),   e = top_k_index[t, j]
    proj_e(z) = z Wₑᵀ + s·(z Aₑᵀ) Bₑᵀ + bₑ

Forward (S = T·k rows):
  1. sort the flat expert ids (stable; one-byte keys where E ≤ 256): row i is (token t_i, expert
     e_i), groups of rows per expert, ``offs`` their ends (no host sync); w_i the router weight of row i;
  2. GU = grouped_mm(x[t], W_guᵀ) (+ (x[t] Aᵀ)(s·B)ᵀ, + b)                 [S, 2I]
  3. H' = w · a(gate)·up   (``moe_glu``: the router weight folded into H)   [S, I]
  4. Y = grouped_mm(H', W_dᵀ) (+ (H' Aᵀ)(s·B)ᵀ, + w·b)                       [S, H]
  5. out[t] = Σ of the k rows of token t (``moe_combine``: by the inverse permutation, in fp32, one pass).

Backward, dY_i = dout[t_i] (a gather):
  H' = moe_glu(GU, w) again (where the down projection's parameters need it, first: it is freed before
  dH' exists);  dH' = dY W_d + (dY s·B_d) A_d;  (dGU, dw) = moe_glu_backward(GU, dH', w)  [dw_i = ⟨dH'_i, v_i⟩,
  v = a(gate)·up]; with a down bias dw_i += ⟨dY_i, b_e⟩;  dx[t] = Σ_rows of t (dGU W_gu + (dGU s·B) A);
  dW_d[e] = dY_eᵀ H'_e,  dW_gu[e] = dGU_eᵀ x_e  (grouped_mm_wgrad; transposed layouts swap operands);
  dA = (dY s·B)ᵀ z,  dB = s·dYᵀ (z Aᵀ)  per expert;  db[e] = Σ rows of e (times w for the down bias).
  With the gate/up weight frozen, its dA is one dense product over the tokens instead ([T, E·r] of
  s·dGU B scattered by (token, expert), times x): x[t] is then never gathered in backward.

Widened weights (``moe_wide.WideExperts``, a projection's ``wide``, bordered by A and s·B): the
rank-r terms ride in the base products (one fp32 accumulation each). Forward: [z | z Aᵀ | 0] Mᵀ;
x is gathered from [x | 0] and the GLU writes H into the down projection's widened input.
Backward: dz = [dY | dY s·B | 0] M[:, :in]; the GLU's backward writes dGU into the first 2I
columns of a [S, 2I + R] buffer (GU is then not overwritten) and dY of the down projection is
gathered from [dout | 0].

Without autograd (no gradient asked for: a checkpointed layer's forward, inference) the same forward
runs outside the Function and frees GU once the GLU has read it, before Y exists: the working set is
x[t] + GU or H' + Y instead of GU + H' + Y (the CUDA graphs' pool of forward_graphs.py: 0.92 -> 0.67 GiB).

Saved between forward and backward: GU [S, 2I] (its buffer receives dGU unless bordered; in a recompute
whose backward follows at once, ``backward_follows.py``, it rides on ctx and is freed after its last read), the
routing indices and the gate/up projection's rank-r product x[t] Aᵀ [S, r]; x[t], H' and the down
projection's rank-r product are recomputed (x itself is the caller's; H' does not exist in a recompute that
skips the down projection). A frozen weight held in
NF4 (``nf4_weight.NF4Weight``, QLoRA experts) is dequantised where it is used, in the forward and
again in the backward: at most one projection's dense weight is alive at a time, none between
them. An expert with no row gets zero gradients. Every product runs in the base weight's dtype (x, adapters and biases are
cast to it, as PEFT and transformers' grouped experts do); the output is returned in x's dtype,
every gradient in its input's dtype.
"""

from __future__ import annotations

import torch

from . import moe_reference as reference
from ._backend import check_float, check_same_device, use_triton
from .backward_follows import backward_follows_now
from .grouped_mm import grouped_mm, grouped_mm_wgrad
from .moe_combine import combine_rows
from .moe_glu import moe_glu, moe_glu_backward
from .moe_reference import ExpertGLU, ExpertProjection
from .nf4_weight import NF4Weight
from .scratch_pool import scratch

__all__ = ["GroupedMLPFunction", "grouped_mlp", "ExpertGLU", "ExpertProjection"]

_FIELDS = 4  # tensors per projection handed to the Function: weight, bias, lora_a, lora_b


def _dense(weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense tensor of ``dtype`` (an ``NF4Weight`` dequantised for this use)."""
    return weight.dequantize().to(dtype) if isinstance(weight, NF4Weight) else weight.to(dtype)


def _as_kn(p_weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The [E, in, out] view that rows multiply (z @ w[e])."""
    return p_weight if transposed else p_weight.transpose(1, 2)


class _Proj:
    """One projection inside the Function: its tensors in the compute dtype and its layout.

    ``a`` is A [E, r, in] and ``b_s`` is s·B [E, out, r] in the compute dtype (the rank-r product
    ``rank_input`` = z Aᵀ is unscaled: s rides in B). ``wide`` (``moe_wide.WideExperts``): the weight
    lives in a bordered buffer; used when it still holds the weight (no cast, no re-homing since)
    and its border fits the adapter. Then A and s·B are loaded into the border (``a``/``b_s`` are
    views of it), the rows' input is widened ([z | z Aᵀ | 0]) and the rank-r terms ride in the
    base products, forward and input gradient."""

    def __init__(self, weight, bias, lora_a, lora_b, scaling, transposed, wide, dtype):
        self.weight = _dense(weight, dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.scaling = float(scaling)
        self.transposed = transposed
        self.wide = wide if _fits(wide, self.weight, lora_a) else None
        self.a = self.b_s = None
        if self.wide is not None:
            self.wide.load(lora_a, lora_b, self.scaling)  # no adapter: a zero border
            if lora_a is not None:
                self.a, self.b_s = self.wide.lora_a(), self.wide.scaled_lora_b()
        elif lora_a is not None:
            self.a = lora_a.to(dtype).contiguous()
            # A contiguous s·B: PEFT's B arrives as a strided view [E, out, r] whose layout torch's
            # grouped GEMM refuses.
            self.b_s = torch.empty(lora_b.shape, dtype=dtype, device=lora_b.device)
            torch.mul(lora_b, self.scaling, out=self.b_s)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1 if self.transposed else 2]

    @property
    def out_features(self) -> int:
        return self.weight.shape[2 if self.transposed else 1]

    @property
    def bordered(self) -> bool:
        """Widened with an adapter: the products carry the rank-r terms."""
        return self.wide is not None and self.a is not None

    def widened_input(self, rows: int, device) -> torch.Tensor | None:
        """A [rows, in + R] input buffer with a zero tail (None: not widened); its first ``in``
        columns are the caller's to fill (by a kernel that takes a row stride) before ``forward``."""
        if self.wide is None:
            return None
        z = torch.empty(rows, self.in_features + self.wide.extra, dtype=self.weight.dtype, device=device)
        z[:, self.in_features:].zero_()
        return z

    def rank_input(self, z, offs):
        """z Aₑᵀ [rows, r] (unscaled)."""
        return grouped_mm(z, self.a.transpose(1, 2), offs)

    def forward(self, z, offs, expert, row_weight=None):
        """(y, z Aᵀ or None): the rows' output and the rank-r product (dB needs it again).
        ``z``: [rows, in], or the ``widened_input`` buffer when widened."""
        rank = None
        if self.wide is not None:
            n_in = self.in_features
            if self.a is not None:
                rank = self.rank_input(z[:, :n_in], offs)
                z[:, n_in:n_in + rank.shape[1]].copy_(rank)
            y = grouped_mm(z, self.wide.forward_weight(), offs)
        else:
            y = grouped_mm(z, _as_kn(self.weight, self.transposed), offs)
            if self.a is not None:
                rank = self.rank_input(z, offs)
                y.add_(grouped_mm(rank, self.b_s.transpose(1, 2), offs))
        if self.bias is not None:
            b = self.bias[expert]
            y.add_(b if row_weight is None else b * row_weight[:, None].to(b.dtype))
        return y, rank

    def rank_grad(self, dy, offs):
        """s · dY Bₑ [rows, r] (None without an adapter)."""
        return None if self.a is None else grouped_mm(dy, self.b_s, offs)

    def grad_input(self, dy, offs, dy_ext=None, dyb=None):
        """(dz [rows, in], s · dY Bₑ [rows, r] or None). ``dy_ext`` (bordered): [rows, out + R] whose first
        ``out`` columns are ``dy`` and whose columns past out + r are zero; dz is then one product,
        [dY | s·dY B | 0] Mₑ[:, :in]. Else separate products (a strided dz, the alternative, costs more).
        ``dyb``: ``rank_grad(dy)`` when the caller has it."""
        weight_t = _as_kn(self.weight, self.transposed).transpose(1, 2)
        if self.a is None:
            return grouped_mm(dy, weight_t, offs), None
        if dyb is None:
            dyb = self.rank_grad(dy, offs)
        if self.bordered and dy_ext is not None:
            n_out = self.out_features
            dy_ext[:, n_out:n_out + dyb.shape[1]].copy_(dyb)
            return grouped_mm(dy_ext, self.wide.backward_weight(), offs), dyb
        dz = grouped_mm(dy, weight_t, offs)
        dz.add_(grouped_mm(dyb, self.a, offs))
        return dz, dyb

    def backward(self, z, dy, offs, needs, rank=None, dy_ext=None):
        """(dz, dweight, dA, dB): dz of the rows, and the parameter gradients asked for by ``needs``
        (weight, lora_a, lora_b); ``rank``: the forward's z Aᵀ, recomputed when not given."""
        dz, dyb = self.grad_input(dy, offs, dy_ext)
        return (dz, *self.param_grads(z, dy, dyb, offs, needs, rank))

    def param_grads(self, z, dy, dyb, offs, needs, rank=None, by_token=None):
        """(dweight, dA, dB) asked for by ``needs``; ``dyb``: s · dY Bₑ from ``grad_input``. ``by_token``:
        (x, token, expert) of the rows, for dA without the gathered rows ``z`` (None then)."""
        E = self.weight.shape[0]
        dw = da = db = None
        if needs[0]:
            dw = grouped_mm_wgrad(z, dy, offs, E) if self.transposed else grouped_mm_wgrad(dy, z, offs, E)
        if self.a is not None:
            if needs[1]:
                da = (grouped_mm_wgrad(dyb, z, offs, E) if by_token is None
                      else _lora_a_grad_by_token(dyb, *by_token, E))
            if needs[2]:
                db = grouped_mm_wgrad(dy, self.rank_input(z, offs) if rank is None else rank, offs, E)
                db.mul_(self.scaling)
        return dw, da, db


def _lora_a_grad_by_token(dyb, x, token, expert, E: int) -> torch.Tensor:
    """dAₑ = Σ over e's rows i of dybᵢ ⊗ x[tᵢ], [E, r, in], as one dense product over the tokens: dyb
    scattered into [T, E·r] (zero where a token did not pick e), times x. Needs no [S, in] gather of x
    (256 MiB at 8k tokens of Qwen3-30B-A3B) and runs as one large GEMM; fp32 accumulation, one rounding."""
    T, r = x.shape[0], dyb.shape[1]
    by_token = torch.zeros(T, E, r, dtype=dyb.dtype, device=dyb.device)
    by_token.index_put_((token, expert.long()), dyb, accumulate=True)  # (t, e) pairs are distinct: top-k
    return torch.mm(by_token.view(T, E * r).t(), x.to(dyb.dtype)).view(E, r, x.shape[1])


def _fits(wide, weight, lora_a) -> bool:
    """``wide`` (a ``WideExperts`` or None) holds ``weight`` as the Function computes with it (no cast,
    no re-homing since) and its border fits the adapter."""
    return (wide is not None and isinstance(weight, torch.Tensor) and wide.holds(weight)
            and (lora_a is None or lora_a.shape[1] <= wide.extra))


_GROUP_IDS: dict[tuple, torch.Tensor] = {}  # 0..E-1 per (E, dtype, device): offsets by one searchsorted


def _route(top_k_index: torch.Tensor, num_experts: int):
    """(expert of each sorted row [S] (uint8 or int32), perm [S] int64 the flat slot of each row,
    offs [E] int32 inclusive row ends). The sort's keys are one byte where E ≤ 256: one radix pass
    instead of eight for int64 keys (a launch each, host time in a host-bound forward)."""
    flat = top_k_index.reshape(-1)
    keys = flat.to(torch.uint8 if num_experts <= 256 else torch.int32)
    expert, perm = torch.sort(keys, stable=True)
    key = (num_experts, keys.dtype, keys.device)
    ids = _GROUP_IDS.get(key)
    if ids is None:
        ids = _GROUP_IDS[key] = torch.arange(num_experts, dtype=keys.dtype, device=keys.device)
    offs = torch.searchsorted(expert, ids, right=True, out_int32=True)
    return expert, perm, offs


def _segment_sum(rows: torch.Tensor, expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Σ of the rows of each expert [E, N] (fp32 accumulation)."""
    out = torch.zeros(num_experts, rows.shape[1], dtype=torch.float32, device=rows.device)
    return out.index_add_(0, expert, rows.float())


def _forward(x, top_k_index, top_k_weights, glu, meta, output_unused, tensors, save: bool):
    """(out, what backward needs: expert, token, inverse, offs, w, GU, x[t] Aᵀ, or None without ``save``).
    Without ``save`` (no backward follows: a checkpointed layer's forward) GU is freed once the GLU has
    read it, before the down product's [S, H] output exists: a smaller working set."""
    T, k = top_k_index.shape
    dtype = tensors[0].dtype
    gu_p = _Proj(*tensors[:_FIELDS], *meta[0], dtype)
    E = gu_p.weight.shape[0]
    expert, perm, offs = _route(top_k_index, E)
    if tensors[1] is not None or tensors[_FIELDS + 1] is not None:
        expert = expert.long()  # the biases are gathered by it (a one-byte index would be a mask)
    token = perm // k
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    w = top_k_weights.reshape(-1)[perm]
    if gu_p.wide is None:
        xs = x.to(dtype)[token]
    else:  # [x | 0] by a concatenation (a contiguous write), then the gather copies the zero tail along
        xs = torch.cat((x.to(dtype), x.new_zeros(T, gu_p.wide.extra, dtype=dtype)), 1)[token]
    gate_up, gu_rank = gu_p.forward(xs, offs, expert)
    del xs, gu_p
    state = (expert, token, inverse, offs, w, gate_up, gu_rank) if save else None
    if output_unused:  # a discarded recompute: backward needs gate_up alone; NaNs, so a use shows
        return torch.full_like(x, float("nan")), state
    d_p = _Proj(*tensors[_FIELDS:], *meta[1], dtype)
    h = d_p.widened_input(gate_up.shape[0], x.device)  # the GLU writes H into its first I columns
    if h is None:
        h = moe_glu(gate_up, w, glu)
    else:
        moe_glu(gate_up, w, glu, out=h[:, : d_p.in_features])
    del gate_up, gu_rank  # without save, their last reference
    y, _ = d_p.forward(h, offs, expert, row_weight=w)
    del d_p, h
    return combine_rows(y, inverse, k, x.dtype), state


class GroupedMLPFunction(torch.autograd.Function):
    """See the module docstring. Inputs: x, top_k_index, top_k_weights, glu, the two projections'
    (scaling, transposed), output_unused, then their tensors (weight, bias, lora_a, lora_b) each."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, glu, meta, output_unused, *tensors):
        out, state = _forward(x, top_k_index, top_k_weights, glu, meta, output_unused, tensors, save=True)
        # NF4 weights are no tensors autograd can save: they ride on ctx (frozen, nothing to track).
        ctx.nf4 = {i: t for i, t in enumerate(tensors) if isinstance(t, NF4Weight)}
        saved = [None if i in ctx.nf4 else t for i, t in enumerate(tensors)]
        # A recompute whose backward runs at once (backward_follows.py): GU rides on ctx, so that the
        # backward frees it after its last read, before dX's [S, H] rows are taken.
        ctx.gate_up = [state[5]] if backward_follows_now() else None
        if ctx.gate_up is not None:
            state = (*state[:5], None, *state[6:])
        ctx.save_for_backward(x, *state, *saved)
        ctx.glu, ctx.meta, ctx.k, ctx.w_dtype = glu, meta, top_k_index.shape[1], top_k_weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        x, expert, token, inverse, offs, w, gate_up, gu_rank, *tensors = ctx.saved_tensors
        if ctx.gate_up is not None:
            if not ctx.gate_up:
                raise RuntimeError("grouped_mlp: a recompute's backward ran twice (its gate/up activations are "
                                   "freed by the first); back-propagate a recompute once")
            gate_up = ctx.gate_up.pop()
        tensors = [ctx.nf4.get(i, t) for i, t in enumerate(tensors)]
        needs = ctx.needs_input_grad
        t_needs = needs[6:]  # of the projections' tensors
        dtype = tensors[0].dtype
        d_p = _Proj(*tensors[_FIELDS:], *ctx.meta[1], dtype)
        E, T, k = d_p.weight.shape[0], x.shape[0], ctx.k
        gu_needs = (t_needs[0], t_needs[2], t_needs[3])
        d_needs = (t_needs[4], t_needs[6], t_needs[7])

        # The [S, ·] temporaries (dY gathered, dH', dGU, H', x gathered, its gradient) may come from an idle
        # CUDA graph pool (scratch_pool.py): each dies in this backward. Gradients that leave it are
        # allocated outside those blocks.
        # Order (the working set of each moment; bordered, [S, ·] bf16 at 8k tokens of Qwen3-30B-A3B):
        # H' and dY's products for the down projection's parameters first (GU + H' + dY), then dH' (GU + dY +
        # dH'), then dGU (GU + dH' + dGU), then dX (dGU + dX: GU is freed first where it rides on ctx).
        reads_h = d_needs[0] or (d_p.a is not None and (d_needs[1] or d_needs[2]))
        with scratch(dout.device):
            # H' (recomputed, bit for bit the forward's) where the down projection's parameter gradients read it.
            h = moe_glu(gate_up, w, ctx.glu) if reads_h else None
            if d_p.bordered:  # dY gathered into [dY | 0 ...]: the border receives s·dY B
                dy_ext = torch.cat((dout.to(dtype), dout.new_zeros(T, d_p.wide.extra, dtype=dtype)), 1)[token]
                dy = dy_ext[:, : d_p.out_features]
            else:
                dy_ext, dy = None, dout.to(dtype)[token]  # [S, H]
            dyb = d_p.rank_grad(dy, offs)
        # The down projection's parameter gradients.
        d_grads = [None] * _FIELDS
        if d_needs[0]:
            d_grads[0] = (grouped_mm_wgrad(h, dy, offs, E) if d_p.transposed else grouped_mm_wgrad(dy, h, offs, E))
        if d_p.a is not None and d_needs[1]:
            d_grads[2] = grouped_mm_wgrad(dyb, h, offs, E)
        if d_p.a is not None and d_needs[2]:
            d_grads[3] = grouped_mm_wgrad(dy, d_p.rank_input(h, offs), offs, E).mul_(d_p.scaling)
        dw_bias = None
        if d_p.bias is not None:
            dw_bias = (dy.float() * d_p.bias[expert].float()).sum(-1)
            if t_needs[5]:
                d_grads[1] = _segment_sum(dy.float() * w.float()[:, None], expert, E)
        del h
        with scratch(dout.device):
            dh, _ = d_p.grad_input(dy, offs, dy_ext, dyb=dyb)
        del dy, dy_ext, dyb, d_p
        with scratch(dout.device):
            gu_wide = ctx.meta[0][2]
            if tensors[2] is not None and _fits(gu_wide, tensors[0], tensors[2]):
                # Bordered: dGU goes into the first 2I columns of [dGU | s·dGU B | 0], whose border the
                # gate/up projection's grad_input fills (gate_up stays saved: it is not overwritten).
                n_gu, r = gate_up.shape[1], tensors[2].shape[1]
                gu_ext = torch.empty(gate_up.shape[0], n_gu + gu_wide.extra, dtype=dtype, device=gate_up.device)
                if r < gu_wide.extra:
                    gu_ext[:, n_gu + r:].zero_()
                dgu, _, dw = moe_glu_backward(gate_up, dh, w, ctx.glu, out=gu_ext[:, :n_gu], with_h=False)
            else:
                gu_ext = None
                dgu, _, dw = moe_glu_backward(gate_up, dh, w, ctx.glu, overwrite=True, with_h=False)
            del dh, gate_up  # GU's last read (freed here where it rode on ctx)
        if dw_bias is not None:
            dw = dw + dw_bias
        # The gate/up projection (bordered: dGU is the first 2I columns of gu_ext).
        gu_p = _Proj(*tensors[:_FIELDS], *ctx.meta[0], dtype)
        by_token = None if gu_needs[0] else (x, token, expert)  # frozen experts: dA without gathering x
        with scratch(dout.device):
            xs = x.to(dtype)[token] if by_token is None else None
            dxs, gu_dyb = gu_p.grad_input(dgu, offs, gu_ext)
        gu_w, gu_a, gu_b = gu_p.param_grads(xs, dgu, gu_dyb, offs, gu_needs, rank=gu_rank, by_token=by_token)
        gu_grads = [gu_w, None, gu_a, gu_b]
        if gu_p.bias is not None and t_needs[1]:
            gu_grads[1] = _segment_sum(dgu, expert, E)
        del xs, dgu, gu_ext
        dx = combine_rows(dxs, inverse, k, x.dtype) if needs[0] else None
        dtopk = dw[inverse].view(T, k).to(ctx.w_dtype) if needs[2] else None
        grads = []
        for g, t in zip(gu_grads + d_grads, tensors):
            grads.append(None if g is None or t is None or isinstance(t, NF4Weight) else g.to(t.dtype))
        return (dx, None, dtopk, None, None, None, *grads)


def _check(x, top_k_index, top_k_weights, gate_up: ExpertProjection, down: ExpertProjection, glu: ExpertGLU):
    check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    integer = top_k_index.dtype in (torch.int64, torch.int32)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or not integer:
        raise ValueError(f"top_k_index must be integer [T, k] with T = {x.shape[0]}, got {top_k_index.dtype} "
                         f"{tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights {tuple(top_k_weights.shape)} must match top_k_index "
                         f"{tuple(top_k_index.shape)}")
    E, H = gate_up.num_experts, x.shape[1]
    for name, p, n_in, n_out in (("gate_up", gate_up, H, None), ("down", down, None, H)):
        check_float(f"{name}.weight", p.weight)
        if p.weight.dim() != 3 or p.num_experts != E:
            raise ValueError(f"{name}.weight must be [E={E}, ., .], got {tuple(p.weight.shape)}")
        if (n_in is not None and p.in_features != n_in) or (n_out is not None and p.out_features != n_out):
            raise ValueError(f"{name}.weight {tuple(p.weight.shape)} does not fit hidden size {H} "
                             f"(transposed={p.transposed})")
        if (p.lora_a is None) != (p.lora_b is None):
            raise ValueError(f"{name}: lora_a and lora_b come together")
        if p.lora_a is not None and (p.lora_a.shape[:1] + p.lora_a.shape[2:] != (E, p.in_features)
                                     or p.lora_b.shape[:2] != (E, p.out_features)
                                     or p.lora_b.shape[2] != p.lora_a.shape[1]):
            raise ValueError(f"{name}: lora_a {tuple(p.lora_a.shape)} / lora_b {tuple(p.lora_b.shape)} must be "
                             f"[E, r, {p.in_features}] / [E, {p.out_features}, r]")
        if p.bias is not None and p.bias.shape != (E, p.out_features):
            raise ValueError(f"{name}.bias must be [{E}, {p.out_features}], got {tuple(p.bias.shape)}")
    if gate_up.out_features != 2 * down.in_features:
        raise ValueError(f"gate_up gives {gate_up.out_features} columns; down takes {down.in_features} (need 2×)")
    check_same_device(x=x, top_k_index=top_k_index, top_k_weights=top_k_weights, gate_up=gate_up.weight,
                      down=down.weight)


def grouped_mlp(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: ExpertProjection, down: ExpertProjection, glu: ExpertGLU = ExpertGLU(), *,
                output_unused: bool = False) -> torch.Tensor:
    """The routed expert MLP (module docstring), [T, H] in x's dtype; ``moe_reference.grouped_mlp``'s math.

    Args:
        x: [T, H] float32/float16/bfloat16 tokens.
        top_k_index: [T, k] int64 expert of each (token, slot).
        top_k_weights: [T, k] router weight of each (token, slot); differentiable.
        gate_up: the first projection, out = 2I (gate and up as ``glu`` lays them out). A frozen
            weight may be an ``NF4Weight`` (dequantised per use; its gradient is never asked for).
        down: the second projection, in = I, out = H.
        glu: the activation between them.
        output_unused: the caller discards the output and only needs the backward state (a
            checkpoint recompute whose output only enters the residual sum): the GLU, the down
            projection and the sum over slots are skipped and the output is NaN. The reference path
            (no Triton) computes it anyway: its saved tensors must match its forward's.

    Raises:
        ValueError / TypeError naming the argument for shapes, dtypes or devices that do not fit.
    """
    _check(x, top_k_index, top_k_weights, gate_up, down, glu)
    tensors = (*gate_up[:4], *down[:4])
    if not use_triton(x, *[t.packed if isinstance(t, NF4Weight) else t for t in tensors if t is not None]):
        gate_up, down = (p._replace(weight=p.weight.dequantize()) if isinstance(p.weight, NF4Weight) else p
                         for p in (gate_up, down))
        return reference.grouped_mlp(x, top_k_index, top_k_weights, gate_up, down, glu)
    meta = tuple((p.scaling, p.transposed, p.wide) for p in (gate_up, down))
    if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                              for t in (x, top_k_weights, *tensors)):
        return _forward(x, top_k_index, top_k_weights, glu, meta, bool(output_unused), tensors, save=False)[0]
    return GroupedMLPFunction.apply(x, top_k_index, top_k_weights, glu, meta, bool(output_unused), *tensors)
