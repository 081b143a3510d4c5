"""spare_columns.py: the RMSNorm kernel leaves free columns after its rows for a widened LoRA group.

What must hold: a norm output with spare columns has the same values and gradients, bit for bit,
as one without (odd widths, fp32 and bf16, 3-D input); a consumer gets a widened input only from a
tagged output that carries enough columns, only for the whole output, and writing that input's tail
changes neither X nor X's version counter (so autograd's saved-tensor checks stay quiet, also when
two groups of different widths read one output); lora_qkv / lora_mlp over such an input compute
the same numbers as over a plain copy of it, and against float64 math.
"""

from __future__ import annotations

import pytest
import torch

from fasttune.kernels.lora import lora_qkv
from fasttune.kernels.lora_glu import lora_mlp
from fasttune.kernels.rms_norm import rms_norm, rms_norm_add, rms_norm_keep
from fasttune.kernels.spare_columns import SpareColumns, output_rows, spare_input
from helpers.wide_lora import check, spec

EPS = 1e-6


def _norm_inputs(device, dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype).requires_grad_()
    return x, w


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_with_spare_columns_is_bitwise_the_plain_norm(device, dtype, casting):
    x, w = _norm_inputs(device, dtype, (3, 19, 72), seed=0)
    spare = SpareColumns()
    spare.request(24)
    y_spare = rms_norm(x, w, EPS, casting=casting, spare=spare)
    y_plain = rms_norm(x, w, EPS, casting=casting)
    assert spare.width == 32  # a multiple of 16: rows keep the divisibility Triton specialises on
    assert y_spare.shape == y_plain.shape and y_spare.stride() == (19 * 104, 104, 1)
    assert y_spare._base is None  # an alias with its own version counter, not a view
    assert torch.equal(y_spare, y_plain)
    dy = torch.randn_like(y_plain)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y_spare, (x, w), dy),
                                                 torch.autograd.grad(y_plain, (x, w), dy)))
    y_spare.mul_(1)  # not a view made inside an autograd Function: in-place ops are allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_norms_leave_spare_columns(device, dtype):
    """rms_norm_add and rms_norm_keep take the same ``spare``: their normed output is bitwise the
    plain call's, rows longer, and a widened group finds X in place."""
    x, w = _norm_inputs(device, dtype, (2, 9, 40), seed=2)
    res, _ = _norm_inputs(device, dtype, (2, 9, 40), seed=3)
    for call in (lambda sp: rms_norm_add(x, res, w, EPS, spare=sp), lambda sp: rms_norm_keep(x, w, EPS, spare=sp)):
        spare = SpareColumns()
        spare.request(8)
        (y, s), (y0, s0) = call(spare), call(None)
        assert y.stride() == (9 * 56, 56, 1) and torch.equal(y, y0) and torch.equal(s, s0)
        assert spare_input(y.reshape(18, 40), 8).shape == (18, 48)
        dy, ds = torch.randn_like(y0), torch.randn_like(s0)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad((y, s), (x, w), (dy, ds)),
                                                     torch.autograd.grad((y0, s0), (x, w), (dy, ds))))


def test_spare_input_only_from_whole_tagged_outputs(device):
    spare = SpareColumns()
    y, row = output_rows((4, 5, 12), torch.float32, device, spare)
    assert row == 12 and spare_input(y.view(20, 12), 8) is None  # no spare columns yet …
    assert spare.width == 16  # … but the request is recorded (rounded up to 16)
    y, row = output_rows((4, 5, 12), torch.float32, device, spare)
    assert row == 28
    y.copy_(torch.randn(4, 5, 12))
    x2 = y.reshape(20, 12)
    xcat = spare_input(x2, 8)
    assert xcat.shape == (20, 20) and xcat.stride() == (28, 1) and xcat.data_ptr() == x2.data_ptr()
    assert spare_input(x2, 16).shape == (20, 28)
    before, version = x2.clone(), y._version
    xcat[:, 12:].fill_(7.0)
    assert torch.equal(x2, before) and y._version == version  # X and its version untouched
    assert spare_input(x2[:10], 8) is None  # part of the output: its rows are not ours to extend
    assert spare_input(x2, 20) is None and spare.width == 32  # too few columns this time
    assert spare_input(torch.randn(20, 12, device=device), 8) is None  # never an untagged tensor
    assert spare_input(x2.t().contiguous().t(), 8) is None  # a copy in another layout


def test_rms_norm_rejects_a_wrong_spare(device):
    x, w = _norm_inputs(device, torch.float32, (2, 8), seed=1)
    with pytest.raises(TypeError, match="SpareColumns"):
        rms_norm(x, w, EPS, spare=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_qkv_and_mlp_read_the_norms_spare_columns(device, dtype):
    """One norm output feeds a widened q/k/v group and a widened gate/up group (tails 16): both take
    it without a copy (tails written in turn), outputs and gradients are bitwise those over a copied
    widened input of the same layout and match float64, and backward sees no in-place modification
    of the saved X."""
    torch.manual_seed(2)
    x, w = _norm_inputs(device, dtype, (2, 29, 72), seed=3)
    qkv_parts = [spec(96, 72, 8, dtype, device, 4, extra=16), spec(48, 72, 0, dtype, device, 5, extra=16),
                 spec(48, 72, 5, dtype, device, 6, extra=16)]
    mlp_parts = [spec(101, 72, 8, dtype, device, 7, extra=16), spec(101, 72, 8, dtype, device, 8, extra=16),
                 spec(72, 101, 8, dtype, device, 9, extra=8)]
    spare = SpareColumns()
    spare.request(16)
    h = rms_norm(x, w, EPS, spare=spare)
    seen = []
    import fasttune.kernels.lora_wide as lora_wide

    original = lora_wide.spare_input
    lora_wide.spare_input = lambda x2, extra: seen.append(original(x2, extra)) or seen[-1]
    try:
        q, k, v = lora_qkv(h, *(p[0] for p in qkv_parts))
        y = lora_mlp(h, *(p[0] for p in mlp_parts))
    finally:
        lora_wide.spare_input = original
    assert len(seen) == 2 and all(t is not None for t in seen)  # q/k/v, gate/up (down reads H from the GLU kernel)
    outs = (q, k, v, y)
    dys = [torch.randn_like(o) for o in outs]
    params = [t for parts in (qkv_parts, mlp_parts) for (_, a, b, _), _, _ in parts for t in (a, b) if t is not None]
    got = torch.autograd.grad(outs, [x, w] + params, dys)  # no "modified by an inplace operation"

    plain = rms_norm(x, w, EPS).detach().clone().requires_grad_()
    check(lambda hh, specs: lora_qkv(hh, *specs), plain, qkv_parts, dtype)  # the kernels vs float64
    q2, k2, v2 = lora_qkv(plain, *(p[0] for p in qkv_parts))
    y2 = lora_mlp(plain, *(p[0] for p in mlp_parts))
    for a, b in zip(outs, (q2, k2, v2, y2)):
        assert torch.equal(a, b)  # the same products as over a copied widened input
    want = torch.autograd.grad((q2, k2, v2, y2), [plain] + params, dys)
    assert torch.equal(torch.autograd.grad(rms_norm(x, w, EPS), x, want[0])[0], got[0])
    for g_got, g_want in zip(got[2:], want[1:]):
        assert torch.equal(g_got, g_want)
