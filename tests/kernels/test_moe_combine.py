"""Each token's sum over its k expert rows (``moe_combine.combine_rows``) vs float64 math: fp32 and
bf16 rows, outputs in the rows' dtype or another, k = 1, 2, 3 and 8, column counts below, at and
past one block (a partial last block), fresh random permutations; bf16 within 2× the error of the
plain-torch gather, fp32-sum and cast. Bad arguments raise naming them."""

import pytest
import torch

from fasttune.kernels.moe_combine import MAX_BLOCK, combine_rows, reference_combine
from helpers.kernel_checks import check_elementwise


def _case(device, dtype, T, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(T * k, n, generator=g) * 3).to(device, dtype)
    inverse = torch.randperm(T * k, generator=g).to(device)
    return rows, inverse


def _ref64(rows, inverse, k):
    return rows.double()[inverse].view(-1, k, rows.shape[1]).sum(dim=1)


@pytest.mark.parametrize("k,n", [(1, 37), (2, 64), (3, MAX_BLOCK + 45), (8, 129)])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_matches_float64(device, k, n, dtype, out_dtype):
    rows, inverse = _case(device, dtype, T=13, k=k, n=n, seed=k * 1000 + n)
    got = combine_rows(rows, inverse, k, out_dtype)
    assert got.dtype == out_dtype and got.shape == (13, n)
    want = _ref64(rows, inverse, k)
    same = reference_combine(rows, inverse, k, out_dtype)  # gather, fp32 sum, cast
    lowp = None if out_dtype == torch.float32 else out_dtype
    check_elementwise(got, want, same, what=f"k={k} n={n}", lowp=lowp)


def test_int32_indices_and_strided_rows(device):
    """Row stride larger than the row (a column slice of a wider buffer); int32 inverse."""
    rows, inverse = _case(device, torch.float32, T=9, k=2, n=80, seed=3)
    wide = torch.full((rows.shape[0], 100), float("nan"), device=device)
    wide[:, :80] = rows
    got = combine_rows(wide[:, :80], inverse.int(), 2)
    check_elementwise(got, _ref64(rows, inverse, 2), reference_combine(rows, inverse, 2, rows.dtype), what="strided")


def test_no_tokens(device):
    rows = torch.empty(0, 16, device=device)
    assert combine_rows(rows, torch.empty(0, dtype=torch.long, device=device), 4).shape == (0, 16)


def test_bad_arguments_name_themselves(device):
    rows, inverse = _case(device, torch.float32, T=4, k=2, n=8, seed=5)
    with pytest.raises(ValueError, match="k must"):
        combine_rows(rows, inverse, 0)
    with pytest.raises(ValueError, match="inverse must"):
        combine_rows(rows, inverse[:-1], 2)
    with pytest.raises(ValueError, match="inverse must"):
        combine_rows(rows, inverse.float(), 2)
    with pytest.raises(ValueError, match="rows must"):
        combine_rows(rows.t(), inverse, 2)
    with pytest.raises(ValueError, match="inverse must"):
        combine_rows(rows, inverse, 3)
