"""norm.py: RMSNorm modules on the kernel compute what the stock module computes; misfits stay stock."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fasttune import FastConfig
from fasttune.model_patches.families import FAMILIES
from fasttune.model_patches.norm import FastRMSNormForward, check_norm, patch_norms
from fasttune.model_patches.families import resolve_classes
from fasttune.model_patches.report import PatchReport

# One family per casting/offset variant: llama (llama casting), gemma (offset 1, fp32 math), olmo2
# (fp32 math, offset 0).
VARIANTS = ("llama", "gemma", "olmo2")


class _Holder(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm


def _norm(model_type: str, width: int = 136, dtype=torch.float32, seed: int = 0):
    spec = FAMILIES[model_type]
    cls = resolve_classes(spec)["norm_class"]
    torch.manual_seed(seed)
    norm = cls(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3).add_(0.0 if spec.norm_offset else 1.0)
    return spec, norm.to(dtype)


def _patched(model_type, norm):
    spec = FAMILIES[model_type]
    holder = _Holder(copy.deepcopy(norm))
    report = PatchReport(model_type)
    patch_norms(holder, spec, resolve_classes(spec), FastConfig(), report)
    return holder.norm, report


def _fwd_bwd(norm, x, dy):
    x = x.detach().clone().requires_grad_(True)
    norm.zero_grad(set_to_none=True)
    y = norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("model_type", VARIANTS)
def test_forward_and_gradients_match_stock_fp32(model_type, device):
    _, stock = _norm(model_type)
    fast, report = _patched(model_type, stock)
    assert report.patched["rms_norm"] == 1 and isinstance(fast.forward, FastRMSNormForward)
    stock, fast = stock.to(device), fast.to(device)
    x = torch.randn(3, 7, 136, device=device) * 3
    dy = torch.randn(3, 7, 136, device=device)
    for a, b in zip(_fwd_bwd(fast, x, dy), _fwd_bwd(stock, x, dy)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", VARIANTS)
def test_bf16_within_twice_the_stock_error(model_type, device):
    _, stock = _norm(model_type, dtype=torch.bfloat16, seed=1)
    fast, _ = _patched(model_type, stock)
    ref = copy.deepcopy(stock).double()
    stock, fast, ref = stock.to(device), fast.to(device), ref.to(device)
    x = (torch.randn(5, 136, device=device) * 2).bfloat16()
    dy = torch.randn(5, 136, device=device).bfloat16()
    exact = _fwd_bwd(ref, x.double(), dy.double())
    for name, a, b, r in zip(("y", "dx", "dw"), _fwd_bwd(fast, x, dy), _fwd_bwd(stock, x, dy), exact):
        err_fast, err_stock = (a.double() - r).abs().max(), (b.double() - r).abs().max()
        # 2 bf16 ulps of the largest value: the interpreter truncates fp32→bf16 instead of rounding.
        assert err_fast <= 2 * err_stock + 2 * 2**-8 * r.abs().max(), (name, err_fast, err_stock)


def test_keyword_calls_odd_inputs_and_undo():
    _, stock = _norm("llama")
    fast, report = _patched("llama", stock)
    x = torch.randn(4, 6, 136)
    assert torch.allclose(fast(hidden_states=x), stock(x), rtol=1e-5, atol=1e-6)
    xt = torch.randn(136, 6).t()  # non-contiguous rows
    assert torch.allclose(fast(xt), stock(xt), rtol=1e-5, atol=1e-6)
    x64 = x.double()  # no float64 kernel: the stock math, bit for bit
    assert torch.equal(fast(x64), stock(x64))
    report.undo()
    assert "forward" not in fast.__dict__


def test_check_norm_reasons():
    spec, norm = _norm("llama")
    assert check_norm(norm, spec) is None
    no_eps = copy.deepcopy(norm)
    del no_eps.variance_epsilon
    assert "epsilon" in check_norm(no_eps, spec)
    matrix = copy.deepcopy(norm)
    matrix.weight = nn.Parameter(torch.ones(4, 136))
    assert "1-D" in check_norm(matrix, spec)
    assert "float64" in check_norm(copy.deepcopy(norm).double(), spec)

    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x, residual):
            return x + residual

    assert "other arguments" in check_norm(TwoArgs(), spec)


def test_missing_class_is_reported():
    spec = FAMILIES["llama"]
    report = PatchReport("llama")
    patch_norms(_Holder(nn.Identity()), spec, {}, FastConfig(), report)
    assert not report.patched and "LlamaRMSNorm not found" in report.fallbacks[0].reason
