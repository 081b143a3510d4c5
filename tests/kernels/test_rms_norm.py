"""RMSNorm / fused add+RMSNorm kernels vs float64 math and the same-dtype reference, every gradient.

fp32 inputs: within 1e-5 relative (plus 1e-6 of the tensor's scale). bf16/fp16 inputs:
|kernel − ref64| ≤ 2·|torch_same_dtype − ref64| + 1 ulp, elementwise (the ulp covers the
interpreter's truncating fp32→bf16 casts and single-rounding ties where torch happens to be exact).
"""

import pytest
import torch

import fasttune.kernels.rms_norm as rms_mod
from fasttune.kernels import reference
from fasttune.kernels.rms_norm import rms_norm, rms_norm_add, rms_norm_keep

from helpers.kernel_checks import check_elementwise

EPS = 1e-6


def check(out, ref64, same, lowp, name, ulps=1, mag=None):
    """fp32 inputs (lowp None): within 1e-5 relative. Low precision: |out − ref64| ≤
    2·|same − ref64| + ulps·eps(lowp)·mag, mag = |ref64| by default (one ulp per rounding the
    function itself does; the interpreter truncates, so each can cost a full ulp)."""
    check_elementwise(out, ref64, same, what=name, lowp=lowp, rtol=1e-5, ulps=ulps, mag=mag)


def run_norm(fn, x, weight, dy, residual=None, ds=None, **kw):
    """Outputs of fn, then the grads of x, (residual,) weight: None where not requiring grad."""
    if residual is None:
        outs, grads_out, ins = (fn(x, weight, EPS, **kw),), (dy,), (x, weight)
    else:
        outs, grads_out, ins = fn(x, residual, weight, EPS, **kw), (dy, ds), (x, residual, weight)
    pairs = [(o, g) for o, g in zip(outs, grads_out) if g is not None]
    need = [t for t in ins if t.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], need, [g.to(o.dtype) for o, g in pairs],
                                   allow_unused=True, materialize_grads=True))
    return list(outs) + [next(got) if t.requires_grad else None for t in ins]


def f64(t, requires_grad=None):
    if t is None:
        return None
    return t.detach().double().requires_grad_(t.requires_grad if requires_grad is None else requires_grad)


def compare(x, weight, dy, residual=None, ds=None, **kw):
    """Kernel vs same-dtype reference vs float64 math: outputs and every gradient.

    For rms_norm_add the float64 norm is taken of the kernel's returned sum s (itself checked
    against x + residual in float64): s is rounded to x's dtype by contract and the norm is the
    norm of that s (HF's residual stream), so that rounding is not an error of the norm.
    """
    fn, ref = (rms_norm, reference.rms_norm) if residual is None else (rms_norm_add, reference.rms_norm_add)
    lowp = next((t.dtype for t in (x, weight) if t.dtype != torch.float32), None)
    got = run_norm(fn, x, weight, dy, residual, ds, **kw)
    # The output gradients as the kernel saw them (rounded to the outputs' dtypes) for every run.
    dy = dy.to(got[0].dtype) if dy is not None else None
    ds = ds.to(got[1].dtype) if ds is not None else None
    same = run_norm(ref, x, weight, dy, residual, ds, **kw)
    if residual is None:
        ref64 = run_norm(ref, f64(x), f64(weight), f64(dy), **kw)
        norm_in, names = x, ["y", "dx", "dw"]
    else:
        s = got[1].detach()  # checked against x + residual in float64 below
        need = x.requires_grad or residual.requires_grad
        y64, ds_norm, dw64 = run_norm(reference.rms_norm, f64(s, need), f64(weight), f64(dy), **kw)
        dsum = None if ds_norm is None else ds_norm + (f64(ds) if ds is not None else 0)
        s64 = f64(x) + f64(residual)
        ref64 = [y64, s64, dsum if x.requires_grad else None, dsum if residual.requires_grad else None, dw64]
        norm_in, names = s, ["y", "s", "dx", "dres", "dw"]
    # dw is a column sum of dy·x̂ (x̂ rounded to x's dtype for llama, like torch): its rounding
    # error scales with Σ|dy·x̂|, not with |dw|.
    xf = norm_in.detach().double()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    dw_mag = (f64(dy).abs() * xhat.abs()).reshape(-1, xf.shape[-1]).sum(0) if dy is not None else None
    llama = kw.get("casting", "llama") == "llama"
    for name, a, s_, r in zip(names, got, same, ref64):
        assert (a is None) == (r is None), name
        if a is not None:
            check(a, r, s_, lowp, name, ulps=2 if name == "y" and llama else 1,
                  mag=dw_mag if name == "dw" else None)
    return got


def inputs(shape, dtype, wdtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 0.8).to(device=device, dtype=wdtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device=device)
    return x, w, dy


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,wdtype", DTYPES, ids=["f32", "bf16", "f16", "bf16_w32"])
def test_rms_norm(device, casting, offset, dtype, wdtype):
    x, w, dy = inputs((37, 200), dtype, wdtype, device)
    y = compare(x, w, dy, offset=offset, casting=casting)[0]
    expected = torch.promote_types(dtype, wdtype) if casting == "llama" else dtype
    assert y.dtype == expected


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype,wdtype", DTYPES[:2] + DTYPES[3:], ids=["f32", "bf16", "bf16_w32"])
def test_rms_norm_add(device, casting, dtype, wdtype):
    x, w, dy = inputs((3, 13, 200), dtype, wdtype, device)
    res, _, ds = inputs((3, 13, 200), dtype, wdtype, device, seed=1)
    got = compare(x, w, dy, residual=res, ds=ds, offset=1.0 if casting == "gemma" else 0.0, casting=casting)
    assert got[1].dtype == dtype


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype,wdtype", DTYPES[:2] + DTYPES[3:], ids=["f32", "bf16", "bf16_w32"])
def test_rms_norm_keep(device, casting, dtype, wdtype):
    """(norm(x), x): the passed-through x's gradient is added in the norm's backward pass, against
    the same-dtype reference (norm, then autograd's add) and float64."""
    x, w, dy = inputs((3, 13, 200), dtype, wdtype, device)
    dt = inputs((3, 13, 200), dtype, wdtype, device, seed=1)[2].to(dtype)
    kw = dict(offset=1.0 if casting == "gemma" else 0.0, casting=casting)
    y, kept = rms_norm_keep(x, w, EPS, **kw)
    assert torch.equal(kept, x) and kept.data_ptr() == x.data_ptr()
    dy = dy.to(y.dtype)
    got = torch.autograd.grad((y, kept), (x, w), (dy, dt))

    def ref(x, w, dy, dt):
        yr = reference.rms_norm(x, w, EPS, **kw)
        return (yr, *torch.autograd.grad((yr, x), (x, w), (dy, dt)))

    same = ref(x, w, dy, dt)
    ref64 = ref(f64(x), f64(w), f64(dy), f64(dt))
    lowp = dtype if dtype != torch.float32 else None
    xf = x.detach().double()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    dw_mag = (f64(dy).abs() * xhat.abs()).reshape(-1, 200).sum(0)
    for name, a, s_, r in zip(["y", "dx", "dw"], (y, *got), same, ref64):
        check(a, r, s_, lowp, name, ulps=2 if name == "y" and casting == "llama" else 1,
              mag=dw_mag if name == "dw" else None)


def test_rms_norm_keep_without_the_through_gradient(device):
    """Only the normed output used: the gradient is the plain norm's (and the other way round: x's own)."""
    x, w, dy = inputs((37, 67), torch.float32, torch.float32, device)
    y, kept = rms_norm_keep(x, w, EPS)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y, (x, w), dy, retain_graph=True),
                                                 torch.autograd.grad(rms_norm(x, w, EPS), (x, w), dy)))
    dx, dw = torch.autograd.grad(kept, (x, w), dy, allow_unused=True, materialize_grads=True)
    assert torch.equal(dx, dy) and not dw.any()


@pytest.mark.parametrize("used", ["normed", "sum"])
def test_rms_norm_add_one_output_used(device, used):
    x, w, dy = inputs((37, 67), torch.float32, torch.float32, device)
    res, _, ds = inputs((37, 67), torch.float32, torch.float32, device, seed=1)
    if used == "normed":
        compare(x, w, dy, residual=res, ds=None)
    else:
        got = compare(x, w, None, residual=res, ds=ds)
        assert torch.equal(got[-1], torch.zeros_like(w))


def test_frozen_weight_and_frozen_input(device):
    x, w, dy = inputs((37, 200), torch.bfloat16, torch.bfloat16, device)
    got = compare(x, w.detach(), dy)
    assert got[-1] is None and got[1] is not None
    got = compare(x.detach(), w, dy, offset=1.0, casting="gemma")
    assert got[1] is None and got[-1] is not None


def test_noncontiguous_inputs(device):
    base, w, _ = inputs((37, 262), torch.float32, torch.float32, device)
    w = w.detach()[:131].requires_grad_()
    rows = base[:, 5:136]  # rows 262 apart: read in place
    dy = torch.randn(131, 37, device=device).t()  # strided gradient
    assert rows.stride() == (262, 1) and dy.stride(-1) != 1
    compare(rows, w, dy)
    xt = torch.randn(131, 37, device=device).t().requires_grad_()  # last dim strided: copied
    res = torch.randn(131, 37, device=device).t().requires_grad_()
    compare(xt, w, dy, casting="gemma")
    compare(xt, w, dy, residual=res, ds=dy.contiguous())


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_wide_rows_chunked_path(device, casting, monkeypatch):
    # Shrink the register limits so H=200 takes the looped forward and the two-step backward.
    monkeypatch.setattr(rms_mod, "_MAX_FWD_BLOCK", 64)
    monkeypatch.setattr(rms_mod, "_MAX_BWD_BLOCK", 64)
    monkeypatch.setattr(rms_mod, "_CHUNK", 64)
    x, w, dy = inputs((11, 200), torch.bfloat16, torch.float32, device)
    compare(x, w, dy, offset=1.0, casting=casting)
    res, _, ds = inputs((11, 200), torch.bfloat16, torch.float32, device, seed=2)
    compare(x, w, dy, residual=res, ds=ds, casting=casting)
    compare(x.float(), w.detach(), dy, residual=res.float(), ds=ds, casting=casting)


def test_empty_rows(device):
    x = torch.zeros(0, 96, device=device, requires_grad=True)
    w = torch.ones(96, device=device, requires_grad=True)
    y = rms_norm(x, w, EPS)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert y.shape == (0, 96) and dx.shape == (0, 96) and torch.equal(dw, torch.zeros(96, device=device))


def test_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(TypeError, match="x must be"):
        rms_norm(x.double(), w, EPS)
    with pytest.raises(TypeError, match="weight must be"):
        rms_norm(x, w.to(torch.int32), EPS)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7, device=device), EPS)
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, w, EPS, casting="olmo")
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm_add(x, x[:2], w, EPS)
    with pytest.raises(TypeError, match="residual dtype"):
        rms_norm_add(x, x.half(), w, EPS)
    with pytest.raises(ValueError, match="one device"):
        rms_norm(x, torch.ones(8, device="meta"), EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm_8b_shape(casting):
    x, w, dy = inputs((16384, 4096), torch.bfloat16, torch.bfloat16, "cuda")
    compare(x, w, dy, casting=casting, offset=1.0 if casting == "gemma" else 0.0)
    res, _, ds = inputs((16384, 4096), torch.bfloat16, torch.bfloat16, "cuda", seed=1)
    compare(x, w, dy, residual=res, ds=ds, casting=casting)


@pytest.mark.gpu
def test_rms_norm_wide_row_gpu():
    x, w, dy = inputs((1024, 20000), torch.bfloat16, torch.float32, "cuda")  # chunked path
    compare(x, w, dy)
