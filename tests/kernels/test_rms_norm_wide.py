"""The two-launch RMSNorm backward for rows wider than the register limit, against float64 math."""

import pytest
import torch

import fasttune.kernels.rms_norm as rms_mod
from fasttune.kernels import reference
from fasttune.kernels.rms_norm import rms_norm
from helpers.kernel_checks import check_elementwise

EPS = 1e-6


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_take_the_chunked_backward(casting, dtype, device, monkeypatch):
    # Shrink the limits so H=200 runs the wide path (chunks of 64 columns, a masked tail).
    monkeypatch.setattr(rms_mod, "_MAX_FWD_BLOCK", 64)
    monkeypatch.setattr(rms_mod, "_MAX_BWD_BLOCK", 64)
    monkeypatch.setattr(rms_mod, "_CHUNK", 64)
    calls = []
    real = rms_mod.bwd_wide_rows
    monkeypatch.setattr(rms_mod, "bwd_wide_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 200, generator=g).to(device, dtype)
    w = (torch.randn(200, generator=g) * 0.1 + 1).to(device)
    dy = torch.randn(9, 200, generator=g).to(device, dtype)
    outs = []
    for fn, xd, wd in ((rms_norm, x, w), (reference.rms_norm, x, w), (reference.rms_norm, x.double(), w.double())):
        xl, wl = xd.clone().requires_grad_(), wd.clone().requires_grad_()
        y = fn(xl, wl, EPS, casting=casting)
        dx, dw = torch.autograd.grad(y, (xl, wl), dy.to(y.dtype))
        outs.append((y, dx, dw))
    assert calls, "the wide-row backward did not run"
    got, same, ref64 = outs
    # dw is a column sum of dy·x̂: its rounding error scales with Σ|dy·x̂|, not with |dw|.
    xf = x.double()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    mags = (None, None, (dy.double().abs() * xhat.abs()).sum(0))
    for name, a, s, r, mag in zip(("y", "dx", "dw"), got, same, ref64, mags):
        check_elementwise(a, r, s, what=name, lowp=None if dtype == torch.float32 else dtype, mag=mag)
