"""The experts' gated activation with the router weight folded in, vs float64 autograd of the
reference: h, dgate_up, the recomputed h and dweights, for every activation and layout (gpt-oss's
interleaved clamped SwiGLU with values on both sides of the clamps and exactly on them), with and
without router weights, fp32 (1e-5) and bf16 (2× the same-dtype error)."""

import pytest
import torch

from fasttune.kernels import moe_reference as reference
from fasttune.kernels.moe_glu import moe_glu, moe_glu_backward
from fasttune.kernels.moe_reference import GLU_KINDS, ExpertGLU
from helpers.kernel_checks import check_in_norm

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

S, I = 70, 45  # rows over two 64-row tiles, columns not a power of two


def _inputs(device, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(S, 2 * I, generator=g) * 2
    if kind == "clamped_swiglu":
        gu[0, :6] = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.25, 3.0])  # on the clamps: gate = L, up = ±L
    w = torch.rand(S, generator=g)
    dh = torch.randn(S, I, generator=g)
    return gu.to(device, dtype), w.to(device), dh.to(device, dtype)


def _ref(gu, w, dh, glu):
    gu = gu.detach().double().requires_grad_()
    w = None if w is None else w.detach().double().requires_grad_()
    h = reference.moe_glu(gu, w, glu)
    grads = torch.autograd.grad(h, [gu] + ([w] if w is not None else []), dh.double())
    return h, grads[0], grads[1] if w is not None else None


@pytest.mark.parametrize("kind", GLU_KINDS)
@pytest.mark.parametrize("with_weights", [True, False])
def test_forward_and_backward_fp32(device, kind, with_weights):
    glu = ExpertGLU(kind, 1.702, 0.5)
    gu, w, dh = _inputs(device, torch.float32, kind, seed=GLU_KINDS.index(kind))
    w = w if with_weights else None
    h64, dgu64, dw64 = _ref(gu, w, dh, glu)
    check_in_norm(moe_glu(gu, w, glu), h64, what="h")
    dgu, h, dw = moe_glu_backward(gu, dh, w, glu)
    check_in_norm(dgu, dgu64, what="dgate_up")
    check_in_norm(h, h64, what="recomputed h")
    assert (dw is None) == (w is None)
    if w is not None:
        check_in_norm(dw, dw64, what="dweights")


@pytest.mark.parametrize("kind", ["silu", "clamped_swiglu"])
def test_bf16_within_twice_torch_error(device, kind):
    glu = ExpertGLU(kind, 1.702, 0.5)
    gu, w, dh = _inputs(device, torch.bfloat16, kind, seed=7)
    h64, dgu64, dw64 = _ref(gu, w, dh, glu)
    # the same dtype in plain torch: the reference math on the bf16 values, autograd in bf16
    gub = gu.detach().clone().requires_grad_()
    wb = w.to(torch.bfloat16).requires_grad_()
    gate, up = reference.split_gate_up(gub, glu)
    hb = reference._glu_math(gate, up, glu) * wb[:, None]
    dgub, dwb = torch.autograd.grad(hb, [gub, wb], dh)
    check_in_norm(moe_glu(gu, w, glu), h64, hb, what="h", lowp=torch.bfloat16)
    dgu, h, dw = moe_glu_backward(gu.clone(), dh, w, glu)
    check_in_norm(dgu, dgu64, dgub, what="dgate_up", lowp=torch.bfloat16)
    check_in_norm(dw.to(torch.bfloat16), dw64, dwb, what="dweights", lowp=torch.bfloat16)


def test_overwrite_writes_the_gradient_into_gate_up(device):
    glu = ExpertGLU("silu")
    gu, w, dh = _inputs(device, torch.float32, "silu", seed=9)
    expect, _, _ = moe_glu_backward(gu.clone(), dh, w, glu)
    buf = gu.clone()
    dgu, _, _ = moe_glu_backward(buf, dh, w, glu, overwrite=True)
    assert dgu.data_ptr() == buf.data_ptr() and torch.equal(dgu, expect)


@pytest.mark.parametrize("kind", ["silu", "clamped_swiglu"])
def test_without_h_gives_the_same_gradients_and_no_h(device, kind):
    """``with_h=False`` (grouped_mlp's backward, which computed h before): dgate_up and dweights bit for
    bit those with h, h None; and ``moe_glu`` is bit for bit the h the backward recomputes."""
    glu = ExpertGLU(kind, 1.702, 0.5)
    gu, w, dh = _inputs(device, torch.bfloat16, kind, seed=11)
    dgu, h, dw = moe_glu_backward(gu, dh, w, glu)
    dgu2, h2, dw2 = moe_glu_backward(gu, dh, w, glu, with_h=False)
    assert h2 is None and torch.equal(dgu2, dgu) and torch.equal(dw2, dw)
    assert torch.equal(moe_glu(gu, w, glu), h)


def test_bad_inputs(device):
    gu = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="glu.kind"):
        moe_glu(gu, None, ExpertGLU("relu"))
    with pytest.raises(ValueError, match="gate_up must be"):
        moe_glu(gu[:, :5], None)
    with pytest.raises(ValueError, match="weights must be"):
        moe_glu(gu, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="dh must be"):
        moe_glu_backward(gu, torch.ones(4, 2, device=device), None)


def test_out_writes_into_the_columns_of_a_wider_buffer(device):
    """``out``: h written into the first I columns of a wider buffer (the widened down projection's
    input), the other columns untouched; a wrong ``out`` is named."""
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(37, 2 * 24, generator=g).to(device)
    weights = torch.rand(37, generator=g).to(device)
    buf = torch.full((37, 24 + 8), 7.0, device=device)
    got = moe_glu(gate_up, weights, ExpertGLU("silu"), out=buf[:, :24])
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:, :24], moe_glu(gate_up, weights, ExpertGLU("silu")))
    assert buf[:, 24:].eq(7.0).all()
    with pytest.raises(ValueError, match="out must be"):
        moe_glu(gate_up, weights, ExpertGLU("silu"), out=buf[:, :23])


@pytest.mark.parametrize("kind", ["silu", "clamped_swiglu"])
def test_backward_out_writes_dgate_up_into_the_columns_of_a_wider_buffer(device, kind):
    """``moe_glu_backward(out=)``: dgate_up written into the first 2I columns of a wider buffer (the
    bordered gate/up projection's dY), bitwise the plain call's, the other columns untouched;
    ``out`` with ``overwrite`` or of a wrong shape is named."""
    glu = ExpertGLU(kind, 1.702, 0.4)
    gu, w, dh = _inputs(device, torch.float32, kind, seed=13)
    expect = moe_glu_backward(gu, dh, w, glu)
    buf = torch.full((gu.shape[0], gu.shape[1] + 8), 7.0, device=device)
    got = moe_glu_backward(gu, dh, w, glu, out=buf[:, : gu.shape[1]])
    assert got[0].data_ptr() == buf.data_ptr() and buf[:, gu.shape[1]:].eq(7.0).all()
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="out must be"):
        moe_glu_backward(gu, dh, w, glu, overwrite=True, out=buf[:, : gu.shape[1]])
    with pytest.raises(ValueError, match="out must be"):
        moe_glu_backward(gu, dh, w, glu, out=buf[:, :4])
