"""Plain-PyTorch twins of the mixture-of-experts ops: ``grouped_mm``, ``moe_glu``, ``grouped_mlp``.

The oracle the kernels are tested against and the path taken where Triton cannot run (CPU without
``TRITON_INTERPRET=1``). Autograd derives every gradient here; nothing is hand-derived. The math
is the stock transformers experts' (a loop over experts, each token's rows gathered, the router
weight applied after the down projection), in float32 (float64 for float64 inputs), cast once at
the end to the input's dtype. Imports torch only.

Shapes (S rows = tokens × top-k, sorted by expert; E experts; ``offs`` [E] inclusive row ends):

    grouped_mm(x [S, K], w [E, K, N], offs)            rows of group g times w[g]   -> [S, N]
    grouped_mm_wgrad(a [S, M], b [S, N], offs, E)      a_gᵀ b_g for each group g     -> [E, M, N]
    moe_glu(gate_up [S, 2I], weights [S] | None, glu)  w · a(gate) · up               -> [S, I]
    grouped_mlp(x [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up, down, glu) -> [T, H]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["ExpertGLU", "ExpertProjection", "GLU_KINDS", "grouped_mlp", "grouped_mm", "grouped_mm_wgrad", "moe_glu",
           "split_gate_up"]

# "silu"/"gelu_tanh"/"gelu": act(gate) · up with gate = first half, up = second half (Qwen3-MoE,
# Mixtral, OLMoE, Granite-MoE, GLM-4-MoE). "clamped_swiglu": gpt-oss, gate/up interleaved
# (even/odd columns), gate ≤ limit, |up| ≤ limit, gate·σ(α·gate)·(up + 1).
GLU_KINDS = ("silu", "gelu_tanh", "gelu", "clamped_swiglu")


class ExpertGLU(NamedTuple):
    """The gated activation between the two expert products."""

    kind: str = "silu"
    alpha: float = 1.702  # clamped_swiglu only
    limit: float = 7.0  # clamped_swiglu only


class ExpertProjection(NamedTuple):
    """One stacked expert projection and its optional LoRA adapter.

    Attributes:
        weight: [E, out, in] (``transposed`` False: Qwen3-MoE, Mixtral) or [E, in, out] (True: gpt-oss).
        bias: [E, out] or None.
        lora_a: [E, r, in] or None.
        lora_b: [E, out, r] or None.
        scaling: the adapter's scale s (output += s · (x Aₑᵀ) Bₑᵀ).
        transposed: layout of ``weight``.
        wide: a ``moe_wide.WideExperts`` holding ``weight`` in a buffer bordered by A and s·B, or
            None (the fused path folds the LoRA terms into the base products; the math is the same).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    scaling: float = 1.0
    transposed: bool = False
    wide: object = None

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1 if self.transposed else 2]

    @property
    def out_features(self) -> int:
        return self.weight.shape[2 if self.transposed else 1]


def _dt(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w[g], computed in fp32/fp64 and returned in x's dtype."""
    dt = _dt(x, w)
    parts = [x[a:b].to(dt) @ w[g].to(dt) for g, (a, b) in enumerate(_bounds(offs))]
    y = torch.cat(parts) if parts else x.new_zeros(0, w.shape[2], dtype=dt)
    return torch.cat([y, y.new_zeros(x.shape[0] - y.shape[0], w.shape[2])]).to(x.dtype)


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, num_groups: int) -> torch.Tensor:
    """out[g] = a[rows of g]ᵀ @ b[rows of g] ([E, M, N], zero for an empty group), in a's dtype."""
    dt = _dt(a, b)
    out = [a[lo:hi].to(dt).t() @ b[lo:hi].to(dt) for lo, hi in _bounds(offs)]
    out += [a.new_zeros(a.shape[1], b.shape[1], dtype=dt)] * (num_groups - len(out))
    return torch.stack(out).to(a.dtype)


def _glu_math(gate: torch.Tensor, up: torch.Tensor, glu: ExpertGLU) -> torch.Tensor:
    if glu.kind == "silu":
        return F.silu(gate) * up
    if glu.kind == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if glu.kind == "gelu":
        return F.gelu(gate) * up
    if glu.kind == "clamped_swiglu":
        gate = gate.clamp(min=None, max=glu.limit)
        up = up.clamp(min=-glu.limit, max=glu.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * glu.alpha))
    raise ValueError(f"glu.kind must be one of {', '.join(GLU_KINDS)}, got {glu.kind!r}")


def split_gate_up(gate_up: torch.Tensor, glu: ExpertGLU) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views: halves (gate first), or even/odd columns for ``clamped_swiglu``."""
    if glu.kind == "clamped_swiglu":
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def moe_glu(gate_up: torch.Tensor, weights: torch.Tensor | None, glu: ExpertGLU) -> torch.Tensor:
    """weights[:, None] · a(gate) · up, in fp32/fp64, returned in gate_up's dtype."""
    dt = _dt(gate_up, weights)
    gate, up = split_gate_up(gate_up.to(dt), glu)
    h = _glu_math(gate, up, glu)
    if weights is not None:
        h = h * weights.to(dt)[:, None]
    return h.to(gate_up.dtype)


def _project(x: torch.Tensor, p: ExpertProjection, e: int, dt) -> torch.Tensor:
    w = p.weight[e].to(dt)
    y = x @ (w if p.transposed else w.t())
    if p.lora_a is not None:
        y = y + p.scaling * ((x @ p.lora_a[e].to(dt).t()) @ p.lora_b[e].to(dt).t())
    if p.bias is not None:
        y = y + p.bias[e].to(dt)
    return y


def grouped_mlp(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: ExpertProjection, down: ExpertProjection, glu: ExpertGLU = ExpertGLU()) -> torch.Tensor:
    """Σ_k top_k_weights[t, k] · down_e(a(gate_up_e(x_t))) over the experts e = top_k_index[t, k].

    Stock math, expert by expert (the transformers "eager" experts forward), in fp32/fp64; the
    result in x's dtype. Gradients by autograd, for x, the router weights, and every tensor of
    the two projections.
    """
    tensors = (x, top_k_weights, *gate_up, *down)
    dt = _dt(*[t for t in tensors if isinstance(t, torch.Tensor)])
    out = torch.zeros(x.shape, dtype=dt, device=x.device)
    xs = x.to(dt)
    for e in range(gate_up.num_experts):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        xe = xs[token]
        g, u = split_gate_up(_project(xe, gate_up, e, dt), glu)
        ye = _project(_glu_math(g, u, glu), down, e, dt)
        out = out.index_add(0, token, ye * top_k_weights[token, slot].to(dt)[:, None])
    return out.to(x.dtype)
