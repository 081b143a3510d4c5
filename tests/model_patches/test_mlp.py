"""mlp.py: gated MLPs on the SwiGLU/GeGLU kernels; activation resolution, hook, fallbacks."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from fasttune import FastConfig
from fasttune.model_patches.families import FAMILIES
from fasttune.model_patches.mlp import FastMLPForward, check_mlp, config_activation, patch_mlp
from fasttune.model_patches.families import resolve_classes
from fasttune.model_patches.report import PatchReport
from helpers.tiny_models import tiny_model


def _patched_mlp(model_type, config=None, device="cpu", **overrides):
    """(stock MLP, patched copy, report) of layer 0 of a tiny model."""
    model = tiny_model(model_type, seed=1, **overrides).to(device)
    stock = model.model.layers[0].mlp
    holder = nn.ModuleDict({"mlp": copy.deepcopy(stock)})
    spec = FAMILIES[model_type]
    report = PatchReport(model_type)
    patch_mlp(holder, spec, resolve_classes(spec), config or FastConfig(), report)
    return stock, holder["mlp"], report


def _fwd_bwd(mlp, x):
    x = x.detach().clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    y = mlp(x)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]


# silu (llama), gelu_tanh (gemma2), phi3's fused gate_up halves, exact gelu and gelu_new on llama,
# biased projections.
@pytest.mark.parametrize("model_type, overrides, kind", [
    ("llama", {}, "silu"),
    ("gemma2", {}, "gelu_tanh"),
    ("phi3", {}, "silu"),
    ("llama", {"hidden_act": "gelu"}, "gelu"),
    ("llama", {"hidden_act": "gelu_new"}, "gelu_tanh"),
    ("llama", {"mlp_bias": True}, "silu"),
])
def test_kernel_mlp_matches_stock_fp32(model_type, overrides, kind, device):
    stock, fast, report = _patched_mlp(model_type, device=device, **overrides)
    assert report.patched["mlp"] == 1 and fast.forward.activation == kind
    x = torch.randn(2, 5, stock.config.hidden_size, device=device) * 2
    for a, b in zip(_fwd_bwd(fast, x), _fwd_bwd(stock, x)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_hook_mode_is_bit_identical_and_fused_mlp_replaces_everything():
    stock, fast, report = _patched_mlp("phi3", FastConfig(mlp=False))
    assert dict(report.patched) == {"mlp_hook": 1} and fast.forward.activation is None
    x = torch.randn(2, 5, stock.config.hidden_size)
    for a, b in zip(_fwd_bwd(fast, x), _fwd_bwd(stock, x)):
        assert torch.equal(a, b)
    seen = []
    fast.forward.fused_mlp = lambda module, inp: seen.append(module) or inp * 2
    assert torch.equal(fast(x), x * 2) and seen == [fast]


def test_config_activation_takes_the_first_attribute_set():
    spec = FAMILIES["gemma2"]
    assert spec.activation_attrs == ("hidden_activation",)
    cfg = types.SimpleNamespace(hidden_activation=None, hidden_act="silu")
    assert config_activation(cfg, spec) is None
    cfg.hidden_activation = "gelu_pytorch_tanh"
    assert config_activation(cfg, spec) == "gelu_pytorch_tanh"
    assert FAMILIES["gemma"].activation_attrs == ("hidden_act",)  # GemmaMLP reads hidden_act


def test_check_mlp_reasons():
    model = tiny_model("llama", seed=2)
    mlp, spec = model.model.layers[0].mlp, FAMILIES["llama"]
    assert check_mlp(mlp, spec, "silu", use_kernel=True) == (None, "act_fn")
    assert "'relu2' has no kernel" in check_mlp(mlp, spec, "relu2", use_kernel=True)[0]
    assert "disagree" in check_mlp(mlp, spec, "gelu", use_kernel=True)[0]  # act_fn is SiLU
    assert "no activation in config" in check_mlp(mlp, spec, None, use_kernel=True)[0]
    assert check_mlp(mlp, spec, "relu2", use_kernel=False)[0] is None  # hook only: any activation
    assert "float64" in check_mlp(copy.deepcopy(mlp).double(), spec, "silu", use_kernel=True)[0]
    no_up = copy.deepcopy(mlp)
    del no_up.up_proj
    assert "up_proj" in check_mlp(no_up, spec, "silu", use_kernel=True)[0]
    phi3_mlp = tiny_model("phi3", seed=2).model.layers[0].mlp
    assert check_mlp(phi3_mlp, FAMILIES["phi3"], "silu", use_kernel=True) == (None, "activation_fn")


def test_runtime_dtype_guard_takes_the_module_activation():
    stock, fast, _ = _patched_mlp("llama")
    assert isinstance(fast.forward, FastMLPForward)
    stock, fast = stock.double(), fast.double()
    x = torch.randn(3, stock.config.hidden_size, dtype=torch.float64)
    assert torch.equal(fast(x), stock(x))
