"""Grouped expert products vs float64 math: rows of each group times its matrix, and the per-group
weight-gradient product. Odd sizes, empty groups (first, middle, last), strided (transposed) weight
views, fp32 (1e-5 relative) and bf16 (‖kernel − ref64‖ ≤ 2·‖torch bf16 − ref64‖ + eps·‖ref64‖)."""

import pytest
import torch

from fasttune.kernels import moe_reference as reference
from fasttune.kernels.grouped_mm import grouped_mm, grouped_mm_wgrad
from helpers.kernel_checks import check_in_norm

# Group sizes with empty groups first, in the middle and last; one group wider than a 64-row tile.
COUNTS = [0, 3, 0, 70, 1, 0]


def _offs(counts, device):
    """[E] int32 inclusive row ends of groups of these sizes (grouped_mlp computes its own from the sort)."""
    return torch.tensor(counts).cumsum(0).to(device, torch.int32)


def _bf16_loop(x, w, offs):
    """Plain torch in bf16, group by group: the 'same dtype' comparator."""
    out, lo = [], 0
    for g, hi in enumerate(offs.tolist()):
        out.append(x[lo:hi] @ w[g])
        lo = hi
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_matches_float64(device, dtype, transposed):
    g = torch.Generator().manual_seed(1 + transposed)
    S, K, N, E = sum(COUNTS), 37, 45, len(COUNTS)
    x = torch.randn(S, K, generator=g).to(device, dtype)
    w = torch.randn(E, N, K, generator=g).to(device, dtype).transpose(1, 2) if transposed else \
        torch.randn(E, K, N, generator=g).to(device, dtype)
    offs = _offs(COUNTS, device)
    got = grouped_mm(x, w, offs)
    ref64 = reference.grouped_mm(x.double(), w.double(), offs)
    assert got.dtype == dtype
    if dtype == torch.float32:
        check_in_norm(got, ref64, what="y")
    else:
        check_in_norm(got, ref64, _bf16_loop(x, w, offs), what="y", lowp=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_wgrad_matches_float64_and_zeroes_empty_groups(device, dtype):
    g = torch.Generator().manual_seed(3)
    S, M, N, E = sum(COUNTS), 29, 70, len(COUNTS)
    a = torch.randn(S, M, generator=g).to(device, dtype)
    b = torch.randn(S, N, generator=g).to(device, dtype)
    offs = _offs(COUNTS, device)
    got = grouped_mm_wgrad(a, b, offs, E)
    assert got.shape == (E, M, N) and got.dtype == dtype
    for e, n in enumerate(COUNTS):
        if n == 0:
            assert torch.equal(got[e], torch.zeros_like(got[e])), f"empty group {e} not zero"
    ref64 = reference.grouped_mm_wgrad(a.double(), b.double(), offs, E)
    if dtype == torch.float32:
        check_in_norm(got, ref64, what="dW")
    else:
        same = torch.stack([a[lo:hi].t() @ b[lo:hi] if hi > lo else torch.zeros(M, N, dtype=dtype, device=device)
                            for lo, hi in zip([0] + offs.tolist()[:-1], offs.tolist())])
        check_in_norm(got, ref64, same, what="dW", lowp=dtype)


def test_bad_inputs_name_the_argument(device):
    x, w = torch.randn(4, 8, device=device), torch.randn(2, 8, 3, device=device)
    offs = torch.tensor([1, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="offs"):
        grouped_mm(x, w, offs.long())
    with pytest.raises(TypeError, match="w must"):
        grouped_mm(x, w.double(), offs)
    with pytest.raises(ValueError, match="x \\[S, K\\]"):
        grouped_mm(x, w.transpose(1, 2), offs)
    with pytest.raises(TypeError, match="x must"):
        grouped_mm(x.long(), w, offs)
    with pytest.raises(ValueError, match="a \\[S, M\\]"):
        grouped_mm_wgrad(x, x[:3], offs, 2)


@pytest.mark.gpu
def test_torch_grouped_mm_path_at_real_size():
    """Qwen3-30B-A3B's gate_up shape on torch's grouped GEMM (bf16), one expert without rows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    E, K, N, S = 128, 2048, 1536, 8192
    ids = torch.randint(0, E - 1, (S,), generator=g, device="cuda").sort().values
    offs = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)
    x = torch.randn(S, K, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2) * K ** -0.5
    check_in_norm(grouped_mm(x, w, offs), reference.grouped_mm(x.double(), w.double(), offs), _bf16_loop(x, w, offs),
                  what="y", lowp=torch.bfloat16)
    dy = torch.randn(S, N, generator=g, device="cuda", dtype=torch.bfloat16)
    dw = grouped_mm_wgrad(x, dy, offs, E)
    assert torch.equal(dw[E - 1], torch.zeros_like(dw[E - 1]))
    half = offs.clamp(max=4096)
    ref = reference.grouped_mm_wgrad(x[:4096].double(), dy[:4096].double(), half, E)
    same = reference.grouped_mm_wgrad(x[:4096], dy[:4096], half, E)
    check_in_norm(grouped_mm_wgrad(x[:4096], dy[:4096], half, E), ref, same, what="dW", lowp=torch.bfloat16)
