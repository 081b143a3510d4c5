"""lora_wide.py: the rank-r term folded into the base product, against float64 math.

Widened bases (W the first columns of a [out, in + R] buffer, B written into the tail per call)
through ``project_wide`` directly and through the fused Functions (lora_qkv, lora_linear,
lora_mlp, whose down projection reads H from the GLU kernel's widened output): every output and
every gradient on fresh random inputs, odd widths, GQA, partial adapters and unequal ranks, bias,
fp32 (relative error ≤ 1e-5) and bf16 (error norm ≤ 2 × the same-dtype reference's + bf16 eps of
the norm, helpers.kernel_checks.check_in_norm). Plus the tail bookkeeping and the bitwise B = 0 /
adapters-off property.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fasttune.kernels import reference
from fasttune.kernels.lora import BaseWeight, lora_linear, lora_qkv
from fasttune.kernels.lora_glu import lora_mlp
from fasttune.kernels import kept_weights
from fasttune.kernels.kept_weights import KeptWeights
from fasttune.kernels.lora_wide import BorderedNf4, WideWeight, project_wide, wide_columns
from helpers.kernel_checks import check_in_norm
from helpers.wide_lora import check, nf4_spec, spec, widened


@pytest.mark.parametrize("make,width,seed", [(spec, 72, 0), (nf4_spec, 64, 10)], ids=["dense", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_qkv_widened_gqa_partial_adapters(device, dtype, make, width, seed):
    """q 96 wide, k 48 without adapter (bias), v 48; ranks 8 and 5: tail 16 (13 used, padded). Dense
    widened bases and NF4 bases bordered per product (BorderedNf4)."""
    torch.manual_seed(seed)
    x = torch.randn(3, 23, width, device=device, dtype=dtype, requires_grad=True)
    parts = [make(96, width, 8, dtype, device, 1, extra=16), make(48, width, 0, dtype, device, 2, extra=16, bias=True),
             make(48, width, 5, dtype, device, 3, extra=16)]
    assert wide_columns([p[0][0] for p in parts], [None if p[0][1] is None else p[0][1:] for p in parts],
                        dtype) == [0, None, 8]
    check(lambda x, specs: lora_qkv(x, *specs), x, parts, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_widened_with_bias(device, dtype):
    torch.manual_seed(1)
    x = torch.randn(41, 80, device=device, dtype=dtype, requires_grad=True)
    parts = [spec(136, 80, 16, dtype, device, 4, extra=24, bias=True)]
    check(lambda x, specs: lora_linear(x, *specs[0]), x, parts, dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mlp_widened(device, dtype, activation):
    """gate/up widened (tail 16 = 8 + 8), down widened (tail 8): H goes straight into the widened input."""
    torch.manual_seed(2)
    x = torch.randn(2, 31, 72, device=device, dtype=dtype, requires_grad=True)
    parts = [spec(203, 72, 8, dtype, device, 5, extra=16), spec(203, 72, 8, dtype, device, 6, extra=16),
             spec(72, 203, 8, dtype, device, 7, extra=8)]
    y = lora_mlp(x, *(p[0] for p in parts), activation=activation)
    dy = torch.randn_like(y)
    params = [x] + [t for (_, a, b, _), _, _ in parts for t in (a, b)]
    got = torch.autograd.grad(y, params, dy)
    for rdt in (torch.float64,) + ((dtype,) if dtype != torch.float32 else ()):
        leaves = [t.detach().to(rdt).requires_grad_() for t in params]
        specs = [(parts[i][1].to(rdt), leaves[1 + 2 * i], leaves[2 + 2 * i], parts[i][0][3]) for i in range(3)]
        ry = reference.lora_mlp(leaves[0], *specs, activation=activation)
        rg = torch.autograd.grad(ry, leaves, dy.to(rdt))
        if rdt == torch.float64:
            ref64 = (ry, rg)
        else:
            same = (ry, rg)
    same = same if dtype != torch.float32 else (None, [None] * len(params))
    check_in_norm(y, ref64[0], same[0], what="output")
    for i, g in enumerate(got):
        check_in_norm(g, ref64[1][i], same[1][i], what=f"grad {i}")


# --- NF4 bases, bordered per product (BorderedNf4) ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bordered_nf4_mlp_against_float64(device, dtype):
    """gate/up bordered (their rank-r terms in the products, not in the GLU pass) and down bordered
    (H written by the GLU kernel into its widened input); odd row counts, widths 80 and 144."""
    torch.manual_seed(11)
    x = torch.randn(2, 29, 80, device=device, dtype=dtype, requires_grad=True)
    parts = [nf4_spec(144, 80, 8, dtype, device, 34, extra=16), nf4_spec(144, 80, 8, dtype, device, 35, extra=16),
             nf4_spec(80, 144, 8, dtype, device, 36, extra=16)]
    y = lora_mlp(x, *(p[0] for p in parts))
    dy = torch.randn_like(y)
    params = [x] + [t for (_, a, b, _), _, _ in parts for t in (a, b)]
    got = torch.autograd.grad(y, params, dy)
    refs = {}
    for rdt in (torch.float64,) + ((dtype,) if dtype != torch.float32 else ()):
        leaves = [t.detach().to(rdt).requires_grad_() for t in params]
        specs = [(parts[i][1].to(rdt), leaves[1 + 2 * i], leaves[2 + 2 * i], parts[i][0][3]) for i in range(3)]
        ry = reference.lora_mlp(leaves[0], *specs)
        refs[rdt] = (ry, torch.autograd.grad(ry, leaves, dy.to(rdt)))
    same = refs[dtype] if dtype != torch.float32 else (None, [None] * len(params))
    check_in_norm(y, refs[torch.float64][0], same[0], what="output")
    for i, g in enumerate(got):
        check_in_norm(g, refs[torch.float64][1][i], same[1][i], what=f"grad {i}")


def test_bordered_nf4_kept_by_a_recompute_serve_its_backward_bitwise(device):
    """A recording pass (a checkpointed layer's recompute) puts each bordered buffer whole; the
    backward takes them instead of dequantising: the same output and gradients bit for bit, and
    nothing left kept."""
    dt = torch.bfloat16
    torch.manual_seed(12)
    x = torch.randn(37, 64, device=device, dtype=dt, requires_grad=True)
    parts = [nf4_spec(96, 64, 8, dt, device, 37, extra=16), nf4_spec(48, 64, 4, dt, device, 38, extra=16),
             nf4_spec(48, 64, 4, dt, device, 39, extra=16)]
    dys = [torch.randn(37, p[1].shape[0], device=device, dtype=dt) for p in parts]
    params = [x] + [t for (_, a, b, _), _, _ in parts for t in (a, b)]
    runs = []
    for recording in (False, True):
        kept = KeptWeights()
        token = kept_weights.keeping(kept, recording)
        try:
            outs = lora_qkv(x, *(p[0] for p in parts))
        finally:
            kept_weights.stop(token)
        assert len(kept) == (3 if recording else 0)
        if recording:
            held = list(kept._weights.values())
            assert all(w.shape[1] == 64 + 16 for w in held)  # whole bordered buffers
        runs.append((outs, torch.autograd.grad(outs, params, dys)))
        assert len(kept) == 0  # each taken once
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b)


def test_bordered_nf4_fresh_adapter_is_bitwise_the_adapterless_product(device):
    """B = 0 against the adapters off (DPO's reference pass, which lora_spec runs bordered too)."""
    torch.manual_seed(13)
    x = torch.randn(41, 64, device=device, dtype=torch.bfloat16)
    (base, a, b, s), _, _ = nf4_spec(112, 64, 16, torch.bfloat16, device, 40, extra=16)
    with torch.no_grad():
        b.zero_()
        fresh = project_wide(x, [base], [(a, b, s)], x @ a.t(), [0])[0]
        off = project_wide(x, [base], [None], None, [None])[0]
    assert torch.equal(fresh, off)


def test_bordered_nf4_fill_rewrites_the_whole_tail_of_a_kept_buffer(device):
    """A kept buffer's tail is rewritten: B in its columns, zeros around it (never the old contents);
    a buffer of another shape or dtype is refused."""
    torch.manual_seed(14)
    (base, _, b, _), _, _ = nf4_spec(40, 64, 4, torch.bfloat16, device, 42, extra=16)
    wide, b = base.wide, b.detach()
    for col in (0, 5, 12):
        buf = torch.full((40, 64 + 16), float("nan"), dtype=torch.bfloat16, device=device)
        w = torch.randn(40, 64, device=device).to(torch.bfloat16)
        buf[:, :64] = w
        assert wide.fill(col, b, buf=buf) is buf
        want = torch.zeros(40, 16, dtype=torch.bfloat16, device=device)
        want[:, col:col + 4] = b
        assert torch.equal(buf[:, 64:], want) and torch.equal(buf[:, :64], w)
    assert torch.equal(wide.fill(None, None, buf=buf)[:, 64:], torch.zeros_like(want))
    for bad in (torch.empty(40, 64, dtype=torch.bfloat16, device=device),
                torch.empty(40, 80, dtype=torch.float32, device=device)):
        with pytest.raises(ValueError, match="buf must be"):
            wide.fill(0, b, buf=bad)


def test_bordered_nf4_holds_its_codes_and_state_only(device):
    (base, *_), _, _ = nf4_spec(16, 32, 4, torch.bfloat16, device, 41, extra=16)
    wide = base.wide
    assert wide.holds(base.weight, base.quant_state) and wide.holds(base.weight)
    assert not wide.holds(base.weight.clone()) and not wide.holds(base.weight, copy.copy(base.quant_state))
    assert copy.deepcopy({"w": wide})["w"] is None
    dense = widened(torch.randn(16, 32, device=device), 16).wide
    assert not dense.holds(dense.weight_view(), base.quant_state)  # a dense buffer never holds NF4 codes
    with pytest.raises(ValueError, match="BorderedNf4"):
        BaseWeight(base.weight.clone(), base.quant_state, None, wide)
    with pytest.raises(ValueError, match="extra"):
        BorderedNf4(base.weight, base.quant_state, 0, torch.bfloat16)
    assert wide_columns([base], [None], torch.float32) is None  # bordered for bf16 products only


def test_fresh_adapter_is_bitwise_the_adapterless_product(device):
    """B = 0: the tail products are exact zeros, so the output equals the no-adapter call's bits."""
    torch.manual_seed(3)
    x = torch.randn(37, 64, device=device)
    (base, a, b, s), _, _ = spec(112, 64, 16, torch.float32, device, 8, extra=16)
    with torch.no_grad():
        b.zero_()
    with torch.no_grad():  # as inside the fused Functions' forward
        fresh = project_wide(x, [base], [(a, b, s)], x @ a.t(), [0])[0]
        off = project_wide(x, [base], [None], None, [None])[0]
    assert torch.equal(fresh, off)
    assert torch.equal(base.wide.buf[:, 64:], torch.zeros(112, 16, device=device))  # the off call zeroed it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_reloads_tails_zeroed_by_an_adapterless_forward(device, dtype):
    """DPO runs the reference (adapters off: zero tails) between the policy's forward and backward;
    the policy's dYB comes from the tails, so backward must put B back first."""
    torch.manual_seed(6)
    x = torch.randn(2, 19, 56, device=device, dtype=dtype, requires_grad=True)
    parts = [spec(88, 56, 8, dtype, device, 18, extra=16), spec(40, 56, 6, dtype, device, 19, extra=16),
             spec(40, 56, 2, dtype, device, 20, extra=16)]

    def policy_then_reference(x, specs):
        outs = lora_qkv(x, *specs)
        with torch.no_grad():
            lora_qkv(x, *((base, None, None, 0.0) for base, *_ in specs))
        assert not specs[0][0].wide.buf[:, 56:].any()  # the reference zeroed the tail
        return outs

    check(policy_then_reference, x, parts, dtype)


def test_widened_dx_and_rank_products_share_one_buffer(device):
    """dX is a column range of the [N, in + R] product sum (no separate dY B products)."""
    torch.manual_seed(7)
    x = torch.randn(29, 48, device=device, requires_grad=True)
    (base, a, b, s), _, _ = spec(72, 48, 8, torch.float32, device, 21, extra=16)
    dx, = torch.autograd.grad(lora_linear(x, base, a, b, s), x, torch.randn(29, 72, device=device))
    assert dx.shape == (29, 48) and dx.stride() == (64, 1)


def test_tail_layout_bookkeeping(device):
    w = torch.randn(10, 6, device=device)
    wide = widened(w, 8).wide
    b1, b2 = torch.randn(10, 3, device=device), torch.randn(10, 2, device=device)
    wide.load(0, b1)
    assert torch.equal(wide.buf[:, 6:9], b1) and not wide.buf[:, 9:].any()
    wide.load(4, b2)  # another layout: the old columns are cleared
    assert not wide.buf[:, 6:10].any() and torch.equal(wide.buf[:, 10:12], b2)
    b2.mul_(2)
    wide.load(4, b2)  # same layout, new values (an optimizer step)
    assert torch.equal(wide.buf[:, 10:12], b2)
    assert torch.equal(wide.weight_view(), w)


def test_holds_and_deepcopy(device):
    base = widened(torch.randn(8, 5, device=device), 8)
    wide = base.wide
    assert wide.holds(base.weight) and not wide.holds(base.weight.contiguous())
    assert not wide.holds(base.weight.to(torch.float64))
    assert copy.deepcopy({"w": wide})["w"] is None  # a deep-copied model gets no buffer
    with pytest.raises(ValueError, match="holding this dense weight"):
        BaseWeight(torch.randn(8, 5, device=device), None, None, wide)
    with pytest.raises(ValueError, match="R >= 1"):
        WideWeight(torch.zeros(4, 4, device=device), 4)


def test_wide_columns_rejects_what_cannot_run_widened(device):
    dt = torch.float32
    (q, a, b, s), _, _ = spec(16, 8, 8, dt, device, 9, extra=8)
    (k, a2, b2, s2), _, _ = spec(16, 8, 4, dt, device, 10, extra=16)
    plain = BaseWeight(torch.randn(16, 8, device=device))
    assert wide_columns([q], [(a, b, s)], dt) == [0]
    assert wide_columns([q], [(a, b, s)], torch.bfloat16) is None  # buffer of another dtype
    assert wide_columns([q, k], [(a, b, s), (a2, b2, s2)], dt) is None  # unequal tails
    assert wide_columns([q, plain], [(a, b, s), None], dt) is None  # one base not widened
    assert wide_columns([k, k], [(a, b, s), (a, b, s)], dt) == [0, 8]
    assert wide_columns([q, q], [(a, b, s), (a, b, s)], dt) is None  # 16 rank columns, tail 8


def test_project_falls_back_when_the_tail_is_too_narrow(device):
    """lora.project takes the two-product path when the widened layout does not fit (a larger adapter)."""
    torch.manual_seed(4)
    x = torch.randn(2, 9, 24, device=device, requires_grad=True)
    parts = [spec(40, 24, 16, torch.float32, device, 11, extra=8)]
    check(lambda x, specs: lora_linear(x, *specs[0]), x, parts, torch.float32)
    assert not parts[0][0][0].wide.buf[:, 24:].any()  # never written


@pytest.mark.gpu
def test_llama8b_qkv_and_mlp_widened_on_gpu():
    """Llama-3-8B q/k/v and MLP widths at 4,096 rows, r = 16, bf16, widened, against float64."""
    torch.manual_seed(5)
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(4096, 4096, device=dev, dtype=dt, requires_grad=True)
    parts = [spec(4096, 4096, 16, dt, dev, 12, extra=48), spec(1024, 4096, 16, dt, dev, 13, extra=48),
             spec(1024, 4096, 16, dt, dev, 14, extra=48)]
    check(lambda x, specs: lora_qkv(x, *specs), x, parts, dt)
    parts = [spec(14336, 4096, 16, dt, dev, 15, extra=32), spec(14336, 4096, 16, dt, dev, 16, extra=32),
             spec(4096, 14336, 16, dt, dev, 17, extra=16)]
    y = lora_mlp(x, *(p[0] for p in parts))
    ref = reference.lora_mlp(x.double(), *((w.double(), a.double(), b.double(), s) for (_, a, b, s), w, _ in parts))
    check_in_norm(y, ref, what="mlp vs float64", rtol=1e-2)
