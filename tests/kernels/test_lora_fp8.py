"""Fused LoRA (lora_linear, lora_qkv, lora_mlp) over FP8 base weights (kernels/fp8.py).

The oracle is float64 math from the same codes: Y = diag(s_X) Q_X Q_Wᵀ diag(s_W) (+ b)
+ s·(X Aᵀ) Bᵀ, dX = Σ_p diag(s_G) Q_G Q_W + dYB A with G = dY diag(s_W), and the adapters'
gradients exactly as in the 16-bit path (they never touch W). fp32: relative error ≤ 1e-5;
bf16: ≤ 1e-2 (the kernels round the base product to bf16 before the rank-r term). The gated
MLP is checked against the composition of the checked pieces. A fresh adapter (B = 0) gives
bitwise the FP8 base layer's own output (``fp8_linear``), as DPO's reference pass needs.
"""

from __future__ import annotations

import math

import pytest
import torch

from fasttune.kernels import reference
from fasttune.kernels.fp8 import Fp8Weight, fp8_linear
from fasttune.kernels.lora import BaseWeight, lora_linear, lora_qkv
from fasttune.kernels.lora_glu import lora_mlp


def fp8_proj(out_f, in_f, r, dtype, device, seed, bias=False, fp8=True):
    """(BaseWeight over FP8 codes of a random weight, A, B, s); A, B trainable (None when r = 0)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype)
    b = (torch.randn(out_f, generator=g) * 0.1).to(device, dtype) if bias else None
    if fp8:
        fw = Fp8Weight.quantize(w)
        base = BaseWeight(fw.codes, bias=b, fp8_scale=fw.scale)
    else:
        base = BaseWeight(w, bias=b)
    if r == 0:
        return base, None, None, 0.0
    a = (torch.randn(r, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype).requires_grad_()
    bb = (torch.randn(out_f, r, generator=g) / math.sqrt(r)).to(device, dtype).requires_grad_()
    return base, a, bb, 1.25 + seed % 3 * 0.25


def oracle(x, specs, dys):
    """(outputs, dX, [(dA, dB)]) in float64 (module docstring)."""
    in_f = x.shape[-1]
    x2 = x.detach().reshape(-1, in_f)
    xq, xs = reference.quantize_rows_fp8(x2)
    X, Xd = x2.double(), xq.double() * xs.double()[:, None]
    outs, dx, adapter_grads = [], torch.zeros_like(X), []
    for (base, a, b, s), dy in zip(specs, dys):
        dy2 = dy.reshape(-1, base.shape[0])
        if base.is_fp8:
            codes, sw = base.fp8.fp8.double(), base.fp8.scale.double()
            y = Xd @ (codes * sw[:, None]).t()
            gq, gs = reference.quantize_rows_fp8(dy2, base.fp8.scale)
            dx += (gq.double() * gs.double()[:, None]) @ codes
        else:
            y = X @ base.weight.double().t()
            dx += dy2.double() @ base.weight.double()
        if base.bias is not None:
            y = y + base.bias.double()
        if a is not None:
            A, B = a.detach().double(), b.detach().double()
            xa = X @ A.t()
            y = y + s * xa @ B.t()
            dyb = s * dy2.double() @ B
            dx += dyb @ A
            adapter_grads.append((dyb.t() @ X, s * dy2.double().t() @ xa))
        outs.append(y)
    return outs, dx, adapter_grads


def _check(got, want, dtype, what):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = ((got.double().reshape(want.shape) - want).norm() / want.norm()).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _run(fn, x, specs, dtype):
    outs = fn(x, specs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    dys = [torch.randn_like(o) for o in outs]
    params = [x] + [t for _, a, b, _ in specs for t in (a, b) if t is not None]
    got = torch.autograd.grad(outs, params, dys)
    ref_outs, ref_dx, ref_ab = oracle(x, specs, dys)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == dtype
        _check(o, r, dtype, f"output {i}")
    _check(got[0], ref_dx, dtype, "dX")
    for i, (g, r) in enumerate(zip(got[1:], [t for pair in ref_ab for t in pair])):
        _check(g, r, dtype, f"adapter grad {i}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_over_fp8(device, dtype, bias):
    torch.manual_seed(0)
    x = torch.randn(2, 29, 72, device=device, dtype=dtype, requires_grad=True)
    spec = fp8_proj(40, 72, 8, dtype, device, seed=1, bias=bias)
    _run(lambda x_, s: lora_linear(x_, *s[0]), x, [spec], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_qkv_over_fp8_gqa_partial_and_mixed(device, dtype):
    """q 96 wide (FP8), k 48 (dense, bias, no adapter), v 48 (FP8): one X quantisation serves both."""
    torch.manual_seed(1)
    x = torch.randn(31, 64, device=device, dtype=dtype, requires_grad=True)
    specs = [fp8_proj(96, 64, 8, dtype, device, seed=2), fp8_proj(48, 64, 0, dtype, device, seed=3, bias=True,
                                                                  fp8=False),
             fp8_proj(48, 64, 4, dtype, device, seed=4)]
    _run(lambda x_, s: lora_qkv(x_, *s), x, specs, dtype)


def test_fresh_adapter_is_bitwise_the_fp8_base_layer(device):
    """B = 0: the fused output equals fp8_linear(x) (the base layer's FP8 forward) bit for bit."""
    x = torch.randn(19, 64, device=device, dtype=torch.bfloat16)
    specs = [fp8_proj(o, 64, 4, torch.bfloat16, device, seed=5 + i, bias=i == 1) for i, o in enumerate((64, 32, 32))]
    for _, _, b, _ in specs:
        with torch.no_grad():
            b.zero_()
    outs = lora_qkv(x, *specs)
    for out, (base, *_rest) in zip(outs, specs):
        assert torch.equal(out, fp8_linear(x, base.fp8, base.bias))
    assert torch.equal(lora_linear(x, *specs[1]), fp8_linear(x, specs[1][0].fp8, specs[1][0].bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mlp_over_fp8_equals_its_composition(device, dtype):
    """lora_mlp over FP8 gate/up/down against lora_linear (checked above) → SwiGLU → lora_linear."""
    torch.manual_seed(2)
    x = torch.randn(23, 64, device=device, dtype=dtype, requires_grad=True)
    gate, up = fp8_proj(128, 64, 8, dtype, device, seed=8), fp8_proj(128, 64, 8, dtype, device, seed=9)
    down = fp8_proj(64, 128, 8, dtype, device, seed=10)
    params = [x] + [t for p in (gate, up, down) for t in p[1:3]]
    y = lora_mlp(x, gate, up, down, activation="silu")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, params, dy)
    h = reference.swiglu(lora_linear(x, *gate), lora_linear(x, *up)).to(dtype)
    y_ref = lora_linear(h, *down)
    want = torch.autograd.grad(y_ref, params, dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (g, w) in enumerate(zip((y, *got), (y_ref, *want))):
        err = ((g.double() - w.double()).norm() / w.double().norm()).item()
        assert err <= tol, f"tensor {i}: relative error {err:.3g}"
