"""The checks every kernel test makes: the kernel's result against float64 math (``ref64``) and,
in half precision, against the same op run by torch in the kernel's dtype (``same``).

DESIGN's rule, ``|kernel − ref64| ≤ 2·|torch_same_dtype − ref64| + atol``, in two forms; each test
file keeps the bound it always had by its arguments:

- ``check_in_norm``: Frobenius norms, for ops built on matrix products (loss heads, LoRA), whose
  rounding spreads over every element, so an elementwise bound would fail wherever torch happens
  to be exact by chance. fp32: ‖got − ref64‖ ≤ rtol·‖ref64‖ (also against an fp32 reference).
- ``check_elementwise``: per element, for elementwise and row-wise ops (RMSNorm, RoPE, SwiGLU),
  whose every output element is rounded on its own. fp32: |got − ref64| ≤ rtol·|ref64| plus a
  floor of 1e-6 of the largest |ref64|.

Both fail on a shape mismatch and on NaN or inf in the kernel's result.
"""

from __future__ import annotations

import torch

_FP32_FLOOR = 1e-6  # elementwise fp32 bounds: a floor of 1e-6·max|ref64| for elements near 0
_LOWP_FLOOR = 1e-3  # elementwise half-precision bounds: a floor of 1e-3 ulp·max|ref64|


def _norm(t: torch.Tensor) -> float:
    return t.detach().double().norm().item()


def check_in_norm(got: torch.Tensor, want: torch.Tensor, same: torch.Tensor | None = None, *, what: str,
                  rtol: float = 1e-5, lowp: torch.dtype | None = None, atol: float | None = None) -> None:
    """Without ``same``: ‖got − want‖ ≤ rtol·‖want‖ (want: float64 math, or a reference).

    With ``same`` (half precision; ``want`` is float64 math): ‖got − want‖ ≤ 2·‖same − want‖ +
    atol·‖want‖, ``atol`` by default one ulp of ``lowp`` (the dtype the op ran in; default got's).
    """
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: NaN or inf in the kernel's result"
    want = want.detach().double()
    err = _norm(got.detach().double() - want)
    scale = _norm(want)
    if same is None:
        rel = err / max(scale, 1e-300)
        assert err <= rtol * scale, f"{what}: relative error {rel:.3g} > {rtol} (scale {scale:.3g})"
        return
    assert same.shape == want.shape, f"{what}: torch's shape {tuple(same.shape)} != {tuple(want.shape)}"
    atol = torch.finfo(lowp or got.dtype).eps if atol is None else atol
    e_torch = _norm(same.detach().double() - want)
    bound = 2 * e_torch + atol * scale
    assert err <= bound, f"{what}: ‖kernel − ref64‖ {err:.3g} > {bound:.3g} (torch {e_torch:.3g}, scale {scale:.3g})"


def check_elementwise(got: torch.Tensor, ref64: torch.Tensor, same: torch.Tensor, *, what: str,
                      lowp: torch.dtype | None = None, rtol: float = 1e-5, ulps: int = 1,
                      mag: torch.Tensor | None = None, fp32_vs_same: bool = False) -> None:
    """Per element, with s = max|ref64|:

    - fp32 (``lowp`` None): |got − ref64| ≤ rtol·|ref64| + 1e-6·s; with ``fp32_vs_same`` the same
      bound also holds for |got − same| (same: torch's fp32 formula);
    - half precision (``lowp`` the dtype the op ran in, whose ulp ε is used):
      |got − ref64| ≤ 2·|same − ref64| + ulps·ε·mag + 1e-3·ε·s, ``mag`` = |ref64| by default (one
      ulp per rounding the op itself does; a sum's rounding scales with the sum of |terms|).

    ``same`` must also have got's dtype.
    """
    assert got.dtype == same.dtype, f"{what}: dtype {got.dtype} != torch's {same.dtype}"
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    got64, ref64, same64 = got.detach().double(), ref64.detach().double(), same.detach().double()
    assert torch.isfinite(got64).all(), f"{what}: NaN or inf in the kernel's result"
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    if lowp is None:
        bound = rtol * ref64.abs() + _FP32_FLOOR * scale
        if fp32_vs_same:
            ok = (got64 - same64).abs() <= bound  # NaN anywhere fails
            assert ok.all(), f"{what}: {int((~ok).sum())}/{ok.numel()} off torch's fp32 result"
    else:
        eps = torch.finfo(lowp).eps
        mag = ref64.abs() if mag is None else mag
        bound = 2 * (same64 - ref64).abs() + ulps * eps * mag + _LOWP_FLOOR * eps * scale
    err = (got64 - ref64).abs()
    ok = err <= bound  # NaN anywhere (a NaN bound too) fails
    worst = err.max().item() if err.numel() else 0.0
    assert ok.all(), f"{what}: {int((~ok).sum())}/{ok.numel()} off, worst {worst:.3g} (scale {scale:.3g})"
