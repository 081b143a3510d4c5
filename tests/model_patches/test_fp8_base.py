"""fp8_base.py: a frozen linear layer converted to FP8 storage, with a forward of its own.

Dense nn.Linear (fp32 and bf16, with bias) and bitsandbytes NF4 Linear4bit (dequantised once);
the layer's forward is ``fp8_linear`` on its codes, counted in the report; what cannot be
converted says why; a converted layer is adopted, not converted twice; deep copies work.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fasttune.kernels.fp8 import Fp8Weight, fp8_linear
from fasttune.kernels.lora import BaseWeight
from fasttune.model_patches.fp8_base import (FP8_SOURCE_ATTR, SCALE_NAME, Fp8LinearForward, fp8_weight_of,
                                             is_fp8_layer, to_fp8)
from fasttune.model_patches.report import PatchReport


class Owner(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.proj = layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_is_converted_in_place(device, dtype):
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=True).to(device, dtype).requires_grad_(False)
    expected = Fp8Weight.quantize(layer.weight)
    owner, report = Owner(layer), PatchReport()
    out = to_fp8(owner, "proj", "fp8_proj", report, "org/model")
    assert out is layer and owner.proj is layer and is_fp8_layer(layer)
    assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
    assert torch.equal(layer.weight, expected.codes) and torch.equal(fp8_weight_of(layer).scale, expected.scale)
    assert SCALE_NAME not in layer.state_dict() and layer.__dict__[FP8_SOURCE_ATTR] == "org/model"
    x = torch.randn(3, 5, 64, device=device, dtype=dtype, requires_grad=True)
    y = owner.proj(x)
    assert torch.equal(y, fp8_linear(x, expected, layer.bias.detach()))
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert sum(n for (op, _), n in report.calls.items() if op == "fp8_proj") == 1
    # A cast of the model (mixed precision, .half()) leaves codes and scales as they are.
    owner.to(torch.float16)
    assert getattr(layer, SCALE_NAME).dtype == torch.int32 and torch.equal(fp8_weight_of(layer).scale, expected.scale)
    assert torch.equal(layer.weight, expected.codes)


def test_nf4_linear4bit_is_replaced_by_an_fp8_linear(device):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(1)
    dense = nn.Linear(128, 64, bias=True)
    q = bnb.nn.Linear4bit(128, 64, bias=True, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
    q.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                 compress_statistics=True)
    q.bias = nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    owner = Owner(q).to(device)
    nf4 = BaseWeight(owner.proj.weight.data, owner.proj.weight.quant_state).materialize(dtype=torch.float32)
    out = to_fp8(owner, "proj", "fp8_proj", PatchReport(), None)
    assert type(out) is nn.Linear and owner.proj is out and is_fp8_layer(out)
    want = Fp8Weight.quantize(nf4)
    assert torch.equal(out.weight, want.codes) and torch.equal(fp8_weight_of(out).scale, want.scale)
    assert torch.equal(out.bias, q.bias)
    x = torch.randn(4, 128, device=device)
    y = owner.proj(x)
    err = ((y - (x @ nf4.t() + q.bias)).norm() / y.norm()).item()
    assert 0 < err < 0.05


def test_what_is_not_converted_says_why():
    trainable = Owner(nn.Linear(16, 16))
    assert "trainable" in to_fp8(trainable, "proj", "fp8_proj", PatchReport(), None)
    meta = Owner(nn.Linear(16, 16, device="meta").requires_grad_(False))
    assert "meta" in to_fp8(meta, "proj", "fp8_proj", PatchReport(), None)
    conv = Owner(nn.Conv1d(4, 4, 3).requires_grad_(False))
    assert "not a dense float linear" in to_fp8(conv, "proj", "fp8_proj", PatchReport(), None)
    bias = Owner(nn.Linear(16, 16))
    bias.proj.weight.requires_grad_(False)
    assert "bias is trainable" in to_fp8(bias, "proj", "fp8_proj", PatchReport(), None)


def test_converted_layer_is_adopted_and_deep_copies():
    owner = Owner(nn.Linear(32, 32).requires_grad_(False))
    first = PatchReport()
    layer = to_fp8(owner, "proj", "fp8_proj", first, None)
    codes, fwd = layer.weight, layer.forward
    second = PatchReport()
    assert to_fp8(owner, "proj", "fp8_proj", second, None) is layer
    assert layer.weight is codes and layer.forward is fwd and isinstance(fwd, Fp8LinearForward)
    x = torch.randn(2, 32)
    y = owner.proj(x)
    assert sum(second.calls.values()) == 1 and sum(first.calls.values()) == 0
    twin = copy.deepcopy(owner)
    assert twin.proj.forward.module is twin.proj and torch.equal(twin.proj(x), y)
