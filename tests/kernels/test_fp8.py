"""FP8 base products (kernels/fp8.py) against reference.py and float64 math.

- The Triton quantiser gives the reference's bits exactly (odd sizes, bf16/fp16/fp32, with and
  without a folded column scale, zero rows, tiny and huge rows); scales are the smallest powers
  of two that keep every code within ±448.
- The products compute what their docstrings say: diag(s_X) Q_X Q_Wᵀ diag(s_W) and
  diag(s_G) Q_G Q_W with G = dY diag(s_W), checked in float64 from the same codes (fp32: 1e-6;
  bf16/fp16: one rounding of the float64 value).
- The approximation itself: each product's error against exact float64 math is a few percent
  (e4m3 keeps 3 mantissa bits), reported beside the error bf16 makes.
- @pytest.mark.gpu: ``torch._scaled_mm`` against the reference at 8B widths.
"""

from __future__ import annotations

import math

import pytest
import torch

from fasttune.kernels import reference
from fasttune.kernels.fp8 import (Fp8Weight, fp8_linear, forward_product, grad_input_product, product_path,
                                  quantize_rows)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows(n, k, dtype, device, seed, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    if spread:  # rows from 1e-6 to 1e4 in magnitude, and one all-zero row
        x = x * torch.logspace(-6, 4, n)[:, None]
        x[n // 2] = 0
    return x.to(device, dtype)


def _is_pow2(t: torch.Tensor) -> bool:
    m, _ = torch.frexp(t)
    return bool((m == 0.5).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (5, 2500), (1, 1), (3, 17000)])  # 17000: wider than one tile
@pytest.mark.parametrize("with_col", [False, True])
def test_quantize_rows_matches_reference_bitwise(device, dtype, shape, with_col):
    n, k = shape
    x = _rows(n, k, dtype, device, seed=n * k)
    col = None
    if with_col:  # power-of-two column scales, as the weights' row scales are
        col = torch.exp2(torch.randint(-12, 3, (k,), generator=torch.Generator().manual_seed(1)).float()).to(device)
    q, s = quantize_rows(x, col)
    rq, rs = reference.quantize_rows_fp8(x, col)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.shape == (n, k)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)


def test_every_code_and_every_tie_rounds_as_torch(device):
    """Each finite e4m3 value, the midpoints between neighbours (ties: half to even) and points
    just off them, in a row whose max is 448 (scale 1): the Triton codes equal torch's cast."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[~values.isnan()].unique()  # sorted, -448 … 448
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, mids.nextafter(torch.tensor(float("inf"))),
                     mids.nextafter(torch.tensor(float("-inf"))), torch.tensor([-0.0])])
    q, s = quantize_rows(row[None].to(device))
    assert float(s) == 1.0
    assert torch.equal(q.view(torch.uint8).cpu(), row[None].to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scales_are_the_smallest_powers_of_two(device, dtype):
    x = _rows(9, 70, dtype, device, seed=3)
    q, s = quantize_rows(x)
    assert _is_pow2(s)
    qa = q.float().abs().amax(dim=1)
    nonzero = x.float().abs().amax(dim=1) > 0
    assert (qa <= 448).all()
    # The next smaller scale would overflow: each non-zero row uses more than half the range.
    assert (qa[nonzero] > 224).all()
    v = x.float()
    err = (q.float() * s[:, None] - v).abs()
    assert (err <= v.abs() * 2.0 ** -4 + s[:, None] * 2.0 ** -9).all()  # e4m3 rounding, subnormals


def test_quantize_rows_keeps_nan(device):
    x = torch.randn(3, 40, device=device)
    x[1, 5] = float("nan")
    q, _ = quantize_rows(x)
    assert torch.isnan(q[1, 5].float()) and not torch.isnan(q[0].float()).any()


def test_quantize_rows_bad_input(device):
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.randn(3, device=device))
    with pytest.raises(TypeError, match="x must be one of"):
        quantize_rows(torch.ones(2, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="col_scale"):
        quantize_rows(torch.randn(2, 3, device=device), torch.ones(4, device=device))


def _weight(out_f, in_f, device, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)
    w = w * torch.logspace(-1, 1, out_f)[:, None]  # rows of different ranges: per-row scales matter
    return w.to(device)


def test_fp8_weight_round_trip_and_bad_input(device):
    w = _weight(24, 40, device, 0)
    fw = Fp8Weight.quantize(w.bfloat16())
    assert fw.codes.dtype == torch.uint8 and fw.shape == (24, 40) and _is_pow2(fw.scale)
    err = (fw.dequantize() - w.bfloat16().float()).norm() / w.norm()
    assert 0 < err < 0.05
    with pytest.raises(ValueError, match="codes"):
        Fp8Weight(torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="scale"):
        Fp8Weight(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_compute_the_scaled_code_products(device, dtype):
    """Forward and dX from the same codes in float64: the semantics, up to accumulation order."""
    n, in_f, out_f = 13, 72, 40
    w = Fp8Weight.quantize(_weight(out_f, in_f, device, 1))
    x = _rows(n, in_f, dtype, device, seed=2, spread=False)
    dy = _rows(n, out_f, dtype, device, seed=3, spread=False)
    wq = w.fp8.double()

    q, s = reference.quantize_rows_fp8(x)
    want = (q.double() * s.double()[:, None]) @ (wq * w.scale.double()[:, None]).t()
    got = forward_product(x, w)
    assert got.dtype == dtype
    _close_to_one_rounding(got, want, dtype)

    qg, sg = reference.quantize_rows_fp8(dy, w.scale)
    want_dx = (qg.double() * sg.double()[:, None]) @ wq
    _close_to_one_rounding(grad_input_product(dy, w), want_dx, dtype)


def _close_to_one_rounding(got, want64, dtype):
    tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    err = (got.double() - want64).abs()
    assert (err <= tol * want64.abs() + 1e-6 * want64.abs().max()).all(), float(err.max())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_fp8_linear_autograd_and_its_error(device, dtype):
    """fp8_linear's output and dX against exact float64 math: within FP8's few percent; the
    gradient is the FP8 backward product (not autograd of the forward)."""
    n, in_f, out_f = 17, 96, 48
    w64 = _weight(out_f, in_f, device, 4).double()
    w = Fp8Weight.quantize(w64.to(dtype))
    bias = (torch.randn(out_f, generator=torch.Generator().manual_seed(5)) * 0.1).to(device, dtype)
    x = _rows(n, in_f, dtype, device, seed=6, spread=False).requires_grad_()
    y = fp8_linear(x.view(1, n, in_f), w, bias)
    dy = _rows(n, out_f, dtype, device, seed=7, spread=False)
    y.backward(dy.view(1, n, out_f))
    assert y.shape == (1, n, out_f) and x.grad.shape == x.shape and y.dtype == dtype

    y64 = x.detach().double() @ w64.t() + bias.double()
    dx64 = dy.double() @ w64
    e_y = ((y.view(n, out_f).double() - y64).norm() / y64.norm()).item()
    e_dx = ((x.grad.double() - dx64).norm() / dx64.norm()).item()
    assert e_y < 0.06 and e_dx < 0.06, (e_y, e_dx)
    expected_dx = grad_input_product(dy, w)
    assert torch.equal(x.grad, expected_dx)


def test_fp8_linear_bad_input(device):
    w = Fp8Weight.quantize(torch.randn(8, 16, device=device))
    with pytest.raises(TypeError, match="Fp8Weight"):
        fp8_linear(torch.randn(2, 16, device=device), torch.randn(8, 16, device=device))
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(2, 15, device=device), w)
    with pytest.raises(TypeError, match="x must be"):
        fp8_linear(torch.ones(2, 16, dtype=torch.int64, device=device), w)


def test_product_path_names_the_reference_on_cpu():
    w = Fp8Weight.quantize(torch.randn(16, 16))
    assert "reference" in product_path(torch.randn(2, 16), w)


# --- GPU: torch._scaled_mm against the reference ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096, 1024), (14336, 4096, 512), (4096, 14336, 512)])
def test_scaled_mm_matches_reference_on_gpu(shape):
    out_f, in_f, n = shape
    dev = "cuda"
    w = Fp8Weight.quantize(_weight(out_f, in_f, dev, 8).bfloat16())
    x = torch.randn(n, in_f, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(n, out_f, device=dev, dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert product_path(x, w) is None, product_path(x, w)
    if product_path(x, w) is not None:
        pytest.skip(product_path(x, w))
    # The forward uses Hopper's fast FP8 accumulation (reduced-precision partial sums): a looser bound.
    for got_fn, args, col, tol in ((forward_product, (x, w), None, 1e-2), (grad_input_product, (dy, w), w.scale, 4e-3)):
        inp = args[0]
        q, s = quantize_rows(inp, col)
        rq, rs = reference.quantize_rows_fp8(inp, col)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        got = got_fn(*args)
        b = w.fp8.t() if col is None else w.fp8
        want = reference.fp8_scaled_product(rq, rs, b, w.scale if col is None else None, torch.float64)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, (got_fn.__name__, err)  # bf16 rounding of the output, accumulation order and precision
