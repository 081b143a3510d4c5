"""Widened LoRA projection specs and their float64 check, shared by the lora_wide and spare-column tests."""

from __future__ import annotations

import math

import torch

from types import SimpleNamespace

from fasttune.kernels.lora import BaseWeight
from fasttune.kernels.lora_wide import BorderedNf4, WideWeight
from fasttune.kernels.nf4 import dequantize_nf4
from helpers.kernel_checks import check_in_norm


def widened(w: torch.Tensor, extra: int, bias=None) -> BaseWeight:
    buf = torch.zeros(w.shape[0], w.shape[1] + extra, dtype=w.dtype, device=w.device)
    buf[:, : w.shape[1]].copy_(w)
    wide = WideWeight(buf, w.shape[1])
    return BaseWeight(wide.weight_view(), None, bias, wide)


def spec(out_f, in_f, r, dtype, device, seed, extra=None, bias=False):
    """((widened base, A, B, s), dense W, bias): B random, so the rank-r term shows."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype)
    b = (torch.randn(out_f, generator=g) * 0.1).to(device, dtype) if bias else None
    base = widened(w, extra, b) if extra else BaseWeight(w, None, b)
    if r == 0:
        return (base, None, None, 0.0), w, b
    a = (torch.randn(r, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype).requires_grad_()
    bb = (torch.randn(out_f, r, generator=g) / math.sqrt(r)).to(device, dtype).requires_grad_()
    return (base, a, bb, 0.5 + seed % 3 * 0.5), w, b


def nf4_spec(out_f, in_f, r, dtype, device, seed, extra=None, bias=False):
    """As ``spec``, over a random NF4 weight (blocksize 64, nested scales, QuantState in ``dtype``),
    bordered with a tail of ``extra`` when given; the dense W is its dequantised value."""
    g = torch.Generator().manual_seed(seed)
    n = out_f * in_f
    blocks = -(-n // 64)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, generator=g).to(device)
    state2 = SimpleNamespace(absmax=(torch.rand(-(-blocks // 256), generator=g) + 0.5).to(device),
                             code=torch.sort(torch.rand(256, generator=g) * 2 - 1).values.to(device), blocksize=256)
    qs = SimpleNamespace(absmax=torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=g).to(device),
                         shape=torch.Size((out_f, in_f)), dtype=dtype, blocksize=64, quant_type="nf4", nested=True,
                         offset=torch.tensor(1.0 / math.sqrt(in_f), device=device), state2=state2)
    qs.state2.absmax /= math.sqrt(in_f)
    w = dequantize_nf4(packed, qs)
    b = (torch.randn(out_f, generator=g) * 0.1).to(device, dtype) if bias else None
    base = BaseWeight(packed, qs, b, BorderedNf4(packed, qs, extra, dtype) if extra else None)
    if r == 0:
        return (base, None, None, 0.0), w, b
    a = (torch.randn(r, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype).requires_grad_()
    bb = (torch.randn(out_f, r, generator=g) / math.sqrt(r)).to(device, dtype).requires_grad_()
    return (base, a, bb, 0.5 + seed % 3 * 0.5), w, b


def ref_outputs(x, parts, dtype):
    """Each projection X Wᵀ + b + s·X Aᵀ Bᵀ in ``dtype`` (float64 autograd leaves), and the leaves."""
    xl = x.detach().to(dtype).requires_grad_()
    leaves, outs = [xl], []
    for (_, a, b, s), w, bias in parts:
        al = None if a is None else a.detach().to(dtype).requires_grad_()
        bl = None if b is None else b.detach().to(dtype).requires_grad_()
        leaves += [t for t in (al, bl) if t is not None]
        y = xl @ w.to(dtype).t() + (0 if bias is None else bias.to(dtype))
        outs.append(y if a is None else y + s * (xl @ al.t()) @ bl.t())
    return outs, leaves


def assert_close(got, ref64, same, name):
    """fp32 (``same`` None): relative error ≤ 1e-5; else the 2×-torch rule in norm (helpers.kernel_checks)."""
    check_in_norm(got, ref64, same, what=name)


def check(fn, x, parts, dtype):
    outs = fn(x, [p[0] for p in parts])
    outs = outs if isinstance(outs, tuple) else (outs,)
    dys = [torch.randn_like(o) for o in outs]
    params = [x] + [t for (_, a, b, _), _, _ in parts for t in (a, b) if t is not None]
    got = torch.autograd.grad(outs, params, dys)
    want = {}
    for rdt in (torch.float64, dtype) if dtype != torch.float32 else (torch.float64,):
        r_outs, leaves = ref_outputs(x, parts, rdt)
        want[rdt] = (r_outs, torch.autograd.grad(r_outs, leaves, [d.to(rdt) for d in dys]))
    same = want.get(dtype) if dtype != torch.float32 else None
    for i, o in enumerate(outs):
        assert o.dtype == dtype
        assert_close(o, want[torch.float64][0][i], None if same is None else same[0][i], f"output {i}")
    for i, g in enumerate(got):
        assert_close(g, want[torch.float64][1][i], None if same is None else same[1][i], f"grad {i}")
