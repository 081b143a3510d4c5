"""lora_linear / lora_qkv (hand-written backward) against float64 autograd of reference.py.

Every output and every gradient (x, and A, B of each projection) on fresh random inputs, dense
and NF4 bases (the reference then uses the dequantised weight), non-zero B, GQA widths, partial
adapters, bias. fp32: relative error (Frobenius) ≤ 1e-5. bf16/fp16: error norm ≤ 2 × the error
norm of the same reference run in that dtype + 1e-4 of the result's norm (the errors of a matrix
product are independent per element, so a norm bound is the fair form of the 2× rule).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fasttune.kernels import reference
from fasttune.kernels.lora import BaseWeight, lora_linear, lora_o, lora_qkv
from fasttune.kernels.nf4 import dequantize_nf4

from helpers.kernel_checks import check_in_norm

LOW = (torch.bfloat16, torch.float16)


def nf4_base(out_f, in_f, dtype, device, seed, nested=True, blocksize=64):
    """An NF4 weight from random codes (duck-typed QuantState), scales ~ 1/sqrt(in)."""
    g = torch.Generator().manual_seed(seed)
    n = out_f * in_f
    nb = -(-n // blocksize)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, generator=g).to(device)
    scale = 1.5 / math.sqrt(in_f)
    if nested:
        state2 = SimpleNamespace(code=torch.sort(torch.rand(256, generator=g)).values.to(device),
                                 absmax=(torch.rand(-(-nb // 256), generator=g) * scale + scale).to(device),
                                 blocksize=256)
        qs = SimpleNamespace(absmax=torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g).to(device),
                             shape=torch.Size((out_f, in_f)), dtype=dtype, blocksize=blocksize, quant_type="nf4",
                             nested=True, offset=torch.tensor(0.1 * scale, device=device), state2=state2)
    else:
        qs = SimpleNamespace(absmax=(torch.rand(nb, generator=g) * scale + 0.5 * scale).to(device),
                             shape=torch.Size((out_f, in_f)), dtype=dtype, blocksize=blocksize, quant_type="nf4",
                             nested=False, offset=None, state2=None)
    return packed, qs


def make_proj(out_f, in_f, r, dtype, device, seed, kind="dense", adapter_dtype=None, bias=False):
    """(base, A, B, s) with trainable A, B; base dense, NF4 pair, or BaseWeight with bias."""
    g = torch.Generator().manual_seed(seed)
    if kind == "nf4":
        base = nf4_base(out_f, in_f, dtype, device, seed)
    else:
        base = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype)
    if bias:
        b = (torch.randn(out_f, generator=g) * 0.1).to(device, dtype)
        base = BaseWeight(*(base if kind == "nf4" else (base, None)), bias=b)
    if r == 0:
        return base, None, None, 0.0
    adt = adapter_dtype or dtype
    a = (torch.randn(r, in_f, generator=g) / math.sqrt(in_f)).to(device, adt).requires_grad_()
    bb = (torch.randn(out_f, r, generator=g) / math.sqrt(r)).to(device, adt).requires_grad_()
    return base, a, bb, 1.5 + seed % 3 * 0.25


def dense_of(base, dtype):
    """(W, bias) of a spec's base in ``dtype``, NF4 dequantised as the kernel does."""
    base = BaseWeight.of(base)
    w = dequantize_nf4(base.weight, base.quant_state) if base.is_nf4 else base.weight
    return w.detach().to(dtype), None if base.bias is None else base.bias.to(dtype)


def leaf(t, dtype):
    return None if t is None else t.detach().to(dtype).requires_grad_()


def ref_run(fn, x, specs, grads, dtype, adapter_cast=True):
    """Run ``fn(x, *specs)`` (reference.py) on ``dtype`` copies; returns (outputs, grads of x, A, B...)."""
    xl = leaf(x, dtype)
    leaves, ref_specs = [xl], []
    for base, a, b, s in specs:
        w, bias = dense_of(base, dtype)
        al, bl = leaf(a, dtype if adapter_cast else a.dtype), leaf(b, dtype if adapter_cast else b.dtype)
        leaves += [t for t in (al, bl) if t is not None]
        ref_specs.append((w, al, bl, s, bias))
    outs = fn(xl, ref_specs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gs = torch.autograd.grad(outs, leaves, [g.to(dtype) for g in grads])
    return outs, gs


def ref_qkv(x, specs):
    """reference.lora_qkv, per projection through reference.lora_linear when it has a bias."""
    return tuple(x @ w.t() + (0 if bias is None else bias) if a is None else reference.lora_linear(x, w, a, b, s, bias)
                 for w, a, b, s, bias in specs)


def assert_close(got, ref64, same=None, name=""):
    """fp32: rel. error ≤ 1e-5; low precision: ≤ 2·(error of the same-dtype reference) + 1e-4·|ref|."""
    check_in_norm(got, ref64, same, what=name, rtol=1e-5, atol=1e-4)


def check_against_reference(fn_kernel, fn_ref, x, specs, dtype):
    outs = fn_kernel(x, specs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads_in = [torch.randn_like(o) for o in outs]
    params = [x] + [t for _, a, b, _ in specs for t in (a, b) if t is not None]
    got = torch.autograd.grad(outs, params, grads_in)
    ref_outs, ref_grads = ref_run(fn_ref, x, specs, grads_in, torch.float64)
    same_outs = same_grads = [None] * 99
    if dtype in LOW:
        same_outs, same_grads = ref_run(fn_ref, x, specs, grads_in, dtype)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == dtype
        assert_close(o, r, same_outs[i], f"output {i}")
    for i, (g, r) in enumerate(zip(got, ref_grads)):
        assert g.dtype == params[i].dtype
        assert_close(g, r, same_grads[i], f"grad {i}")


def _linear_kernel(x, specs):
    return lora_linear(x, *specs[0])


def _linear_ref(x, specs):
    w, a, b, s, bias = specs[0]
    return reference.lora_linear(x, w, a, b, s, bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["dense", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear(device, dtype, kind, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 37, 96, device=device, dtype=dtype, requires_grad=True)
    spec = make_proj(80, 96, 8, dtype, device, seed=1, kind=kind, bias=bias)
    check_against_reference(_linear_kernel, _linear_ref, x, [spec], dtype)


def test_lora_linear_fp16_odd_widths(device):
    torch.manual_seed(1)
    x = torch.randn(41, 75, device=device, dtype=torch.float16, requires_grad=True)
    spec = make_proj(53, 75, 5, torch.float16, device, seed=2)
    check_against_reference(_linear_kernel, _linear_ref, x, [spec], torch.float16)


def test_lora_linear_float32_adapters_on_bf16(device):
    """PEFT upcasts adapters to fp32: used in bf16 (as autocast would), grads come back fp32."""
    torch.manual_seed(2)
    x = torch.randn(50, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    spec = make_proj(48, 64, 8, torch.bfloat16, device, seed=3, kind="nf4", adapter_dtype=torch.float32)
    check_against_reference(_linear_kernel, _linear_ref, x, [spec], torch.bfloat16)


def test_lora_linear_without_adapter_and_input_grad(device):
    torch.manual_seed(3)
    x = torch.randn(20, 64, device=device, requires_grad=True)
    base, _, _, _ = make_proj(32, 64, 0, torch.float32, device, seed=4, kind="nf4")
    y = lora_linear(x, base, None, None, 0.0)
    w, _ = dense_of(base, torch.float32)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert_close(y, x.double() @ w.double().t())
    assert_close(gx, torch.ones(20, 32, dtype=torch.float64, device=device) @ w.double())
    # x frozen: only the adapter gets gradients (the base is not even dequantised for dX).
    x = x.detach()
    base, a, b, s = make_proj(32, 64, 4, torch.float32, device, seed=5)
    da, db = torch.autograd.grad(lora_o(x, base, a, b, s).square().sum(), (a, b))
    a64, b64 = leaf(a, torch.float64), leaf(b, torch.float64)
    ra, rb = torch.autograd.grad(reference.lora_linear(x.double(), base.double(), a64, b64, s).square().sum(), (a64, b64))
    assert_close(da, ra)
    assert_close(db, rb)


def _qkv_kernel(x, specs):
    return lora_qkv(x, *specs)


@pytest.mark.parametrize("kind", ["dense", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_qkv_gqa_partial_adapters(device, dtype, kind):
    """q 96 wide, k/v 48 (GQA); adapters on q and v only, different ranks; k has a bias."""
    torch.manual_seed(4)
    x = torch.randn(2, 29, 72, device=device, dtype=dtype, requires_grad=True)
    specs = [make_proj(96, 72, 8, dtype, device, seed=6, kind=kind),
             make_proj(48, 72, 0, dtype, device, seed=7, kind=kind, bias=True),
             make_proj(48, 72, 4, dtype, device, seed=8, kind=kind)]
    check_against_reference(_qkv_kernel, ref_qkv, x, specs, dtype)


def test_lora_qkv_all_adapters_with_bias_fp32(device):
    torch.manual_seed(5)
    x = torch.randn(33, 64, device=device, requires_grad=True)
    specs = [make_proj(o, 64, r, torch.float32, device, seed=9 + i, bias=True)
             for i, (o, r) in enumerate(((64, 8), (32, 8), (32, 16)))]
    check_against_reference(_qkv_kernel, ref_qkv, x, specs, torch.float32)
    # Matches reference.lora_qkv itself where it applies (no bias).
    specs = [make_proj(o, 64, r, torch.float32, device, seed=12 + i) for i, (o, r) in enumerate(((64, 8), (32, 0), (32, 4)))]
    ref = reference.lora_qkv(x, *[(BaseWeight.of(b).weight, a, bb, s) for b, a, bb, s in specs])
    for got, r in zip(lora_qkv(x, *specs), ref):
        assert_close(got, r.double())


def test_autocast_casts_input(device):
    """Under torch.autocast, fp32 x and fp32 dense weights are computed in the autocast dtype."""
    torch.manual_seed(6)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    base, a, b, s = make_proj(40, 64, 8, torch.float32, device, seed=15)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = lora_linear(x, base, a, b, s)
    assert y.dtype == torch.bfloat16
    expected = reference.lora_linear(x.bfloat16(), base.bfloat16(), a.bfloat16(), b.bfloat16(), s)
    assert torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2)
    gx, ga = torch.autograd.grad(y.float().sum(), (x, a))
    assert gx.dtype == torch.float32 and ga.dtype == torch.float32


def _saved_storages(fn) -> list[int]:
    """Element counts of the distinct storages ``fn``'s autograd graph saves (memory, not references)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sorted(saved.values())


def test_saved_tensors_are_x_and_xa_only(device):
    """Backward keeps X and XA (r columns), not Y and not the dequantised weight; A and B in the
    compute dtype are the adapters themselves (no copy)."""
    x = torch.randn(64, 96, device=device, dtype=torch.bfloat16, requires_grad=True)
    base, a, b, s = make_proj(128, 96, 8, torch.bfloat16, device, seed=16, kind="nf4")
    saved = _saved_storages(lambda: lora_linear(x, base, a, b, s))
    assert saved == sorted([64 * 96, 64 * 8, a.numel(), b.numel()])


@pytest.mark.parametrize("kind", ["dense", "nf4"])
def test_backward_reuses_the_forward_adapter_casts(device, kind, monkeypatch):
    """float32 adapters under bf16 autocast: forward casts A and B to bf16 once each and saves the
    casts; backward casts no adapter again (it casts only the gradients back to float32)."""
    x = torch.randn(40, 96, device=device, dtype=torch.bfloat16, requires_grad=True)
    specs = [make_proj(o, 96, r, torch.bfloat16, device, seed=30 + o, kind=kind, adapter_dtype=torch.float32)
             for o, r in ((96, 8), (32, 4), (32, 4))]
    adapters = {id(t) for _, a, b, _ in specs for t in (a, b)}
    casts = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: casts.append(id(self) in adapters) or
                        real_to(self, *a, **k))
    with torch.autocast(device, dtype=torch.bfloat16):
        q, k, v = lora_qkv(x, *specs)
    forward_casts = sum(casts)
    casts.clear()
    torch.autograd.backward((q, k, v), (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)))
    assert forward_casts == 6 and sum(casts) == 0
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for _, a, b, _ in specs for t in (a, b))


def test_invalid_inputs_raise(device):
    x = torch.randn(8, 64, device=device)
    base, a, b, s = make_proj(32, 64, 4, torch.float32, device, seed=17)
    with pytest.raises(TypeError, match="base weight is"):
        lora_linear(x, base.bfloat16(), None, None, 0.0)
    with pytest.raises(ValueError, match="64 features|expects"):
        lora_linear(torch.randn(8, 60, device=device), base, a, b, s)
    with pytest.raises(ValueError, match="rank mismatch"):
        lora_linear(x, base, a, b[:, :3], s)
    with pytest.raises(ValueError, match="lora_b is"):
        lora_linear(x, base, a, b[:16], s)
    with pytest.raises(ValueError, match="both"):
        lora_linear(x, base, a, None, s)
    with pytest.raises(TypeError, match="float32"):
        lora_linear(x, base, a.detach().half(), b.detach().half(), s)
    with pytest.raises(ValueError, match="requires grad"):
        lora_linear(x, base.clone().requires_grad_(), a, b, s)
    with pytest.raises(TypeError, match="scaling"):
        lora_linear(x, base, a, b, torch.tensor(2.0))
    with pytest.raises(TypeError, match="x must be"):
        lora_linear(x.double(), base, a, b, s)
    with pytest.raises(TypeError, match="q must be"):
        lora_qkv(x, (base, a, b), (base, None, None, 0.0), (base, None, None, 0.0))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "nf4"])
def test_qkv_and_o_llama8b_on_gpu(kind):
    """Llama-3-8B attention projections, 8192 tokens, r=16, bf16, against float64."""
    torch.manual_seed(7)
    dt = torch.bfloat16
    x = torch.randn(8192, 4096, device="cuda", dtype=dt, requires_grad=True)
    specs = [make_proj(o, 4096, 16, dt, "cuda", seed=20 + i, kind=kind) for i, o in enumerate((4096, 1024, 1024))]
    check_against_reference(_qkv_kernel, ref_qkv, x, specs, dt)
    check_against_reference(_linear_kernel, _linear_ref, x, [make_proj(4096, 4096, 16, dt, "cuda", 30, kind)], dt)
