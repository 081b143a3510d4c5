"""lora_mlp (fused LoRA gated MLP, Triton elementwise step) against float64 autograd of reference.py.

Output and every gradient (x; A, B of gate, up and down) for each activation, dense and NF4
bases, partial adapters, odd widths. Tolerances as in test_lora.py: fp32 rel ≤ 1e-5 (Frobenius);
bf16: error norm ≤ 2 × that of reference.lora_mlp run in bf16 + 1e-4 of the result's norm.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fasttune.kernels import lora_glu, reference
from fasttune.kernels.lora import BaseWeight
from fasttune.kernels.lora_glu import lora_mlp
from fasttune.kernels.nf4 import dequantize_nf4

from helpers.kernel_checks import check_in_norm


def proj(out_f, in_f, r, dtype, device, seed, nf4=False):
    """(base, A, B, s): dense or NF4 (random codes, nested scales) base; trainable A, B (B ≠ 0)."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(in_f)
    if nf4:
        n = out_f * in_f
        nb = -(-n // 64)
        state2 = SimpleNamespace(code=torch.sort(torch.rand(256, generator=g)).values.to(device),
                                 absmax=(torch.rand(-(-nb // 256), generator=g) * scale + scale).to(device),
                                 blocksize=256)
        qs = SimpleNamespace(absmax=torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g).to(device),
                             shape=torch.Size((out_f, in_f)), dtype=dtype, blocksize=64, quant_type="nf4",
                             nested=True, offset=torch.tensor(0.2 * scale, device=device), state2=state2)
        base = (torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, generator=g).to(device), qs)
    else:
        base = (torch.randn(out_f, in_f, generator=g) * 1.5 * scale).to(device, dtype)
    if r == 0:
        return base, None, None, 0.0
    a = (torch.randn(r, in_f, generator=g) * scale).to(device, dtype).requires_grad_()
    b = (torch.randn(out_f, r, generator=g) / math.sqrt(r)).to(device, dtype).requires_grad_()
    return base, a, b, 0.5 + seed % 4 * 0.5


def leaf(t, dtype):
    return None if t is None else t.detach().to(dtype).requires_grad_()


def run_reference(x, specs, dy, activation, dtype):
    xl = leaf(x, dtype)
    leaves, ref_specs = [xl], []
    for base, a, b, s in specs:
        bw = BaseWeight.of(base)
        w = dequantize_nf4(bw.weight, bw.quant_state) if bw.is_nf4 else bw.weight
        al, bl = leaf(a, dtype), leaf(b, dtype)
        leaves += [t for t in (al, bl) if t is not None]
        ref_specs.append((w.to(dtype), al, bl, s))
    y = reference.lora_mlp(xl, *ref_specs, activation=activation)
    return y, torch.autograd.grad(y, leaves, dy.to(dtype))


def check_mlp(x, specs, activation, dtype):
    y = lora_mlp(x, *specs, activation=activation)
    assert y.dtype == dtype and y.shape == x.shape[:-1] + (BaseWeight.of(specs[2][0]).shape[0],)
    dy = torch.randn_like(y)
    params = [x] + [t for _, a, b, _ in specs for t in (a, b) if t is not None]
    got = torch.autograd.grad(y, params, dy)
    ref_y, ref_g = run_reference(x, specs, dy, activation, torch.float64)
    same_y, same_g = (None, [None] * len(params))
    if dtype != torch.float32:
        same_y, same_g = run_reference(x, specs, dy, activation, dtype)
    check_in_norm(y, ref_y, same_y, what="output", rtol=1e-5, atol=1e-4)
    for i, (g, r, s) in enumerate(zip(got, ref_g, same_g)):
        assert g.dtype == params[i].dtype
        check_in_norm(g, r, s, what=f"grad {i}", rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mlp_dense(device, dtype, activation):
    torch.manual_seed(0)
    x = torch.randn(2, 37, 72, device=device, dtype=dtype, requires_grad=True)
    specs = [proj(203, 72, 8, dtype, device, 1), proj(203, 72, 8, dtype, device, 2), proj(72, 203, 8, dtype, device, 3)]
    check_mlp(x, specs, activation, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mlp_nf4(device, dtype):
    torch.manual_seed(1)
    x = torch.randn(45, 96, device=device, dtype=dtype, requires_grad=True)
    specs = [proj(200, 96, 8, dtype, device, 4, nf4=True), proj(200, 96, 16, dtype, device, 5, nf4=True),
             proj(96, 200, 8, dtype, device, 6, nf4=True)]
    check_mlp(x, specs, "silu", dtype)


@pytest.mark.parametrize("missing", [0, 2])
def test_lora_mlp_partial_adapters(device, missing):
    """No adapter on gate (missing=0) or on down (missing=2: H is then not recomputed)."""
    torch.manual_seed(2)
    x = torch.randn(31, 64, device=device, requires_grad=True)
    specs = [proj(150, 64, 8, torch.float32, device, 7), proj(150, 64, 4, torch.float32, device, 8),
             proj(64, 150, 8, torch.float32, device, 9)]
    specs[missing] = (specs[missing][0], None, None, 0.0)
    check_mlp(x, specs, "gelu_tanh", torch.float32)


@pytest.mark.parametrize("ranks", [(5, 33), (64, 1), (65, 8)], ids=["5-33", "64-1", "65-8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mlp_gate_up_ranks(device, dtype, ranks):
    """Odd, unequal and large gate/up ranks (one stacked XA product of r_g + r_u columns)."""
    torch.manual_seed(5)
    x = torch.randn(70, 48, device=device, dtype=dtype, requires_grad=True)
    specs = [proj(130, 48, ranks[0], dtype, device, 24), proj(130, 48, ranks[1], dtype, device, 25),
             proj(48, 130, 4, dtype, device, 26)]
    check_mlp(x, specs, "silu", dtype)


def test_torch_fallback_matches_triton(device, monkeypatch):
    """The elementwise step's PyTorch fallback (no Triton) gives the same numbers."""
    torch.manual_seed(3)
    x = torch.randn(20, 64, device=device, requires_grad=True)
    specs = [proj(96, 64, 4, torch.float32, device, 10), proj(96, 64, 4, torch.float32, device, 11),
             proj(64, 96, 4, torch.float32, device, 12)]
    params = [x] + [t for _, a, b, _ in specs for t in (a, b)]
    y = lora_mlp(x, *specs)
    g1 = torch.autograd.grad(y.square().sum(), params)
    monkeypatch.setattr(lora_glu, "use_triton", lambda *t: False)
    y2 = lora_mlp(x, *specs)
    g2 = torch.autograd.grad(y2.square().sum(), params)
    for i, (a, b) in enumerate(zip((y, *g1), (y2, *g2))):
        check_in_norm(a, b, what=f"fallback vs Triton {i}", rtol=1e-6)


def test_saves_x_g_u_not_h(device):
    """Saved for backward: X [N, D], G and U [N, I], XA and HA (rank-wide), the adapters; no H."""
    n, d, i = 24, 64, 160
    x = torch.randn(n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    specs = [proj(i, d, 8, torch.bfloat16, device, 13, nf4=True), proj(i, d, 4, torch.bfloat16, device, 14),
             proj(d, i, 8, torch.bfloat16, device, 15, nf4=True)]
    saved = {}

    def pack(t):  # distinct storages: the adapters in the compute dtype are the adapters themselves
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_mlp(x, *specs)
    adapters = sum(t.numel() for _, a, b, _ in specs for t in (a, b))
    # ... plus [A_g; A_u] stacked (one product for X [A_g; A_u]ᵀ, reused by backward's dX)
    assert sum(saved.values()) == n * d + 2 * n * i + n * (8 + 4) + n * 8 + adapters + (8 + 4) * d


@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_output_unused_skips_down_but_keeps_every_gradient(device, nf4, monkeypatch):
    """output_unused (a checkpoint recompute): no down product, NaN output, bitwise-equal gradients."""
    torch.manual_seed(4)
    x = torch.randn(29, 64, device=device, requires_grad=True)
    specs = [proj(150, 64, 8, torch.float32, device, 19, nf4=nf4), proj(150, 64, 4, torch.float32, device, 20),
             proj(64, 150, 8, torch.float32, device, 21, nf4=nf4)]
    params = [x] + [t for _, a, b, _ in specs for t in (a, b)]
    dy = torch.randn(29, 64, device=device)
    y = lora_mlp(x, *specs)
    full = torch.autograd.grad(y, params, dy)
    projected = []
    real_project = lora_glu.project
    monkeypatch.setattr(lora_glu, "project", lambda x2, bases, *a, **k: projected.append(len(bases)) or
                        real_project(x2, bases, *a, **k))
    y_skip = lora_mlp(x, *specs, output_unused=True)
    assert projected == [2]  # gate and up only
    assert y_skip.shape == y.shape and torch.isnan(y_skip).all()
    skipped = torch.autograd.grad(y_skip, params, dy)
    for name, a, b in zip(["x", "ag", "bg", "au", "bu", "ad", "bd"], full, skipped):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("gate_up_adapters", [False, True], ids=["no-adapters", "gate-up-adapters"])
def test_output_unused_without_a_down_adapter_keeps_every_gradient(device, gate_up_adapters, monkeypatch):
    """Without an adapter on down, a discarded recompute needs no H: no GLU pass, unless the pass is also where
    gate/up's rank-r terms are added (Triton, bases not widened)."""
    torch.manual_seed(5)
    x = torch.randn(23, 64, device=device, requires_grad=True)
    g, u, d = proj(150, 64, 8, torch.float32, device, 24), proj(150, 64, 4, torch.float32, device, 25), \
        proj(64, 150, 8, torch.float32, device, 26)
    if not gate_up_adapters:
        g, u = (g[0], None, None, 1.0), (u[0], None, None, 1.0)
    d = (d[0], None, None, 1.0)
    params = [x] + [t for spec in (g, u) for t in spec[1:3] if t is not None]
    dy = torch.randn(23, 64, device=device)
    full = torch.autograd.grad(lora_mlp(x, g, u, d), params, dy)
    passes = []
    for name in ("glu_forward", "glu_forward_rank_"):
        real = getattr(lora_glu, name)
        monkeypatch.setattr(lora_glu, name, lambda *a, _real=real, **k: passes.append(1) or _real(*a, **k))
    y_skip = lora_mlp(x, g, u, d, output_unused=True)
    rank_in_glu = gate_up_adapters and lora_glu.use_triton(x)
    assert len(passes) == (1 if rank_in_glu else 0) and torch.isnan(y_skip).all()
    skipped = torch.autograd.grad(y_skip, params, dy)
    assert all(torch.equal(a, b) for a, b in zip(full, skipped))


def test_backward_twice_raises(device):
    x = torch.randn(8, 64, device=device, requires_grad=True)
    specs = [proj(96, 64, 4, torch.float32, device, s) for s in (16, 17)] + [proj(64, 96, 4, torch.float32, device, 18)]
    y = lora_mlp(x, *specs).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        y.backward()


def test_invalid_inputs_raise(device):
    x = torch.randn(8, 64, device=device)
    g, u, d = (proj(96, 64, 4, torch.float32, device, 19), proj(96, 64, 4, torch.float32, device, 20),
               proj(64, 96, 4, torch.float32, device, 21))
    with pytest.raises(ValueError, match="activation"):
        lora_mlp(x, g, u, d, activation="relu")
    with pytest.raises(ValueError, match="up has"):
        lora_mlp(x, g, proj(80, 64, 4, torch.float32, device, 22), d)
    with pytest.raises(ValueError, match="down expects"):
        lora_mlp(x, g, u, proj(64, 80, 4, torch.float32, device, 23))
    with pytest.raises(TypeError, match="base weight is"):
        lora_mlp(x, (g[0].half(), *g[1:]), u, d)


@pytest.mark.gpu
@pytest.mark.parametrize("nf4", [False, True])
def test_llama8b_mlp_on_gpu(nf4):
    """Llama-3-8B MLP: x [8192, 4096], I = 14336, r = 16, bf16, against float64."""
    torch.manual_seed(4)
    dt = torch.bfloat16
    x = torch.randn(8192, 4096, device="cuda", dtype=dt, requires_grad=True)
    specs = [proj(14336, 4096, 16, dt, "cuda", 30, nf4), proj(14336, 4096, 16, dt, "cuda", 31, nf4),
             proj(4096, 14336, 16, dt, "cuda", 32, nf4)]
    check_mlp(x, specs, "silu", dt)


def test_glu_forward_writes_into_a_wider_buffer(device):
    """H straight into the first columns of a widened input (lora_wide.py): same bits, tail untouched."""
    torch.manual_seed(6)
    g, u = torch.randn(13, 203, device=device), torch.randn(13, 203, device=device)
    buf = torch.full((13, 211), 7.0, device=device)
    out = lora_glu.glu_forward(g, u, "silu", out=buf[:, :203])
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:, :203], lora_glu.glu_forward(g, u, "silu")) and (buf[:, 203:] == 7.0).all()
    with pytest.raises(ValueError, match="unit column stride"):
        lora_glu.glu_forward(g, u, "silu", out=buf[:, :202])
    with pytest.raises(ValueError, match="unit column stride"):
        lora_glu.glu_forward(g, u, "silu", out=torch.empty(203, 13, device=device).t())


# --- The rank-r terms inside the GLU pass (glu_forward_rank_) ----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", [(16, 16), (8, 24), (5, 0), (0, 3)], ids=["16-16", "8-24", "gate-only", "up-only"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_rank_terms_in_the_glu_pass(device, dtype, ranks, activation):
    """G ← G + s_g XA_g B_gᵀ and U likewise, in place: the float64 value rounded once (within an ulp,
    plus fp32 summation error); H bitwise glu_forward of the G and U written."""
    n, i = 37, 150
    g = torch.Generator().manual_seed(sum(ranks) + n)
    gb, ub = (torch.randn(n, i, generator=g).to(device, dtype) for _ in range(2))
    xa = torch.randn(n, sum(ranks) + 2, generator=g).to(device, dtype)[:, 1:1 + sum(ranks)]  # a column view
    adapters, col, want, mag = [], 0, [], []
    for r, base, s in zip(ranks, (gb, ub), (0.5, 2.0)):
        if r == 0:
            adapters.append(None)
            want.append(base.double())
            mag.append(base.double().abs())
            continue
        b = torch.randn(i, r, generator=g).to(device, torch.float32)  # PEFT's float32 adapters
        adapters.append((torch.zeros(r, 3), b, s))
        xa_p, b_p = xa[:, col:col + r].double(), b.to(dtype).double()
        want.append(base.double() + s * (xa_p @ b_p.t()))
        mag.append(base.double().abs() + s * (xa_p.abs() @ b_p.abs().t()))  # what fp32 sums round against
        col += r
    g_out, u_out = gb.clone(), ub.clone()
    with pytest.raises(ValueError, match="unit column stride"):
        lora_glu.glu_forward_rank_(g_out, u_out, xa.t().contiguous().t(), adapters, activation)
    h = lora_glu.glu_forward_rank_(g_out, u_out, xa.contiguous(), adapters, activation)
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    for got, w, m, name in ((g_out, want[0], mag[0], "G"), (u_out, want[1], mag[1], "U")):
        err = (got.double() - w).abs() - 2 * ulp * w.abs() - 64 * 2.0 ** -24 * m
        assert (err <= 0).all(), (name, err.max().item())
    assert torch.equal(h, lora_glu.glu_forward(g_out.clone(), u_out.clone(), activation))
    assert not torch.isnan(h).any()
